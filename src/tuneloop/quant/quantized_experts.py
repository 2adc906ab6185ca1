"""`quantize_moe_experts`: a mixture-of-experts model's expert weights held in 4-bit beside a QLoRA base.

transformers 5 stores a MoE layer's experts as 3-D parameters (experts × rows × columns: Mixtral's `gate_up_proj`
and `down_proj`), which bitsandbytes' loading leaves alone: it quantizes `nn.Linear` layers only, so without this
most of a MoE model stays in full precision. Here each such parameter (3-D or more, floating point, "expert" in its
name: axolotl's rule) is quantized with bitsandbytes' own 4-bit function (the run's quant type and double
quantization, blocks of 64) and held packed in a frozen uint8 parameter; a `torch.nn.utils.parametrize`
parametrization gives the model back the weights dequantized, in the dtype they were loaded in, whenever the layer
reads them (peft's LoRA on these parameters, `lora_target_parameters`, adds its delta on top the same way: see
remove_lora_proxies_after_each_forward for what peft leaves behind). uint8 storage is never cast by an engine, so
FSDP2 and ZeRO-3 shard the packed bytes as they are. The dequantized weights are in the load dtype even where an
engine computes in bf16 (the quantization state is no parameter an engine casts): a layer's whole expert stack is
materialised in, say, fp32 while it runs, a transient the plan does not count.

Quantized after loading: the load itself still holds the experts in the load dtype for a moment (the plan's peak
does not count that transient). Quantizing the same loaded weights again gives the same values (the function is
deterministic), which is how eval, infer and merge-lora rebuild the base a run trained on.
"""

from __future__ import annotations

import torch
from torch import nn


class DequantizedExperts(nn.Module):
    """The parametrization: the packed 4-bit values → the expert weights, dequantized."""

    def __init__(self, quant_state):
        super().__init__()
        self.quant_state = quant_state  # absmax (quantized again with double quantization) and the code book

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(packed, self.quant_state)


