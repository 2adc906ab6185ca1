"""What is trained: a LoRA adapter (on 4/8-bit quantized weights for QLoRA), or the model's own weights
(all of them, or the ones `unfrozen_parameters` names)."""

from __future__ import annotations

import re
import warnings

from tuneloop.errors import UserError


def lora_targets(cfg, model):
    if cfg.lora_target_linear and cfg.lora_target_modules:  # axolotl takes the union (lm_head added, say)
        if isinstance(cfg.lora_target_modules, str):
            raise UserError("config: `lora_target_linear` with a regex in `lora_target_modules`: give the extra "
                            "modules as a list, or drop one of them")
        return sorted(set(linear_layer_names(model)) | set(cfg.lora_target_modules))
    if cfg.lora_target_linear:
        return "all-linear"
    if cfg.lora_target_modules:
        return cfg.lora_target_modules  # names, or one regex string matched against module paths (peft)
    if cfg.lora_target_parameters:
        return []  # parameters only (None would let peft pick its default modules for the architecture)
    raise UserError("config: `adapter: lora` needs `lora_target_modules`, `lora_target_parameters` or "
                    "`lora_target_linear: true`")


def add_adapter(cfg, model, peft_task_type: str, checkpoint=None):
    """The model with its LoRA adapter (the checkpoint's when resuming)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from tuneloop.quantized_experts import remove_lora_proxies_after_each_forward

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg, model), target_parameters=target_parameters(cfg, model),
                      modules_to_save=cfg.lora_modules_to_save, task_type=peft_task_type)
    if cfg.gradient_checkpointing and not getattr(model, "is_quantized", False):
        model.enable_input_require_grads()
    with warnings.catch_warnings():
        # peft asks is_gradient_checkpointing, which transformers 5 deprecates: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        try:
            if checkpoint is not None:
                adapted = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
            else:
                adapted = get_peft_model(model, lora)
        except ValueError as error:  # peft's "Target modules {...} not found in the base model"
            if "not found in the base model" not in str(error) and "NoMatchingPeftModule" not in type(error).__name__:
                raise
            raise UserError(f"config: `lora_target_modules: {cfg.lora_target_modules}` matches no module of this "
                            f"model; its linear layers are named {', '.join(linear_layer_names(model))} "
                            "(or set `lora_target_linear: true`)") from None
    remove_lora_proxies_after_each_forward(adapted)  # (where experts are quantized: quantized_experts.py)
    return adapted


def target_parameters(cfg, model) -> list[str] | None:
    """`lora_target_parameters` as peft can match them: a quantized expert weight (quantize_moe_experts) is a
    parametrized parameter, which peft finds by its full name only, so the names given (`experts.gate_up_proj`, a
    suffix as peft matches plain parameters) are widened to the full names they end."""
    from tuneloop.quantized_experts import expert_targets, quantized_expert_names

    given = cfg.lora_target_parameters
    quantized = quantized_expert_names(model) if given else []
    if not quantized:
        return given
    others = [name for name in given if not any(full == name or full.endswith(f".{name}") for full in quantized)]
    return others + expert_targets(given, quantized)


def linear_layer_names(model) -> list[str]:
    """The distinct last names of the model's linear layers (q_proj, v_proj, ...), the output head excluded."""
    import torch

    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def quantization_config(cfg, kind: str):
    """bitsandbytes' loading config for QLoRA (4-bit NF4, double quantization, bf16 compute: QLoRA's own
    choices) or 8-bit; `bnb_config_kwargs` overrides any of them."""
    import torch
    from transformers import BitsAndBytesConfig

    if kind == "8bit":
        settings = {"load_in_8bit": True, **(cfg.bnb_config_kwargs or {})}
    else:
        settings = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                    "bnb_4bit_compute_dtype": torch.bfloat16, **(cfg.bnb_config_kwargs or {})}
    try:
        return BitsAndBytesConfig(**settings)
    except (ValueError, TypeError, AttributeError) as error:  # (the config's rules catch the usual mistakes first)
        raise UserError(f"config: `bnb_config_kwargs` {cfg.bnb_config_kwargs}: bitsandbytes' config refuses it: "
                        f"{error}") from None


def prepare_quantized(cfg, model):
    """peft's preparation of quantized weights for training (norms in fp32, input gradients), with the 4-bit
    weights kept in the one layout training reads (keep_4bit_layout)."""
    from peft import prepare_model_for_kbit_training

    keep_4bit_layout(model)
    with warnings.catch_warnings():  # peft calls transformers' deprecated gradient_checkpointing_enable
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(cfg.gradient_checkpointing),
                                               gradient_checkpointing_kwargs=checkpointing_kwargs(cfg))


def keep_4bit_layout(model) -> int:
    """bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks a 4-bit layer's weight in place the first time the layer
    runs in eval mode on an input without gradients (an eval, a generation), and from then on every call of that
    layer, in training too, goes through its bf16 inference kernel, which autograd cannot differentiate through: the
    gradients that should flow through the frozen weights to the layers below are silently dropped (measured: the
    step after an eval moved the adapter 84% away from the right one). Turned off, eval and training compute the
    same dequantize-and-matmul, in the compute dtype. Returns the number of layers it was turned off for."""
    layers = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            layers += 1
    return layers


def checkpointing_kwargs(cfg) -> dict:
    """Non-reentrant by default (it works with frozen inputs and DDP); the config's own kwargs win."""
    return {"use_reentrant": False, **(cfg.gradient_checkpointing_kwargs or {})}


def name_pattern(pattern: str) -> str:
    """axolotl's reading of an `unfrozen_parameters` pattern: a dot is a literal dot (parameter names are dotted
    paths), except in `.+`."""
    return re.sub(r"\.(?!\+)", r"\\.", pattern)


def freeze_all_but(model, patterns: list[str]) -> None:
    """Full fine-tuning of the parameters whose names match one of the patterns (axolotl's
    `unfrozen_parameters`, matched from the start of the name as axolotl does); the rest is frozen."""
    compiled = [re.compile(name_pattern(pattern)) for pattern in patterns]
    trained = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad = any(pattern.match(name) for pattern in compiled)
        trained += parameter.requires_grad
    if not trained:
        names = [name for name, _ in model.named_parameters()]
        raise UserError(f"config: `unfrozen_parameters: {patterns}` matches no parameter of this model (its "
                        f"parameters are named like {', '.join(names[:3])}, …)")
