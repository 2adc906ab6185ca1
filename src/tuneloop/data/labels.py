"""The label rules, in one place: which positions the loss sees, and what it predicts there.

A prepared row carries `labels` aligned with `input_ids`: the token id where the token is trained,
IGNORE_INDEX where it is not (the prompt, padding). A causal model predicts token t from the
positions before it, so the target at position t is the label at t+1: `shifted_targets` moves the
labels one to the left and leaves the last position of every sequence without a target. Packed
rows shift each sequence on its own, so no sequence predicts the first token of the next.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100  # what torch's cross-entropy skips, and what transformers' collators pad labels with


def shifted_targets(labels: np.ndarray) -> np.ndarray:
    """The target of each position: the next position's label; the last position has none."""
    targets = np.empty(len(labels), dtype=np.int64)
    targets[:-1] = labels[1:]
    targets[-1:] = IGNORE_INDEX
    return targets


def count_targets(labels: np.ndarray) -> int:
    """How many positions of the row the loss sees: every trained label but the row's first."""
    return int(np.count_nonzero(np.asarray(labels)[1:] != IGNORE_INDEX))