def expert_parameters(model) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, parameter name) of every expert weight not yet quantized."""
    found = []
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.ndim >= 3 and parameter.is_floating_point() and "expert" in f"{module_name}.{name}".lower():
                found.append((module_name, module, name))
    return found


def quantize_experts(model, bnb_config) -> int:
    """Every expert weight to 4-bit, as `bnb_config` (a BitsAndBytesConfig) quantizes the linear layers; frozen.
    Returns how many were quantized."""
    from bitsandbytes.functional import quantize_4bit
    from torch.nn.utils import parametrize

    quantized = 0
    for _, module, name in expert_parameters(model):
        weight = getattr(module, name)
        with torch.no_grad():
            packed, state = quantize_4bit(weight.detach(), blocksize=64, quant_type=bnb_config.bnb_4bit_quant_type,
                                          compress_statistics=bnb_config.bnb_4bit_use_double_quant,
                                          quant_storage=torch.uint8)
        # unsafe: the stored tensor is the packed uint8 one, not the weight's shape and dtype
        parametrize.register_parametrization(module, name, DequantizedExperts(state), unsafe=True)
        module.parametrizations[name].original = nn.Parameter(packed, requires_grad=False)
        quantized += 1
    return quantized


def quantize_experts_as_asked(model, bnb_config, source: str) -> int:
    """`quantize_moe_experts: true` on a loaded 4-bit base: its experts quantized, or a UserError when it has none."""
    from tuneloop.errors import UserError

    quantized = quantize_experts(model, bnb_config)
    if not quantized:
        raise UserError(f"config: `quantize_moe_experts: true`, but {source} has no expert weights to quantize (3-D "
                        "parameters named like `experts.gate_up_proj`): remove the key")
    return quantized


def remove_lora_proxies_after_each_forward(model) -> int:
    """peft 0.21's LoRA on a parameter (`ParamWrapper`) adds its delta as a parametrization for the length of one
    forward, and takes it off after; but when the parameter was parametrized already (our dequantization) and one
    adapter runs on several experts, it adds a `_LoraFactorsProxy` and takes off only `_LoraParameterProxy`s: the
    proxy stays, the next forward stacks another on top (the delta counted twice), and training stops with "only
    Tensors of floating point dtype can require gradients". A forward hook on each such wrapper takes off what
    peft left (and peft's warning that it found nothing to take off, which would follow, is silenced). Returns the
    number of wrappers hooked."""
    import warnings

    hooked = 0
    for module in model.modules():
        name = getattr(module, "parameter_name", None)
        if name is None or not hasattr(module, "get_base_layer") or getattr(module, "_tuneloop_cleans_proxies", False):
            continue
        parametrizations = getattr(module.get_base_layer(), "parametrizations", {})
        steps = parametrizations[name] if name in parametrizations else None
        if steps is None or not any(isinstance(step, DequantizedExperts) for step in steps):
            continue
        module.register_forward_hook(_remove_leftover_proxies)
        module._tuneloop_cleans_proxies = True
        hooked += 1
    if hooked:
        warnings.filterwarnings("ignore", message="Could not find any LoRA parametrization", category=UserWarning)
    return hooked


def _remove_leftover_proxies(wrapper, inputs, output):
    steps = wrapper.get_base_layer().parametrizations[wrapper.parameter_name]
    for index in reversed(range(len(steps))):
        if not isinstance(steps[index], DequantizedExperts):
            del steps[index]


def quantized_expert_names(model) -> list[str]:
    """The full names of the quantized expert weights, as a layer names them (peft matches a parametrized
    parameter by its full name only: `lora_target_parameters` are widened to these)."""
    names = []
    for module_name, module in model.named_modules():
        for name, parametrizations in getattr(module, "parametrizations", {}).items():
            if any(isinstance(step, DequantizedExperts) for step in parametrizations):
                names.append(f"{module_name}.{name}")
    return names


def expert_targets(given: list[str], experts: list[str]) -> list[str]:
    """The full names of the expert weights `lora_target_parameters` (names, or suffixes as peft matches them) picks.
    A UserError where it picks two weights of one experts module: peft 0.21 then nests its wrappers, and the inner
    one reads its weight through the outer one's parametrization cache before adding its delta, so that LoRA would
    silently never train (measured: no gradient reaches it)."""
    from tuneloop.errors import UserError

    picked = [full for full in experts if any(full == name or full.endswith(f".{name}") for name in given)]
    modules = [full.rpartition(".")[0] for full in picked]
    twice = sorted({module for module in modules if modules.count(module) > 1})
    if twice:
        names = [full.rpartition(".")[2] for full in picked if full.startswith(f"{twice[0]}.")]
        raise UserError(f"config: `lora_target_parameters` with `quantize_moe_experts` picks {' and '.join(names)} of "
                        f"one experts module ({twice[0]}); on 4-bit experts peft can train LoRA on one weight per "
                        "module only (with two, one would silently stay untrained): keep one of them")
    return picked


def dequantize_experts(model) -> int:
    """Every quantized expert weight back to a plain parameter holding its dequantized values (merge-lora: the
    adapter folds into what it was trained on). Returns how many."""
    from torch.nn.utils import parametrize

    done = 0
    for module in list(model.modules()):
        for name in list(getattr(module, "parametrizations", {}) or {}):
            if not any(isinstance(step, DequantizedExperts) for step in module.parametrizations[name]):
                continue
            with torch.no_grad():
                value = getattr(module, name).detach().clone()
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            setattr(module, name, nn.Parameter(value, requires_grad=False))
            done += 1
    return done


def expert_parameter_names(model) -> list[str]:
    """The full names of the expert weights not yet quantized (the plan's model, on the meta device)."""
    return [f"{module_name}.{name}" for module_name, _, name in expert_parameters(model)]


def count_expert_weights(model) -> tuple[int, int]:
    """(weights, tensors) of the expert parameters `quantize_moe_experts` would quantize (the plan counts them)."""
    tensors = [getattr(module, name) for _, module, name in expert_parameters(model)]
    return sum(tensor.numel() for tensor in tensors), len(tensors)
