"""The model to train, loaded or built from a config (from scratch) and made ready for training. Its class, attention
kernel and dtype, grown embeddings, activation checkpointing, the adapter or the frozen parameters; and a quantized base
loaded again as the run loaded it. What kind of model, which attention kernel and which precision a run uses is decided
once, in resolved.py; the loaders here are given it."""

from __future__ import annotations

from typing import Any, NamedTuple

from tuneloop.config import TuneloopConfig
from tuneloop.errors import UserError
from tuneloop.model.model_config import checked_source, model_class, model_config, revision_options
from tuneloop.model.vision import freeze_vision_modules

def enable_checkpointing(cfg: TuneloopConfig, model, checkpointing: bool | str) -> None:
    """Activation checkpointing (recompute each layer in the backward), non-reentrant unless the config's
    gradient_checkpointing_kwargs say otherwise; `checkpointing` (resolved.gradient_checkpointing) "offload" keeps
    the checkpoints in CPU memory."""
    from tuneloop.adapters import checkpointing_kwargs

    import torch

    # on a CPU the checkpoints are in CPU memory already (and pinned copies need an accelerator)
    offload = checkpointing == "offload" and torch.cuda.is_available()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs(cfg),
                                              offload=offload)
    elif offload:
        raise UserError("config: `gradient_checkpointing: offload` needs transformers 5.24 or later; set it to true")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(cfg))

GROWN_ROWS_SEED = 0  # new tokens' embedding rows are drawn with this seed, wherever a base model is grown


