"""A process reward model's loss (`process_reward_model: true`): token classification at each reasoning step's end
token. data/stepwise.py labels it 0 or 1, and the loss is axolotl's (AutoModelForTokenClassification, num_labels 2,
transformers' token-classification cross-entropy over the labelled tokens).

The objective returns the cross-entropy summed over a micro-batch's labelled tokens, and the loop divides by the
labelled tokens of the whole step (unit "tokens"), so a step's loss is the mean over its steps' labels whatever the
accumulation and ranks.

The collator gives the target of position t as the label stored at t+1 (the causal shift, data/labels.py), so the
logits at position t+1 are paired with target t here: each label is read at its own token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tuneloop.data.labels import IGNORE_INDEX

STAT_WIDTH = 1  # steps classified right, summed


def step_logits_and_labels(model, inputs: dict, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of every position that has a label: [n, num_labels] in fp32 and [n]."""
    logits = model(**inputs).logits[:, 1:].float()
    labels = targets[:, :-1]
    mask = labels != IGNORE_INDEX
    return logits[mask], labels[mask]


def summarise(stats: list[float], steps: int) -> dict:
    return {"step_accuracy": stats[0] / max(steps, 1)}


class TokenClassificationLoss:
    """(model, inputs, targets, extra) -> (cross-entropy summed over the labelled tokens, [steps right])."""

    stat_width = STAT_WIDTH
    summarise = staticmethod(summarise)

    def __call__(self, model, inputs: dict, targets: torch.Tensor, extra: dict):
        logits, labels = step_logits_and_labels(model, inputs, targets)
        loss = F.cross_entropy(logits, labels, reduction="sum")
        correct = (logits.detach().argmax(dim=-1) == labels).sum()
        return loss, correct.double().reshape(1)

    @torch.no_grad()
    def eval_sums(self, model, inputs: dict, targets: torch.Tensor, extra: dict) -> torch.Tensor:
        """[summed loss, labelled steps, steps right]."""
        loss, correct = self(model, inputs, targets, extra)
        steps = (targets[:, :-1] != IGNORE_INDEX).sum().double().reshape(1)
        return torch.cat([loss.double().reshape(1), steps, correct])

    def eval_metrics(self, totals: list[float]) -> dict:
        """rl_methods.py's PROCESS_REWARD_EVAL_METRICS, and the labelled steps they are over."""
        loss, steps, correct = totals[0], int(totals[1]), totals[2]
        return {"eval_loss": loss / max(steps, 1), "eval_step_accuracy": correct / max(steps, 1),
                "eval_steps": steps}
