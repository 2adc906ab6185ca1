"""Evaluation that streams: per-batch sums stay on the device; logits are never whole (objectives.py).

Loss, perplexity and token accuracy are per target token, so they are the same whether
the eval set is packed or padded, and however it is split over ranks.
"""

from __future__ import annotations

import math

import torch



@torch.no_grad()
def evaluate(model, micro_batches, collator, objective, accelerator) -> dict:
    """`micro_batches` are this rank's; ranks may hold different counts (no collective inside the loop)."""
    was_training = model.training
    model.eval()
    device = accelerator.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    counts = torch.zeros(2, device=device, dtype=torch.long)  # targets, correct
    for rows in micro_batches:
        batch = collator(rows).to(device)
        with accelerator.autocast():
            summed, correct = objective.eval_sums(model, batch.inputs, batch.targets)
        loss_sum += summed.double()
        counts[0] += batch.n_targets
        counts[1] += correct
    loss_sum = accelerator.reduce(loss_sum, reduction="sum")
    counts = accelerator.reduce(counts, reduction="sum")
    model.train(was_training)
    n_targets = int(counts[0])
    loss = float(loss_sum) / max(n_targets, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_token_accuracy": int(counts[1]) / max(n_targets, 1), "eval_tokens": n_targets}
