"""What is trained: a LoRA adapter (on 4/8-bit quantized weights for QLoRA), or the model's own weights
(all of them, or the ones `unfrozen_parameters` names)."""

from __future__ import annotations

import re
import warnings

from tuneloop.config.names import name_pattern
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


def lora_config(cfg, model, peft_task_type: str):
    """peft's LoraConfig as the config asks for it, the LoRA variants included (DoRA, rsLoRA, the start of A and B,
    fan-in-fan-out weights); LoRA+ is the optimizer's (optim.py)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg, model), target_parameters=target_parameters(cfg, model),
                      modules_to_save=cfg.lora_modules_to_save, task_type=peft_task_type,
                      use_dora=cfg.peft_use_dora, use_rslora=cfg.peft_use_rslora,
                      init_lora_weights=cfg.peft_init_lora_weights, fan_in_fan_out=bool(cfg.lora_fan_in_fan_out))


def add_adapter(cfg, model, peft_task_type: str, checkpoint=None, checkpointing: bool | str = False):
    """The model with its LoRA adapter: the checkpoint's when resuming, else `lora_model_dir`'s trained one when
    set, else a new one. `checkpointing`: the run's (resolved.gradient_checkpointing)."""
    from peft import PeftModel, get_peft_model

    from tuneloop.quant.quantized_experts import remove_lora_proxies_after_each_forward

    lora = lora_config(cfg, model, peft_task_type)
    start = checkpoint if checkpoint is not None else adapter_folder(cfg)
    if start is not None and checkpoint is None:
        check_adapter_agrees(cfg, lora, start, model)
    if start is not None and on_meta(model):
        start = None  # a count (the plan) or an FSDP2 rank that is sent its weights: the agreeing new adapter's shape
    with warnings.catch_warnings():
        # peft asks is_gradient_checkpointing, which transformers 5 deprecates: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # (peft sets fan_in_fan_out to what each layer stores; the plan says so where the config said otherwise:
        # fan_in_fan_out_note)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to", category=UserWarning)
        try:
            if start is not None:
                adapted = PeftModel.from_pretrained(model, str(start), is_trainable=True)
            else:
                adapted = get_peft_model(model, lora)
        except ValueError as error:  # peft's "Target modules {...} not found in the base model"
            if "not found in the base model" in str(error) or "NoMatchingPeftModule" in type(error).__name__:
                raise UserError(f"config: `lora_target_modules: {cfg.lora_target_modules}` matches no module of "
                                f"this model; its linear layers are named {', '.join(linear_layer_names(model))} "
                                "(or set `lora_target_linear: true`)") from None
            if not uses_lora_variant(cfg):
                raise
            raise UserError(f"config: peft cannot build this LoRA variant on {type(model).__name__}: {error}") from None
    remove_lora_proxies_after_each_forward(adapted)  # (where experts are quantized: quant/quantized_experts.py)
    if checkpointing:
        require_input_grads_where_trained(adapted.get_base_model())
    return adapted


# peft's LoRA layers over a weight matrix, whose fan_in_fan_out peft sets from the layer it wraps: (in, out) for
# GPT-2's Conv1D, (out, in) for nn.Linear and bitsandbytes' 4/8-bit layers
LAYOUT_LAYERS = ("Linear", "Linear8bitLt", "Linear4bit")


def fan_in_fan_out_note(cfg, adapted) -> str | None:
    """`lora_fan_in_fan_out` states how the adapted layers store their weights, and peft keeps to the layers: a value
    they contradict trains as without the key (in axolotl too, which hands it to peft). `check` cannot see the
    layers, so the run accepts it as check does, and the plan (which `train` prints too) says so; None otherwise."""
    if cfg.lora_fan_in_fan_out is None:
        return None
    contradicting = sorted({name.rsplit(".", 1)[-1] for name, module in adapted.named_modules()
                            if type(module).__name__ in LAYOUT_LAYERS and hasattr(module, "lora_A")
                            and module.fan_in_fan_out != cfg.lora_fan_in_fan_out})
    if not contradicting:
        return None
    layout = "(out, in)" if cfg.lora_fan_in_fan_out else "(in, out)"
    return (f"`lora_fan_in_fan_out: {str(cfg.lora_fan_in_fan_out).lower()}` does not match how this model's "
            f"{', '.join(contradicting)} store their weights {layout}: peft trains them as they store them, as "
            "without the key (as axolotl's run would); remove it")


