"""GRPO's loss types (`trl.loss_type`, every one of TRL 1.16's), by name: one record each, with its per-token surrogate,
its reduction over a micro-batch and the unit a step's loss is a mean over.

The config's accepted names are LOSS_TYPES's (settings.py), and loss.py computes with the record of the run's name,
so a new loss type is its functions and one `LOSS_TYPES.add` here, plus its case in tests/test_grpo_equivalence.py
(compared with TRL's). The config reads the names before torch loads, so torch is imported inside the functions.

Per token, with r = exp(log π − log π_old) (token level; the completion's mean log-ratio at sequence level) and A
the completion's advantage:
  clipped (grpo, bnpo, dr_grpo, dapo, luspo)   −min(r·A, clip(r, 1−ε, 1+ε_high)·A)   (r capped at `delta` when set)
  cispo                                        −min(r, ε_high) · A · log π            (the min without gradient)
  sapo                                         −σ(τ(r − 1))·4/τ · A                   (τ by the sign of A)
  vespo                                        −φ(w) · A · log π     (φ, without gradient: a gamma weight of the
                                                                      sequence ratio)
loss.py adds β·KL to each token's loss, then reduces it with the record's reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from tuneloop.registry import Registry


@dataclass(frozen=True)
class PolicyTokens:
    """What a surrogate reads, flat over a micro-batch's completion tokens (one entry each, `owner` naming its
    completion) but `advantages`, one per completion."""

    log_probs: Any  # the policy's log-probability of each token (with gradient)
    log_ratio: Any  # log π − log π_old per token
    ratio: Any  # the importance ratio: per token, or the completion's (importance_sampling_level: sequence)
    advantage: Any  # each token's completion's advantage
    owner: Any
    advantages: Any
    n_completions: int


def clipped(tokens: PolicyTokens, settings) -> tuple[Any, dict]:
    """PPO's clipped surrogate; also counts the tokens clipped below, above, and either (the train line's
    clip_ratio)."""
    import torch

    ratio, advantage = tokens.ratio, tokens.advantage
    low, high = 1 - settings.epsilon, 1 + settings.clip_high
    clipped_ratio = torch.clamp(ratio, low, high)
    capped = torch.clamp(ratio, max=settings.delta) if settings.delta is not None else ratio
    losses = -torch.min(capped * advantage, clipped_ratio * advantage)
    below, above = (ratio < low) & (advantage < 0), (ratio > high) & (advantage > 0)
    return losses, {"clipped_low": below.sum(), "clipped_high": above.sum(), "clipped": (below | above).sum()}


def cispo(tokens: PolicyTokens, settings) -> tuple[Any, dict]:
    import torch

    weight = torch.clamp(tokens.ratio, max=settings.clip_high).detach()
    return -weight * tokens.advantage * tokens.log_probs, {}


def sapo(tokens: PolicyTokens, settings) -> tuple[Any, dict]:
    import torch

    advantage = tokens.advantage
    temperature = torch.where(advantage > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
    return -torch.sigmoid(temperature * (tokens.ratio - 1)) * 4 / temperature * advantage, {}


def vespo(tokens: PolicyTokens, settings) -> tuple[Any, dict]:
    weights = vespo_weights(tokens.log_ratio, tokens.owner, tokens.advantages, tokens.n_completions, settings)
    return -weights[tokens.owner] * tokens.advantage * tokens.log_probs, {}


def vespo_weights(log_ratio, owner, advantages, n_completions: int, settings):
    """VESPO's φ(w) per completion: e^λ · w^k · e^(−λw) of the sequence's importance weight w, in log space, with
    (k, λ) by the sign of its advantage; no gradient (it scales the log-probability's)."""
    import torch

    with torch.no_grad():
        lower = math.log(1e-8)
        sums = torch.zeros(n_completions, dtype=log_ratio.dtype, device=log_ratio.device)
        sums = sums.index_add(0, owner, torch.clamp(log_ratio, -20.0, 20.0))
        log_w = torch.clamp(sums, lower, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg).to(log_w.dtype)
        lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).to(log_w.dtype)
        lam = lam.clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# Reductions: (each token's loss, owner, n_completions, settings) -> the micro-batch's loss summed over its units

def mean_per_completion(losses, owner, n_completions: int, settings):
    """Each completion's mean over its tokens, summed over the completions."""
    import torch

    counts = torch.bincount(owner, minlength=n_completions).to(losses.dtype).clamp(min=1.0)
    sums = torch.zeros(n_completions, dtype=losses.dtype, device=losses.device).index_add(0, owner, losses)
    return (sums / counts).sum()


def over_max_length(losses, owner, n_completions: int, settings):
    """Each completion's sum over a constant length, max_completion_length, summed over the completions."""
    return losses.sum() / settings.max_completion_length


def micro_batch_mean(losses, owner, n_completions: int, settings):
    """This micro-batch's mean over its own tokens (so the micro-batch size is part of the loss, as TRL's bnpo)."""
    return losses.sum() / max(losses.numel(), 1)


def summed(losses, owner, n_completions: int, settings):
    """Every token's loss summed: per token (the unit divides by the step's tokens) or per completion."""
    return losses.sum()


@dataclass(frozen=True)
class LossType:
    # what the loop divides a step's summed loss by, counted over every rank and micro-batch of the step:
    #   "completion_tokens": the step's completion tokens (TRL's num_items_in_batch)
    #   "completions": the step's completions
    #   "micro_batches": the step's micro-batches (each already its own mean: bnpo)
    unit: str
    surrogate: Callable  # (PolicyTokens, settings) -> (each token's loss, clip counts to log)
    reduction: Callable  # (losses, owner, n_completions, settings) -> the micro-batch's sum over its units

    @property
    def clips(self) -> bool:
        """The train line shows the share of tokens clipped (only the clipped surrogate clips)."""
        return self.surrogate is clipped


LOSS_TYPES: Registry[LossType] = Registry("GRPO loss type", "trl.loss_type")
LOSS_TYPES.add("grpo", LossType("completions", clipped, mean_per_completion))
LOSS_TYPES.add("bnpo", LossType("micro_batches", clipped, micro_batch_mean))
LOSS_TYPES.add("dr_grpo", LossType("completions", clipped, over_max_length))
LOSS_TYPES.add("dapo", LossType("completion_tokens", clipped, summed))
LOSS_TYPES.add("cispo", LossType("completion_tokens", cispo, summed))
LOSS_TYPES.add("sapo", LossType("completions", sapo, mean_per_completion))
LOSS_TYPES.add("vespo", LossType("completion_tokens", vespo, summed))
LOSS_TYPES.add("luspo", LossType("completions", clipped, summed))  # each completion's sum
