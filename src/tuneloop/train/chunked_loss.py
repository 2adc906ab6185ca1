"""Cross-entropy over a vocabulary without ever holding the [tokens, vocabulary] logits whole.

The hidden states meet the output projection a chunk of tokens at a time. Training computes each chunk's
loss and, in the same pass, its gradients with respect to the hidden states and the projection (the
gradient of a summed cross-entropy is softmax − one-hot, known as soon as the chunk's logits are), so the
backward only scales what the forward kept: a [tokens, hidden] and a [vocabulary, hidden] tensor, the sizes
of the inputs. With SmolLM2's 49,152-token vocabulary a micro-batch of 4 × 2048 tokens would otherwise make
a 1.6 GB fp32 logits tensor, and its softmax and gradient as much again.

The maths is the plain loss's (logits in the autocast dtype, softmax in fp32); only the memory differs, and the
work: only positions with a target meet the head (the plain loss multiplies every position by it and then
ignores the prompt's), so the plan's FLOPs count the head for trained tokens only (plan/flops.py).
"""

from __future__ import annotations

import torch

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.kernels.output_head import chunk_tokens


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the output projection's products run in: autocast's where it is on (bf16), else the input's."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # the product in the compute dtype (bf16 under autocast, as the model's own lm_head would run it); the
    # softmax in fp32
    return torch.nn.functional.linear(hidden, weight).float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss, and the gradients for a backward that then only scales them."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = chunk_tokens(weight.shape[0])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # the first chunk's product becomes it (no zeroed [vocabulary, hidden] to add it to); in fp32 where chunks
        # are summed, else kept in the product's own dtype until the backward casts it to the weight's: a lone
        # chunk's bf16 product gains nothing from an fp32 copy, and held in bf16 between the forward and the
        # backward it takes half the memory (57 MB instead of 113 on SmolLM2; the quickstart's peak RSS fell
        # 0.13 GB)
        grad_weight = None
        dtype = compute_dtype(hidden)
        # only the positions with a target meet the head (a position without one has no loss and no gradient):
        # in chat fine-tuning most are prompt tokens, 69% of the quickstart's. One host sync for their count.
        trained = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)
        states, wanted = hidden.index_select(0, trained), targets.index_select(0, trained).unsqueeze(1)
        summed = states.shape[0] > rows
        # cast once here, not by autocast at each of the chunks' three products
        with torch.autocast(hidden.device.type, enabled=False):
            projection = weight.to(dtype)
            for start in range(0, states.shape[0], rows):
                chunk, chunk_targets = states[start:start + rows].to(dtype), wanted[start:start + rows]
                # one fused log-softmax pass (on a CPU it ran 4x faster than logsumexp and a subtraction)
                log_probs = torch.log_softmax(_chunk_logits(chunk, projection), dim=-1)
                total -= log_probs.gather(1, chunk_targets).sum()
                # d(summed loss)/d(logits) = softmax − one-hot
                grad_logits = log_probs.exp_()
                grad_logits.scatter_add_(1, chunk_targets, -torch.ones_like(chunk_targets, dtype=grad_logits.dtype))
                grad_logits = grad_logits.to(dtype)
                if grad_hidden is not None:
                    grad_hidden.index_copy_(0, trained[start:start + rows],
                                            (grad_logits @ projection).to(grad_hidden.dtype))
                if ctx.needs_input_grad[1]:  # summed over chunks in fp32
                    product = grad_logits.t() @ chunk
                    product = product.float() if summed else product
                    grad_weight = product if grad_weight is None else grad_weight.add_(product)
                del log_probs, grad_logits
        if ctx.needs_input_grad[1] and grad_weight is None:  # no position had a target
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight) if g is not None))
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # scaled in place: the saved gradients are this function's own, and a [vocabulary, hidden] copy a step is
        # 113 MB on SmolLM2. So a second backward through the same forward (retain_graph) would scale them twice:
        # refused. (A 0-d grad_output keeps each tensor's dtype.)
        if getattr(ctx, "scaled", False):
            raise RuntimeError("the chunked cross-entropy's backward ran twice over one forward (retain_graph): "
                               "its saved gradients are scaled in place; run the forward again")
        ctx.scaled = True
        saved = list(ctx.saved_tensors)
        grad_hidden = saved.pop(0).mul_(grad_output) if ctx.needs_input_grad[0] else None
        # (cast first, then scaled: an fp32 weight's gradient is rounded once, in the product, as before)
        grad_weight = saved.pop(0).to(ctx.weight_dtype).mul_(grad_output) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy of `hidden @ weight.T` against `targets` (-100: no loss); hidden [..., H], targets [...]."""
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1))


@torch.no_grad()
def chunked_loss_and_correct(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Eval: the summed loss and the number of targets the argmax gets right, chunk by chunk."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    trained = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)  # only these meet the head (see the forward above)
    hidden, targets = hidden.index_select(0, trained), targets.index_select(0, trained)
    rows = chunk_tokens(weight.shape[0])
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        chunk_targets = targets[start:start + rows]
        logits = _chunk_logits(hidden[start:start + rows], weight)
        loss += torch.nn.functional.cross_entropy(logits, chunk_targets, reduction="sum").double()
        correct += logits.argmax(dim=-1).eq(chunk_targets).sum()
    return loss, correct