def require_input_grads_where_trained(model) -> None:
    """Checkpointed layers under an adapter need inputs that require a gradient (re-entrant checkpointing would
    leave the adapter's weights inside them without one), so a sub-model's input embeddings mark their output so.
    transformers' `enable_input_require_grads` marks every sub-model's, a vision tower's patch embedding too, and
    it is called more than once (by re-entrant checkpointing's set-up, by peft, by peft's k-bit preparation), each
    time adding hooks its `disable_input_require_grads` cannot all find: a frozen tower then builds a graph, keeps
    its activations and runs a backward that reaches no trained weight. Here those hooks are taken off (by their
    name) and only the embeddings of a sub-model that holds a trained parameter are marked, once."""
    from transformers import PreTrainedModel

    def require_grad(module, inputs, output):
        output.requires_grad_(True)

    hooks, seen = [], set()
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        try:
            embeddings = module.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            continue
        if embeddings is None or id(embeddings) in seen or not hasattr(embeddings, "register_forward_hook"):
            continue
        seen.add(id(embeddings))
        for key, hook in list(embeddings._forward_hooks.items()):
            if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):  # (transformers', peft's)
                del embeddings._forward_hooks[key]
        if any(parameter.requires_grad for parameter in module.parameters()):
            hooks.append(embeddings.register_forward_hook(require_grad))
    model._require_grads_hooks = hooks  # (transformers' own list: its disable_input_require_grads removes them)


def uses_lora_variant(cfg) -> bool:
    return (cfg.peft_use_dora or cfg.peft_use_rslora or cfg.peft_init_lora_weights is not True
            or cfg.lora_fan_in_fan_out is not None)


def on_meta(model) -> bool:
    return any(parameter.device.type == "meta" for parameter in model.parameters())


def adapter_folder(cfg):
    """`lora_model_dir` as a folder holding a saved adapter, or None when unset."""
    from pathlib import Path

    from tuneloop.run_files import ADAPTER_CONFIG

    if not cfg.lora_model_dir:
        return None
    folder = Path(cfg.lora_model_dir)
    if not (folder / ADAPTER_CONFIG).is_file():
        what = "is not a folder" if not folder.is_dir() else f"holds no {ADAPTER_CONFIG}"
        raise UserError(f"config: `lora_model_dir: {cfg.lora_model_dir}` {what}: give the folder of a saved LoRA "
                        f"adapter (a LoRA run's output_dir or one of its checkpoints, with {ADAPTER_CONFIG} in it), "
                        "or remove the key to start a new adapter")
    return folder


# the LoraConfig fields that decide an adapter's shape and maths: a saved adapter and the config must agree on them
AGREEING_FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
                   "use_dora": "peft_use_dora", "use_rslora": "peft_use_rslora",
                   "target_modules": "lora_target_modules", "target_parameters": "lora_target_parameters",
                   "modules_to_save": "lora_modules_to_save",
                   # (not fan_in_fan_out: peft sets it from the layers when it loads the adapter, whatever either says)
                   # (settings tuneloop refuses: an adapter made with them is refused as differing from the config)
                   "rank_pattern": "lora_rank_pattern", "alpha_pattern": "lora_alpha_pattern",
                   "layers_to_transform": "peft_layers_to_transform", "lora_bias": "lora_bias"}


def check_adapter_agrees(cfg, lora, folder, model) -> None:
    """`lora_model_dir`'s adapter is trained on as saved (peft reads its adapter_config.json); a LoRA key of the
    config that says otherwise would be ignored, so it is refused, naming each difference."""
    from peft import LoraConfig

    from tuneloop.config.schema import BASE_REWRITING_INITS

    saved = LoraConfig.from_pretrained(str(folder))
    start = saved.init_lora_weights
    if isinstance(start, str) and (start in BASE_REWRITING_INITS or start.startswith("pissa_niter_")):
        raise UserError(f"config: the adapter in `lora_model_dir: {cfg.lora_model_dir}` was started with "
                        f"init_lora_weights={start}, which rewrote its base weights: on the original base it means "
                        "something else; convert it to a plain LoRA adapter first (peft's "
                        "path_initial_model_for_weight_conversion) or start a new adapter")
    differences = [f"{key} ({_comparable(getattr(saved, field), model)} there, "
                   f"{_comparable(getattr(lora, field), model)} here)"
                   for field, key in AGREEING_FIELDS.items()
                   if _comparable(getattr(saved, field), model) != _comparable(getattr(lora, field), model)]
    if differences:
        raise UserError(f"config: the adapter in `lora_model_dir: {cfg.lora_model_dir}` was made with other LoRA "
                        f"settings than this config's: {'; '.join(differences)}; make the config say what the adapter "
                        "is (the folder's adapter_config.json)")


