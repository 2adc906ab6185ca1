"""What kind of model a run trains (MODEL_KINDS), read from the config or the checkpoint's config. The kinds are causal,
seq2seq, the two classifiers and vision-language; here too are what an encoder-decoder run cannot do and which layers
carry state along the sequence. Torch-free at import: resolved.py reads it when `check` runs."""

from __future__ import annotations

from dataclasses import dataclass

from tuneloop.config import TuneloopConfig
from tuneloop.errors import UserError
from tuneloop.registry import Registry

@dataclass(frozen=True)
class ModelKind:
    name: str
    auto_class: str  # the transformers Auto class that builds and loads it
    peft_task_type: str  # what peft calls it, for LoRA
    encoder_decoder: bool = False  # the prompt goes to an encoder, the trained text is the decoder's labels


MODEL_KINDS: Registry[ModelKind] = Registry("model kind", "model_type")
MODEL_KINDS.add("causal", ModelKind("causal", "AutoModelForCausalLM", peft_task_type="CAUSAL_LM"))
MODEL_KINDS.add("seq2seq", ModelKind("seq2seq", "AutoModelForSeq2SeqLM", peft_task_type="SEQ_2_SEQ_LM",
                                     encoder_decoder=True))
# a decoder with a score head over its last real token (a reward model: `reward_model: true`); built on a causal
# checkpoint, its head starts random; under LoRA peft trains the head whole (SEQ_CLS's modules_to_save)
MODEL_KINDS.add("sequence_classification", ModelKind("sequence_classification", "AutoModelForSequenceClassification",
                                                     peft_task_type="SEQ_CLS"))
SEQUENCE_CLASSIFICATION = MODEL_KINDS["sequence_classification"]
# a decoder with a 2-label head on every token (a process reward model: `process_reward_model: true`, each
# reasoning step's end token classified correct or not); built on a causal checkpoint, its head starts random
MODEL_KINDS.add("token_classification", ModelKind("token_classification", "AutoModelForTokenClassification",
                                                  peft_task_type="TOKEN_CLS"))
TOKEN_CLASSIFICATION = MODEL_KINDS["token_classification"]
# a decoder that also reads images (a vision tower and projector before it): chat rows with image parts, the
# processor's image inputs per micro-batch (data/images.py), its loss the causal one over the text tokens
MODEL_KINDS.add("vision_language", ModelKind("vision_language", "AutoModelForImageTextToText",
                                             peft_task_type="CAUSAL_LM"))
VISION_LANGUAGE = MODEL_KINDS["vision_language"]

def kind_of_config(config) -> ModelKind:
    """What a transformers config says the model is (a saved reward model's config names its class)."""
    if any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or ()):
        return SEQUENCE_CLASSIFICATION
    if any(name.endswith("ForTokenClassification") for name in getattr(config, "architectures", None) or ()):
        return TOKEN_CLASSIFICATION
    if getattr(config, "vision_config", None) is not None:
        return VISION_LANGUAGE
    return MODEL_KINDS["seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"]

# layers that mix tokens by attention: a packed row's sequences stay apart under the per-sequence mask
# `layer_types` values of layers that carry state along the sequence (transformers 5.24 writes Mamba and gated
# delta-net layers as linear_attention, LFM2's as conv, Falcon-H1's and Inkling's parallel SSM+attention as
# hybrid); a deny-list, since attention keeps gaining new names (indexed_attention, compressed_sparse_attention,
# window_attention, ...) that all take packed boundaries as attention does
RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"}
# families whose token mixers are recurrent or convolutional even where `layer_types` does not say so
RECURRENT_FAMILIES = ("mamba", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "lfm2", "lfm3", "zamba", "bamba",
                      "falcon_h1")


