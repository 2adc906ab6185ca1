"""LLaMA's RMSNorm as one autograd function: the same forward, a backward that keeps less and reads less.

transformers' LlamaRMSNorm, and the ~140 classes its code is copied into (Mistral's, Qwen2's and Qwen3's, SmolLM's
LLaMA, Granite's, ...), compute `weight * (x * rsqrt(mean(x²) + eps)).to(x's dtype)` as five operators, and
autograd keeps the normalised x for the weight's gradient beside x itself: one more fp32 tensor the size of the
residual stream per norm and micro-batch (the quickstart: 2.4 MB × 61 norms), and a backward of ~11 passes over
it. Here the forward runs the same operators in the same order (its values are the module's own, bit for bit),
keeps x and one rsqrt per row, and the backward is written out: 7 passes, in fp32 whatever x's dtype.

Which classes: those whose `forward` has LlamaRMSNorm's source text, read from transformers as installed, so a
class whose formula differs (Gemma's `1 + weight`, OLMo-2's order of cast and product) is never replaced. The
module keeps its class, parameters and names (checkpoints and the saved folder are unchanged); only its forward
is this module's, bound to it (`use_in`).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # LlamaRMSNorm.forward's operators, in its order
        wide = hidden.to(torch.float32)
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        normed = (wide * rstd).to(hidden.dtype)
        ctx.save_for_backward(hidden, weight, rstd)
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, rstd = ctx.saved_tensors
        wide = hidden.to(torch.float32)
        grad = grad.to(torch.float32)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # (the output's dtype rounded the normalised x: the weight sees it rounded)
            normed = (wide * rstd).to(hidden.dtype).to(torch.float32)  # made again, not kept
            grad_weight = (grad * normed).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            # d/dx of x·rstd with rstd = (mean(x²) + eps)^-½, g the gradient of the normalised x:
            # g·rstd − x · rstd³ · mean(g·x). Through x, not x·rstd, as autograd's chain goes: a run whose activations
            # overflow gets autograd's non-finite gradient (and the loop's stop), not a quiet zero
            grad_normed = grad * weight.to(torch.float32)
            coefficient = torch.linalg.vecdot(grad_normed, wide).unsqueeze(-1).mul_(rstd.pow(3)).div_(wide.shape[-1])
            grad_hidden = torch.addcmul(grad_normed.mul_(rstd), wide, coefficient, value=-1).to(hidden.dtype)
        return grad_hidden, grad_weight, None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if type(hidden_states) is torch.Tensor and type(self.weight) in _PLAIN:
        return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)  # a DTensor (tensor parallel) or other subclass: the class's own


@functools.cache
def _llamas_formula(cls: type) -> bool:
    """Whether `cls.forward` is LlamaRMSNorm's, as text (the copies transformers keeps of it are verbatim)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    try:
        return inspect.getsource(cls.forward) == inspect.getsource(LlamaRMSNorm.forward)
    except (OSError, TypeError):  # no source to read (a frozen install): left as it is
        return False


def use_in(model: torch.nn.Module) -> int:
    """Gives every LLaMA-formula RMSNorm of `model` this module's forward; returns how many."""
    count = 0
    for module in model.modules():
        if replaceable(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def replaceable(module: torch.nn.Module) -> bool:
    """A LLaMA-formula RMSNorm, which `use_in` gives this module's forward (the plan counts what it keeps)."""
    cls = type(module)
    return cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and _llamas_formula(cls)