def grow_embeddings(model, vocabulary: int) -> None:
    """The embeddings grown to `vocabulary` rows. transformers draws the new rows at random (around the old rows'
    mean); drawn from a fixed seed, the same base grows the same rows in `train`, in a preference run's
    reference, in `eval` and in `infer`, whatever the process drew before."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(GROWN_ROWS_SEED)
        # (on the meta device there are no values to average: the rows come from rank 0 with the rest)
        model.resize_token_embeddings(vocabulary, mean_resizing=model.device.type != "meta")

def weights_dtype(cfg: TuneloopConfig):
    """fp32 weights (mixed precision computes in bf16 where asked), or bf16/fp16 weights where the config says
    `bfloat16`/`float16` (axolotl's keys: no fp32 copy at all). A LoRA adapter stays fp32 either way (peft)."""
    import torch

    return torch.bfloat16 if cfg.bfloat16 else torch.float16 if cfg.float16 else torch.float32

class QuantizedBase(NamedTuple):
    """How a QLoRA / 8-bit run loaded its base, so that eval, infer, merge-lora and export load it the same way."""

    bnb_config: Any  # transformers' BitsAndBytesConfig
    dtype: Any  # the dtype the weights were loaded in (and quantized from)
    # `quantize_moe_experts`: the expert weights quantized after loading (quant/quantized_experts.py)
    experts: bool = False

    def quantize_experts(self, model) -> None:
        """The expert weights of a loaded base (its adapter attached or not) quantized as the run quantized them."""
        if self.experts:
            from tuneloop.quant.quantized_experts import quantize_experts, remove_lora_proxies_after_each_forward

            quantize_experts(model, self.bnb_config)
            remove_lora_proxies_after_each_forward(model)


def quantized_base(cfg) -> QuantizedBase | None:
    from tuneloop.adapters import quantization_config
    from tuneloop.host.hardware import quantized_loading

    kind = quantized_loading(cfg)
    if not kind:
        return None
    return QuantizedBase(quantization_config(cfg, kind), weights_dtype(cfg), bool(cfg.quantize_moe_experts))

def load_model(cfg: TuneloopConfig, resolved, tokenizer, checkpoint=None, on_meta: bool = False):
    """The model to train (of the run's kind, with its attention kernel: resolved.py); from a checkpoint's weights
    when resuming (the adapter's, for LoRA). `on_meta`: built without weights on the meta device, adapter and all,
    for an engine that sends this rank its weights when it starts (engines/fsdp2.py)."""
    from safetensors import SafetensorError

    from tuneloop.adapters import quantization_config
    from tuneloop.host.hardware import quantized_loading
    from tuneloop.quant.mxfp4 import dequantizes_mxfp4, mxfp4_loading_config

    from tuneloop.kernels.packed_attention import loadable

    config = model_config(cfg, tokenizer)
    built = model_class(cfg, resolved.model_kind)
    attention = loadable(resolved.attention.used)
    if resolved.engine.mesh_keys.cp:  # the kernel behind context parallel's exchange (engines/context_parallel.py)
        from tuneloop.engines import context_parallel

        attention = context_parallel.loadable(attention)
    if on_meta:
        import torch

        with torch.device("meta"):
            return _prepared_for_training(cfg, resolved, built_from_config(cfg, built, config, attention),
                                          tokenizer, False, None)
    if cfg.from_scratch and checkpoint is None:
        return _prepared_for_training(cfg, resolved, built_from_config(cfg, built, config, attention),
                                      tokenizer, False, checkpoint)
    if checkpoint is not None and not cfg.adapter:  # the checkpoint's whole weights (an adapter's sit on the base)
        source, options = str(checkpoint), {}
    else:
        source, options = checked_source(cfg.base_model, "base_model"), {**revision_options(cfg), "config": config}
    quantized = quantized_loading(cfg)
    if quantized:
        options["quantization_config"] = quantization_config(cfg, quantized)
    # gpt-oss's MXFP4 experts unpacked as they load (quant/mxfp4.py); a full checkpoint of the run holds them unpacked
    if "config" in options and dequantizes_mxfp4(cfg, config):
        options["quantization_config"] = mxfp4_loading_config(cfg)
    try:
        model = built.from_pretrained(source, dtype=weights_dtype(cfg), trust_remote_code=cfg.trust_remote_code,
                                      attn_implementation=attention, **options)
    except (OSError, ValueError, SafetensorError) as error:  # missing, unreadable or damaged weights
        raise UserError(f"model: cannot load {source!r}: {type(error).__name__}: {error}") from None
    if cfg.quantize_moe_experts:  # before peft's preparation, which would upcast 16-bit experts to fp32 first
        from tuneloop.quant.quantized_experts import quantize_experts_as_asked

        quantize_experts_as_asked(model, options["quantization_config"], source)
    return _prepared_for_training(cfg, resolved, model, tokenizer, quantized, checkpoint)

def built_from_config(cfg: TuneloopConfig, built, config, attention: str | None):
    """Random weights from the config (training from scratch), drawn from the run's seed."""
    import torch

    options = {"dtype": weights_dtype(cfg), "attn_implementation": attention}
    try:
        if hasattr(built, "from_config"):  # an Auto class
            return built.from_config(config, trust_remote_code=cfg.trust_remote_code, **options)
        return built._from_config(config, dtype=options["dtype"], attn_implementation=attention)
    except (ValueError, TypeError, torch.OutOfMemoryError) as error:
        raise UserError(f"model: cannot build a {config.model_type} model from its config: {error}") from None

def _prepared_for_training(cfg: TuneloopConfig, resolved, model, tokenizer, quantized, checkpoint):
    """The loaded or built model made ready: cache off, embeddings grown to the tokenizer, checkpointing (the
    run's: resolved.gradient_checkpointing), the adapter or the frozen parameters."""
    from tuneloop.kernels import rms_norm, swiglu
    from tuneloop.adapters import add_adapter, freeze_all_but, prepare_quantized

    # A cache in training defeats the packed-sequence mask (STACK-NOTES trap 1) and wastes memory.
    model.config.use_cache = False
    rms_norm.use_in(model)  # LLaMA-formula norms: the same forward, a leaner backward
    swiglu.use_in(model)  # LLaMA-formula MLPs: the same values, SiLU's output made again in the backward
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        grow_embeddings(model, len(tokenizer))
    checkpointing = resolved.gradient_checkpointing
    if quantized:
        model = prepare_quantized(cfg, model, checkpointing)  # (peft's preparation checkpoints in place)
    if checkpointing == "offload" or (checkpointing and not quantized):
        enable_checkpointing(cfg, model, checkpointing)
    if cfg.adapter:
        return add_adapter(cfg, model, resolved.model_kind.peft_task_type, checkpoint, checkpointing)
    if cfg.unfrozen_parameters:
        freeze_all_but(model, cfg.unfrozen_parameters)
    if cfg.freeze_mm_modules:
        freeze_vision_modules(cfg, model)
    if checkpointing and (cfg.unfrozen_parameters or cfg.freeze_mm_modules):
        from tuneloop.adapters import require_input_grads_where_trained

        require_input_grads_where_trained(model)  # (re-entrant checkpointing's hooks: a frozen tower builds no graph)
    return model
