"""The label rules, in one place: which positions the loss sees, and what it predicts there.

A prepared row carries `labels` aligned with `input_ids`: the token id where the token is trained,
IGNORE_INDEX where it is not (the prompt, padding). A causal model predicts token t from the
positions before it, so the target at position t is the label at t+1: `shifted_targets` moves the
labels one to the left and leaves the last position of every sequence without a target. Packed
rows shift each sequence on its own, so no sequence predicts the first token of the next.
"""

from __future__ import annotations

IGNORE_INDEX = -100  # what torch's cross-entropy skips, and what transformers' collators pad labels with


def shifted_targets(labels: list[int]) -> list[int]:
    """The target of each position: the next position's label; the last position has none."""
    return list(labels[1:]) + [IGNORE_INDEX]


def count_targets(labels: list[int]) -> int:
    """How many positions of the row the loss sees."""
    return sum(1 for target in shifted_targets(labels) if target != IGNORE_INDEX)