def _comparable(value, model):
    """A LoraConfig value in one form: "all-linear" as the layer names peft resolves it to, collections as sorted
    lists, nothing as None."""
    if value == "all-linear":
        value = linear_layer_names(model)
    if isinstance(value, (list, set, tuple)):
        return sorted(value) or None
    return value


def target_parameters(cfg, model) -> list[str] | None:
    """`lora_target_parameters` as peft can match them: a quantized expert weight (quantize_moe_experts) is a
    parametrized parameter, which peft finds by its full name only, so the names given (`experts.gate_up_proj`, a
    suffix as peft matches plain parameters) are widened to the full names they end."""
    from tuneloop.quant.quantized_experts import expert_targets, quantized_expert_names

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


def four_bit_compute_dtype(cfg) -> str:
    """The dtype a 4-bit layer dequantizes its weight to and multiplies in: `bnb_config_kwargs.bnb_4bit_compute_dtype`
    where given, else the run's own, the dtype its activations arrive in (axolotl's choice too): bf16 under bf16
    mixed precision (`bf16: true`, or `auto` where the machine has native bf16, as resolved.precision decides), fp16
    under `fp16`, else the weights' (`bfloat16`/`float16`, or float32: an fp32 run computes in fp32). Before, an fp32
    run's 4-bit layers computed in bf16 unasked: rounding every product to bf16 made 2 ranks' adapter 2e-4 away from
    one process's after 4 steps (any engine: the ranks' gradients added in another order, then rounded), 1e-7 in
    fp32."""
    from tuneloop.host.hardware import mixed_precision, native_bf16

    given = (cfg.bnb_config_kwargs or {}).get("bnb_4bit_compute_dtype")
    if given is not None:
        return str(given).removeprefix("torch.")
    mixed, _ = mixed_precision(cfg.fp16, cfg.bf16, native_bf16() if cfg.bf16 == "auto" and not cfg.fp16 else None)
    if mixed != "no":
        return {"bf16": "bfloat16", "fp16": "float16"}[mixed]
    return "bfloat16" if cfg.bfloat16 else "float16" if cfg.float16 else "float32"


def quantization_config(cfg, kind: str):
    """bitsandbytes' loading config for QLoRA (4-bit NF4 and double quantization, QLoRA's own choices, computed in
    the run's dtype: four_bit_compute_dtype) or 8-bit; `bnb_config_kwargs` overrides any of them."""
    import torch
    from transformers import BitsAndBytesConfig

    given = cfg.bnb_config_kwargs or {}
    if kind == "8bit":
        settings = {"load_in_8bit": True, **given}
    else:
        settings = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, **given}
        if given.get("bnb_4bit_compute_dtype") is None:  # (a given one is checked by the config's rules and below)
            settings["bnb_4bit_compute_dtype"] = getattr(torch, four_bit_compute_dtype(cfg))
    try:
        return BitsAndBytesConfig(**settings)
    except (ValueError, TypeError, AttributeError) as error:  # (the config's rules catch the usual mistakes first)
        raise UserError(f"config: `bnb_config_kwargs` {cfg.bnb_config_kwargs}: bitsandbytes' config refuses it: "
                        f"{error}") from None


def prepare_quantized(cfg, model, checkpointing: bool | str):
    """peft's preparation of quantized weights for training (norms in fp32, input gradients), with the 4-bit
    weights kept in the one layout training reads (keep_4bit_layout). `checkpointing`: the run's
    (resolved.gradient_checkpointing)."""
    from peft import prepare_model_for_kbit_training

    keep_4bit_layout(model)
    with warnings.catch_warnings():  # peft calls transformers' deprecated gradient_checkpointing_enable
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(checkpointing),
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
