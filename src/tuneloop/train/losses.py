"""Per-token losses summed on the device: the one place logits become numbers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tuneloop.data.prepare import IGNORE_INDEX


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of cross-entropy over target positions; the caller divides by the step's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    mask = targets != IGNORE_INDEX
    return (logits.argmax(dim=-1).eq(targets) & mask).sum()
