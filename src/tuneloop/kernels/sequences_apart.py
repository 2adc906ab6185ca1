"""Causal attention of each sequence of a CPU batch on its own, as one autograd function over the whole batch.

kernels/packed_attention.py decides where the sequences are (a packed row's, or a padded row's real tokens); this runs
them: one call of SDPA's CPU flash kernel per sequence, forward and backward, with what autograd would otherwise do
around those calls done here directly. Cutting the batch into sequences with autograd's views cost, in the backward, a
cat of each row's gradients, a stack of the rows', and the casts of whole tensors there and back; and joining the
outputs a cat forward. Here each sequence's output is written into the batch's output, and each sequence's gradients
into the batch's gradients, where they belong. One layer's attention forward and backward as a bf16 run meets it (q and
k fp32 from RoPE, v bf16, under autocast), 5 interleaved rounds, Zen 4: at the quickstart's shapes (4 × 256, 19
sequences of 20–89 tokens, 9 heads over 3, 2 threads) 0.92–0.95× the time (10.5–14.4 → 10.0–13.5 ms: the machine's pace
moved during the rounds); at the quick bench's tiny LLaMA's (4 × 512, 12 sequences of 20–281 tokens, 4 heads, 1 thread)
0.87–0.89× (29.6–29.8 → 25.9–26.4 ms). Most of what is left is the kernel's own cost per call: at 50 tokens its forward
and backward take 0.34 ms on 2 threads for ~10 MFLOP, and 0.37 on one. The values are those of SDPA called on each
sequence under autograd, to the bit (tested): the same kernel on the same inputs, each result rounded where autocast
rounds it.

Dtypes, as autocast would give SDPA: q, k and v in the run's compute dtype (`dtype`, bf16 under autocast, whatever
RoPE left them in); a sequence shorter than `fp32_below` then runs in fp32 (the bf16 values, widened: exact), where
the CPU kernel's bf16 call costs more than its work (packed_attention.BF16_FLASH_FROM). The output is in `dtype`;
each input's gradient in its own dtype, rounded to `dtype` first (as autocast's cast's backward would).

Sequences marked not attended (a padded row's padding) output zeros and get zero gradients: nothing real attends to
them, and nothing reads what they give. No dropout: the CPU flash kernel has none (kernels/packed_attention.py does not
split where the model asks for it).
"""

from __future__ import annotations

import torch

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class SequencesApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, pieces, scale, dtype, fp32_below):
        """query (batch, heads, width, dim), key and value (batch, kv heads, width, dim); `pieces`: (row, start,
        length, attended) of every sequence, covering each row. Returns (batch, width, heads, dim) in `dtype`."""
        batch, heads, width, dim = query.shape
        out = query.new_empty((batch, width, heads, dim), dtype=dtype)
        saved = []
        for row, start, length, attended in pieces:
            if not attended:
                out[row, start:start + length].zero_()
                continue
            compute = torch.float32 if length < fp32_below else dtype
            q, k, v = (tensor[row, :, start:start + length][None].to(dtype).to(compute)
                       for tensor in (query, key, value))
            sequence_out, logsumexp = FLASH(q, k, v, 0.0, True, scale=scale)
            out[row, start:start + length] = sequence_out[0].transpose(0, 1)  # (heads, n, dim) -> (n, heads, dim)
            saved += [q, k, v, sequence_out, logsumexp]
        ctx.save_for_backward(*saved)
        ctx.pieces, ctx.scale, ctx.dtype = pieces, scale, dtype
        ctx.inputs = [(tensor.shape, tensor.dtype) for tensor in (query, key, value)]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [grad.new_empty(shape, dtype=input_dtype) for shape, input_dtype in ctx.inputs]
        saved = iter(ctx.saved_tensors)
        for row, start, length, attended in ctx.pieces:
            if not attended:
                for tensor_grad in grads:
                    tensor_grad[row, :, start:start + length].zero_()
                continue
            q, k, v, sequence_out, logsumexp = (next(saved) for _ in range(5))
            sequence_grad = grad[row, start:start + length].transpose(0, 1)[None].to(q.dtype)
            sequence_grads = FLASH_BACKWARD(sequence_grad, q, k, v, sequence_out, logsumexp, 0.0, True,
                                            scale=ctx.scale)
            for tensor_grad, piece_grad in zip(grads, sequence_grads):
                # rounded to the compute dtype, as the gradient of autocast's cast to it is (the copy into a
                # gradient of that dtype rounds it so itself)
                piece_grad = piece_grad[0] if tensor_grad.dtype == ctx.dtype else piece_grad[0].to(ctx.dtype)
                tensor_grad[row, :, start:start + length] = piece_grad
        return *grads, None, None, None, None


def sequences_apart(query, key, value, pieces, scale, dtype, fp32_below: int):
    return SequencesApart.apply(query, key, value, pieces, scale, dtype, fp32_below)
