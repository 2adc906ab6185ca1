"""What a step minimises: one registry entry per training objective, each with its unit of normalisation.

An objective turns a micro-batch's logits into a *summed* loss and says what that sum is over
(its unit): the language-model loss sums cross-entropy over target tokens, so a step's loss is
that sum divided by the target tokens of the whole step (all micro-batches, all ranks), which the
host knows before the step. Preference objectives (DPO and friends) will sum over pairs or rows
and normalise by the pairs or rows of the step, in the same loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.registry import Registry


def summed_token_loss(logits, targets):
    """Sum (not mean) of cross-entropy over target positions; the caller divides by the step's token count."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def correct_predictions(logits, targets):
    mask = targets != IGNORE_INDEX
    return (logits.argmax(dim=-1).eq(targets) & mask).sum()


@dataclass(frozen=True)
class Objective:
    summed_loss: Callable  # (logits, targets) -> a scalar tensor: the loss summed over the unit
    unit: str  # what the sum runs over, and what a step's loss is averaged over: "tokens", "pairs" or "rows"


OBJECTIVES: Registry[Objective] = Registry("training objective", "rl")
OBJECTIVES.add("language_model", Objective(summed_token_loss, unit="tokens"))


def objective_of(cfg) -> Objective:
    """Supervised fine-tuning trains the language-model loss (preference objectives will be chosen by `rl`)."""
    return OBJECTIVES["language_model"]
