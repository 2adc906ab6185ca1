"""Where a model's logits come from: its decoder's states times the output projection, when that is all they are.

The chunked losses (the language model's in train/chunked_loss.py, the preference losses' log-probs in
train/preference.py) meet the projection a chunk of tokens at a time instead of asking the model for its whole
logits; they can only do that when the logits are exactly decoder states @ weight.T. The plan's memory estimate
counts one chunk's logits (chunk_tokens). Light to import: torch is imported where a model is looked at.
"""

from __future__ import annotations

# fp32 logits per chunk (its tokens are this over the vocabulary size), by device. On a CPU, host memory is ample
# and bigger products run faster: 64M logits (256 MB) ran the loss of 2458 tokens × 49,152 in 1.79–1.85 s against
# 2.07–2.12 s at 32M (Zen 4, 2 threads, bf16; 128M: 1.69–1.79 s for twice the memory). On a GPU 32M (128 MB), not
# yet measured against others.
LOGITS_PER_CHUNK = {"cpu": 1 << 26, "gpu": 1 << 25}

# config keys of models whose logits are more than hidden @ lm_head (soft-capping, scaling): they keep the
# plain loss, computed from the model's own logits
LOGIT_STEPS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "scale_width", "output_logits_scaling",
               "mup_width_multiplier")


def output_head(model):
    """(decoder, output projection weight) when the logits are exactly decoder states @ weight.T (a plain
    Linear head without bias, no logit soft-capping or scaling, no adapter on the head), else None."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if getattr(base.config, "vision_config", None) is not None:
        decoder = getattr(base, "model", None)  # (its text decoder alone would not take the images)
    if type(head) is not torch.nn.Linear or head.bias is not None or decoder is None:
        return None
    config = base.config
    if getattr(config, "is_encoder_decoder", False):
        # an encoder-decoder's decoder needs the encoder's states, and T5 scales them before a tied head: its
        # loss is computed from the model's own logits (the decoder side is short: targets only)
        return None
    # a vision-language model keeps them in its text config (its top-level config does not pass them on)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(where, key, None) not in (None, 1, 1.0) for key in LOGIT_STEPS for where in (config, text)):
        return None
    return decoder, head.weight


def chunk_tokens(vocabulary: int) -> int:
    """The tokens of one chunk of the chunked losses."""
    import torch

    return max(1, LOGITS_PER_CHUNK["gpu" if torch.cuda.is_available() else "cpu"] // vocabulary)


def loss_meets_head_in_chunks(cfg, model) -> bool:
    """The language-model loss is chunked unless the config says `chunked_cross_entropy: false` (axolotl's key),
    where the model's logits are decoder states @ weight. Not under QAT: its fake-quantized head (every Linear, as
    axolotl's) is no plain Linear in training, so the loss takes the model's logits; the plan, which looks at the
    model before the fake quantization, must count those too."""
    if cfg is not None and getattr(cfg, "qat", None):
        return False
    return (cfg is None or cfg.chunked_cross_entropy is not False) and output_head(model) is not None
