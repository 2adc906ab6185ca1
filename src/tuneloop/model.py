"""Load the tokenizer and the model: model kind, attention choice, precision, adapters, checkpointing."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from tuneloop.config import TuneloopConfig
from tuneloop.data.formats import chat_template_of
from tuneloop.errors import UserError
from tuneloop.registry import Registry


@dataclass(frozen=True)
class ModelKind:
    auto_class: str  # the transformers Auto class that builds and loads it
    peft_task_type: str  # what peft calls it, for LoRA


MODEL_KINDS: Registry[ModelKind] = Registry("model kind", "model_type")
MODEL_KINDS.add("causal", ModelKind("AutoModelForCausalLM", peft_task_type="CAUSAL_LM"))


def model_kind(cfg: TuneloopConfig) -> ModelKind:
    """Causal language models today; seq2seq (T5) will be chosen here from the config or the checkpoint."""
    return MODEL_KINDS["causal"]


def auto_class(kind: ModelKind):
    import transformers

    return getattr(transformers, kind.auto_class)


def _checked_source(name: str, key: str) -> str:
    """A local-looking path that does not exist is the user's to fix (aliases are resolved upstream)."""
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
        raise UserError(f"config: `{key}: {name}` is not an existing folder")
    return name


def load_tokenizer(cfg: TuneloopConfig):
    from transformers import AutoTokenizer

    key = "tokenizer_config" if cfg.tokenizer_config else "base_model"
    source = _checked_source(cfg.tokenizer_config or cfg.base_model, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(f"model: cannot load a tokenizer from {source!r}: {error}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"model: the tokenizer of {source!r} is not a fast tokenizer; tuneloop needs character "
                        "offsets to mask prompts exactly")
    if cfg.special_tokens:
        tokenizer.add_special_tokens(dict(cfg.special_tokens))
    if tokenizer.pad_token is None:
        # padding positions never reach the loss or attention, so any id will do; eos is the convention
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.chat_template in ("chatml", "jinja"):
        tokenizer.chat_template = chat_template_of(cfg, tokenizer)  # saved with the model, for inference
    return tokenizer


def mixed_precision(cfg: TuneloopConfig) -> str:
    """Accelerate's mixed_precision string for the config on this machine."""
    import torch

    if cfg.fp16:
        if not torch.cuda.is_available():  # accelerate would accept it and quietly train in fp32
            raise UserError("config: `fp16: true` needs a CUDA GPU, and this machine has none (accelerate would "
                            "silently train in fp32 here). Remove it, or use `bf16: true` where the CPU has bf16.")
        return "fp16"
    if cfg.bf16 == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cfg.bf16 else "no"


def attention_implementation(cfg: TuneloopConfig) -> str:
    import torch

    if cfg.attn_implementation:
        chosen = cfg.attn_implementation
    elif cfg.flash_attention:
        chosen = "flash_attention_2"
    else:
        chosen = "sdpa"
    if chosen == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise UserError("model: flash attention was asked for (`flash_attention: true`) but the flash-attn "
                            "package is not installed; install it on a CUDA machine or use sdp_attention") from None
        if not torch.cuda.is_available():
            raise UserError("model: flash attention needs a CUDA GPU; use sdp_attention on this machine")
    return chosen


@dataclass
class ModelFacts:
    """What the plan needs to know of the model, read from its config alone (no weights)."""

    config: object  # the transformers config
    parameters: int
    trainable_parameters: int  # all of them, or the adapter's
    max_positions: int | None  # n_positions / max_position_embeddings, where the config has one
    learned_positions: bool  # a position-embedding table of max_positions rows: longer rows cannot run at all


def model_facts(cfg: TuneloopConfig, tokenizer=None) -> ModelFacts:
    """The model built on the meta device (no memory, no weights read), with the adapter when there is one, so
    the counts are the real ones."""
    import torch
    from transformers import AutoConfig

    source = _checked_source(cfg.base_model, "base_model")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        with torch.device("meta"):
            model = auto_class(model_kind(cfg)).from_config(config, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(f"model: cannot read the config of {source!r}: {error}") from None
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().num_embeddings:
        with torch.device("meta"):
            model.resize_token_embeddings(len(tokenizer))
    parameters = sum(p.numel() for p in model.parameters())
    max_positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    inputs = model.get_input_embeddings()
    learned = max_positions is not None and any(
        isinstance(module, torch.nn.Embedding) and module is not inputs and module.num_embeddings == max_positions
        for module in model.modules())
    if cfg.adapter:
        model = add_adapter(cfg, model, model_kind(cfg))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ModelFacts(config, parameters, trainable, max_positions, learned)


def check_sequence_len(cfg: TuneloopConfig, facts: ModelFacts) -> str | None:
    """A refusal when rows longer than the model's position table would crash mid-training; a warning (returned)
    when only the trained context length is exceeded (rotary positions extrapolate, often badly)."""
    limit = facts.max_positions
    if limit is None or cfg.sequence_len <= limit:
        return None
    if facts.learned_positions:
        raise UserError(f"config: `sequence_len: {cfg.sequence_len}` is longer than the {limit} positions this model "
                        f"has ({cfg.base_model}: a learned position table); set sequence_len to {limit} or less")
    return (f"sequence_len={cfg.sequence_len} is above the model's max_position_embeddings={limit}: positions past "
            f"{limit} were never trained; quality may drop on rows that long.")


def load_model(cfg: TuneloopConfig, tokenizer, checkpoint=None):
    """The model to train; from a checkpoint's weights when resuming (the adapter's, for LoRA)."""
    import torch

    kind = model_kind(cfg)
    source = _checked_source(cfg.base_model, "base_model")
    if checkpoint is not None and not cfg.adapter:
        source = str(checkpoint)
    from safetensors import SafetensorError

    try:
        model = auto_class(kind).from_pretrained(
            source, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
            attn_implementation=attention_implementation(cfg),
        )
    except (OSError, ValueError, SafetensorError) as error:  # missing, unreadable or damaged weights
        raise UserError(f"model: cannot load {source!r}: {type(error).__name__}: {error}") from None
    # A cache in training defeats the packed-sequence mask (STACK-NOTES trap 1) and wastes memory.
    model.config.use_cache = False
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.adapter:
        model = add_adapter(cfg, model, kind, checkpoint)
    return model


def add_adapter(cfg: TuneloopConfig, model, kind: ModelKind, checkpoint=None):
    if cfg.adapter == "qlora":
        raise UserError("model: `adapter: qlora` needs bitsandbytes on a CUDA GPU; it is not available here. "
                        "Use `adapter: lora`.")
    from peft import LoraConfig, PeftModel, get_peft_model

    if cfg.lora_target_linear:
        targets = "all-linear"
    elif cfg.lora_target_modules:
        targets = cfg.lora_target_modules
    else:
        raise UserError("config: `adapter: lora` needs `lora_target_modules` or `lora_target_linear: true`")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, modules_to_save=cfg.lora_modules_to_save,
                      task_type=kind.peft_task_type)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    with warnings.catch_warnings():
        # peft asks is_gradient_checkpointing, which transformers 5 deprecates: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if checkpoint is not None:
            return PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
        try:
            return get_peft_model(model, lora)
        except ValueError as error:  # peft's "Target modules {...} not found in the base model"
            if "not found in the base model" not in str(error) and "NoMatchingPeftModule" not in type(error).__name__:
                raise
            raise UserError(f"config: `lora_target_modules: {cfg.lora_target_modules}` matches no module of this "
                            f"model; its linear layers are named {', '.join(linear_layer_names(model))} "
                            "(or set `lora_target_linear: true`)") from None


def linear_layer_names(model) -> list[str]:
    """The distinct last names of the model's linear layers (q_proj, v_proj, ...), the output head excluded."""
    import torch

    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})