def recurrent_layers(config) -> str | None:
    """What in this model carries state along the sequence outside attention (state-space, linear-attention or
    short-convolution layers), in words; None for attention-only models. Such a layer runs straight through a
    packed row: transformers' kernels on this stack take no sequence boundaries (Qwen3.5's torch gated-delta rule
    drops its `cu_seqlens`, Mamba's slow path and LFM2's conv take none), so one sequence's state would leak into
    the next."""
    configs = [config, *(getattr(config, name, None) for name in ("text_config", "language_config"))]
    for part in (c for c in configs if c is not None):
        types = getattr(part, "layer_types", None) or getattr(part, "layers_block_type", None)
        others = sorted({str(t) for t in types or ()} & RECURRENT_LAYER_TYPES)
        if others:
            return f"{getattr(part, 'model_type', 'this model')}'s {'/'.join(others)} layers"
        model_type = str(getattr(part, "model_type", ""))
        if model_type.startswith(RECURRENT_FAMILIES):
            return f"{model_type}'s recurrent layers"
    return None

def named_kind(cfg: TuneloopConfig) -> ModelKind | None:
    """The kind `model_type` names (AutoModelForSeq2SeqLM, a seq2seq family's class, or a causal one), if set; a
    reward model is a sequence classifier whatever the checkpoint was."""
    from tuneloop.config.schema import is_seq2seq_class

    if cfg.reward_model or (cfg.model_type or "").endswith("ForSequenceClassification"):
        return SEQUENCE_CLASSIFICATION
    if cfg.process_reward_model or (cfg.model_type or "").endswith("ForTokenClassification"):
        return TOKEN_CLASSIFICATION
    if not cfg.model_type:
        return None
    if cfg.model_type == "AutoModelForImageTextToText" or (cfg.model_type.endswith("ForConditionalGeneration")
                                                           and not is_seq2seq_class(cfg.model_type)):
        return VISION_LANGUAGE
    seq2seq = cfg.model_type == "AutoModelForSeq2SeqLM" or is_seq2seq_class(cfg.model_type)
    return MODEL_KINDS["seq2seq" if seq2seq else "causal"]

def check_encoder_decoder_settings(cfg: TuneloopConfig) -> None:
    """What an encoder-decoder (T5) run cannot do, refused before any data is read."""
    if cfg.sample_packing or cfg.eval_sample_packing:
        key = "sample_packing" if cfg.sample_packing else "eval_sample_packing"
        raise UserError(f"config: `{key}: true` packs rows for a causal model, and this is an encoder-decoder model "
                        "(its relative positions and cross-attention do not separate packed rows): set it to false; "
                        "`group_by_length: true` reclaims most of the padding")
    if cfg.train_on_inputs:
        raise UserError("config: `train_on_inputs: true` trains the prompt's tokens too, and an encoder-decoder's "
                        "prompt is its encoder's input, which it does not predict: remove it")
    if cfg.pretraining_dataset:
        raise UserError("config: `pretraining_dataset` trains a causal model on raw text; an encoder-decoder's "
                        "pretraining (T5's span corruption) is not something tuneloop does. Stream source/target rows "
                        "with `datasets` (type seq2seq) and `streaming: true`")
    for entry in cfg.train_entries + cfg.test_datasets:  # found now, not when a stream reaches the entry
        if entry.type == "completion":
            raise UserError(f"config: `type: completion` trains the whole text, and an encoder-decoder model needs a "
                            f"prompt for its encoder and a target for its decoder ({entry.path}): use `type: "
                            "seq2seq` with field_source/field_target, alpaca, or a chat dataset")
    if cfg.rl:
        raise UserError(f"config: `rl: {cfg.rl}` is preference training of causal models; tuneloop does not train "
                        "encoder-decoder models on preference pairs yet")

def auto_class(kind: ModelKind):
    import transformers

    return getattr(transformers, kind.auto_class)


def loader_for_config(config):
    """The Auto class that loads a saved folder with this config (for `infer`, `eval` and `merge-lora`)."""
    return auto_class(kind_of_config(config))
