"""Evaluation that streams: per-batch sums stay on the device; logits are never whole (objectives.py).

The objective says what is summed (the language model: loss, correct predictions and target tokens; a
preference objective: loss, pairs, rewards and correct pairs) and what the sums mean once every batch
of every rank is in. Per-token (or per-pair) metrics are then the same whether the eval set is packed or
padded, and however it is split over ranks.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def evaluate(model, micro_batches, collator, objective, accelerator) -> dict:
    """`micro_batches` are this rank's; ranks may hold different counts (no collective inside the loop)."""
    was_training = model.training
    model.eval()
    device = accelerator.device
    totals = None
    for rows in micro_batches:
        batch = collator(rows).to(device)
        with accelerator.autocast():
            sums = objective.eval_sums(model, batch.inputs, batch.targets, batch.extra).double()
        totals = sums if totals is None else totals + sums
    if totals is None:  # this rank had no eval batch; the others' sums decide (same length on every rank)
        totals = torch.zeros(objective.eval_width, device=device, dtype=torch.float64)
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    return objective.eval_metrics([float(value) for value in totals.tolist()])

