"""A Bradley-Terry reward model's loss (`reward_model: true`).

A sequence classifier scores each sequence once, at its last real token (transformers finds it from the pad id
that model/model_config.py's `score_last_real_token` gives it), and the loss asks the chosen conversation's score to
beat the rejected one's:

    per pair:  -log σ(r_chosen − r_rejected)  +  c · (r_chosen + r_rejected)²

where c is `center_rewards_coefficient` (unset: 0), which pulls the rewards towards zero (Eisenstein et al.,
2023). Averaged over pairs, this is TRL's RewardTrainer loss (a mean over pairs of each term). The objective
returns the sum over a micro-batch's pairs and the loop divides by the pairs of the whole step (unit "pairs"), so
accumulation and ranks change nothing.

A micro-batch holds whole pairs, one sequence a row (a reward model never packs: its score is read at one
position per row): row 2j is pair j's chosen conversation, row 2j+1 its rejected one (data/collate.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# what a micro-batch reports besides its loss, summed: pairs ranked right, the margins, the rewards of both sides
STAT_WIDTH = 3


def pair_rewards(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores, in fp32 (the head may compute in bf16; the loss should not)."""
    scores = model(**inputs).logits.squeeze(-1).float()
    return scores[0::2], scores[1::2]


def summarise(stats: list[float], pairs: int) -> dict:
    """The train line's numbers (TRL's names): pairs ranked right, mean margin, mean reward of every sequence."""
    correct, margins, rewards = stats
    pairs = max(pairs, 1)
    return {"accuracy": correct / pairs, "margin": margins / pairs, "mean_reward": rewards / (2 * pairs)}


class BradleyTerryLoss:
    """The objective's loss function: (model, inputs, targets, extra) -> (loss summed over pairs, stats). The
    targets are not read: every token feeds the score."""

    stat_width = STAT_WIDTH
    summarise = staticmethod(summarise)

    def __init__(self, center_rewards_coefficient: float = 0.0):
        self.center_rewards_coefficient = center_rewards_coefficient

    def __call__(self, model, inputs: dict, targets: torch.Tensor, extra: dict):
        chosen, rejected = pair_rewards(model, inputs)
        losses = -F.logsigmoid(chosen - rejected)
        if self.center_rewards_coefficient:
            losses = losses + self.center_rewards_coefficient * (chosen + rejected) ** 2
        chosen, rejected = chosen.detach(), rejected.detach()
        stats = torch.stack([(chosen > rejected).sum().float(), (chosen - rejected).sum(), (chosen + rejected).sum()])
        return losses.sum(), stats.double()

    @torch.no_grad()
    def eval_sums(self, model, inputs: dict, targets: torch.Tensor, extra: dict) -> torch.Tensor:
        """[loss, pairs, the stats], summed over the micro-batch's pairs."""
        loss, stats = self(model, inputs, targets, extra)
        pairs = torch.tensor([extra["n_sequences"] // 2], dtype=torch.float64, device=stats.device)
        return torch.cat([loss.double().reshape(1), pairs, stats])

    def eval_metrics(self, totals: list[float]) -> dict:
        """rl_methods.py's REWARD_MODEL_EVAL_METRICS, and the pairs they are over."""
        loss, pairs, stats = totals[0], int(totals[1]), totals[2:]
        return {"eval_loss": loss / max(pairs, 1), **{f"eval_{name}": value for name, value
                                                      in summarise(stats, pairs).items()}, "eval_pairs": pairs}
