"""LLaMA's gated MLP product `silu(gate) * up` as one autograd function: the same values, one tensor fewer kept.

In transformers' LlamaMLP (and the classes its code is copied into: Mistral's, Qwen2's, ...) autograd keeps three
[tokens, intermediate] tensors per layer for this product: the gate's output for SiLU's backward, and SiLU's output
and the up projection's for the product's. SiLU's output is cheap to make again from the gate's, so here it is made
again in the backward and not kept: one [tokens, intermediate] tensor less per layer and micro-batch (the
quickstart: 3.1 MB × 30 layers, in bf16), for one more SiLU pass in the backward. The forward and the backward run
the operators autograd runs (silu, mul, silu_backward) on the same values in the same dtypes: the results are
autograd's to the bit (tested).

Which modules: those whose `forward` has LlamaMLP's source text, read from transformers as installed, and whose
activation is SiLU; only their forward is replaced (`use_in`), bound to the module (names and weights unchanged).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch


class _SiluProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * torch.nn.functional.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if type(gate) is torch.Tensor and type(up) is torch.Tensor:
        return self.down_proj(_SiluProduct.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)  # a DTensor (tensor parallel) or other subclass: as the class does


@functools.cache
def _llamas_mlp(cls: type) -> bool:
    """Whether `cls.forward` is LlamaMLP's, as text."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    try:
        return inspect.getsource(cls.forward) == inspect.getsource(LlamaMLP.forward)
    except (OSError, TypeError):
        return False


def _is_silu(module) -> bool:
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ == "SiLUActivation"


def replaceable(module: torch.nn.Module) -> bool:
    """A LLaMA-formula SiLU-gated MLP, which `use_in` gives this module's forward (the plan counts what it keeps)."""
    return (_is_silu(getattr(module, "act_fn", None))
            and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))
            and _llamas_mlp(type(module)))


def use_in(model: torch.nn.Module) -> int:
    """Gives every LLaMA-formula SiLU-gated MLP of `model` this module's forward; returns how many."""
    count = 0
    for module in model.modules():
        if replaceable(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
