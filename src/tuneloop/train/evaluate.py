"""Evaluation that streams: per-batch sums stay on the device; logits are never whole (objectives.py).

The objective says what is summed (the language model: loss, correct predictions and target tokens; a
preference objective: loss, pairs, rewards and correct pairs) and what the sums mean once every batch
of every rank is in. Per-token (or per-pair) metrics are then the same whether the eval set is packed or
padded, and however it is split over ranks.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def evaluate(runner, micro_batches, collator, objective, accelerator, lockstep: tuple | None = None) -> dict:
    """`runner`: the ObjectiveModule (its forward with `evaluating=True` returns the eval sums). `micro_batches` are
    this rank's; ranks may hold different counts (no collective inside the loop) unless the engine gathers weights
    in each forward: then `lockstep` = (the most batches any rank holds, rows any rank can run), and a rank with
    fewer runs those rows again, its sums thrown away, so that every rank meets every gather."""
    was_training = runner.training
    runner.eval()
    device = accelerator.device
    totals = None
    rounds, filler = lockstep if lockstep else (len(micro_batches), None)
    for index in range(rounds):
        counted = index < len(micro_batches)
        batch = collator(micro_batches[index] if counted else filler).to(device)
        with accelerator.autocast():
            sums = runner(batch.inputs, batch.targets, batch.extra, evaluating=True).double()
        if not counted:
            continue
        totals = sums if totals is None else totals + sums
    if totals is None:  # this rank had no eval batch; the others' sums decide (same length on every rank)
        totals = torch.zeros(objective.eval_width, device=device, dtype=torch.float64)
    totals = accelerator.reduce(totals, reduction="sum")
    runner.train(was_training)
    return objective.eval_metrics([float(value) for value in totals.tolist()])

