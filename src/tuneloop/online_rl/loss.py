"""GRPO's objective over a micro-batch of scored completions, for every loss type of TRL 1.16.

The completion tokens are the micro-batch's targets (the prompt and the padding are -100), so the policy's
log-probabilities come from the same chunked projection as the preference losses (train/preference.py): only
completion positions meet the output head. Everything per token is flat (one entry per completion token, in the
order of the batch's target positions) with `owner` naming its completion; a per-completion value is broadcast to
its tokens, which is what TRL's (B, T) tensors times the completion mask compute.

Each token's loss is the run's loss type's surrogate (loss_types.py's LOSS_TYPES, where the formulas are), plus
β·KL (k3 estimator, times r when use_bias_correction_kl) when β ≠ 0, reduced by the loss type's reduction to a sum
over its unit: the loop divides by the step's units (all ranks), so accumulation and ranks give one batch's loss
wherever TRL's normalisation spans the step, and TRL's own per-micro-batch mean for bnpo.
"""

from __future__ import annotations

import math

import torch

from tuneloop.log_probs import token_log_probs
from tuneloop.online_rl.loss_types import LOSS_TYPES, PolicyTokens

# the stats every micro-batch reports (summed over the window, then summarise()d for the train line), followed by
# a (sum, count) pair per reward function
STATS = ("kl_sum", "clipped_low", "clipped_high", "clipped", "tokens", "completions", "truncated", "reward_sum",
         "reward_squares", "rewards_counted", "advantage_zero_std")


def per_token_losses(log_probs: torch.Tensor, old: torch.Tensor, reference: torch.Tensor | None, owner: torch.Tensor,
                     advantages: torch.Tensor, n_completions: int, settings,
                     sampling_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """(each completion token's loss, the clip and KL numbers to log). All arguments are flat over the tokens but
    `advantages` ([n_completions]). `sampling_weights`: the vLLM importance-sampling correction of each token
    (rollout.importance_weights), which weighs the policy term and not the KL term, as in TRL."""
    counts = torch.bincount(owner, minlength=n_completions).to(log_probs.dtype)

    def per_completion_sum(values):
        return torch.zeros(n_completions, dtype=values.dtype, device=values.device).index_add(0, owner, values)

    log_ratio = log_probs - old
    if settings.importance_sampling_level == "sequence":
        log_weight = (per_completion_sum(log_ratio) / counts.clamp(min=1.0))[owner]
    else:
        log_weight = log_ratio
    ratio = torch.exp(log_weight)
    advantage = advantages[owner].to(log_probs.dtype)
    tokens = PolicyTokens(log_probs, log_ratio, ratio, advantage, owner, advantages, n_completions)
    losses, logged = LOSS_TYPES[settings.loss_type].surrogate(tokens, settings)
    if sampling_weights is not None:
        losses = losses * sampling_weights.to(losses.dtype)
    if settings.beta != 0.0:
        difference = reference - log_probs
        kl = torch.exp(difference) - difference - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        losses = losses + settings.beta * kl
        logged["kl_sum"] = kl.detach().sum()
    return losses, logged


def importance_weights(difference: torch.Tensor, owner: torch.Tensor, n_completions: int, settings) -> torch.Tensor:
    """TRL 1.16's correction of the sampler/trainer mismatch (`vllm_importance_sampling_*`), one weight per
    completion token: exp(trainer − sampler) per token (token_*) or of the completion's summed difference
    (sequence_*), clamped to [clip_min, clip_max] (*_truncate) or set to 0 outside it (*_mask)."""
    mode = settings.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        summed = torch.zeros(n_completions, dtype=difference.dtype, device=difference.device).index_add(
            0, owner, difference)
        difference = summed[owner]
    ratio = torch.exp(difference)
    low, high = settings.clip_min, settings.clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
    return ratio.masked_fill(outside, 0.0)


def sampler_gap(difference: torch.Tensor) -> torch.Tensor:
    """[max |Δ|, sum |Δ|, tokens] of trainer − sampler log-probs: what the step's gap check reads."""
    gap = difference.abs()
    top = gap.max() if gap.numel() else torch.zeros((), dtype=gap.dtype, device=gap.device)
    return torch.stack([top, gap.sum(), torch.tensor(float(gap.numel()), dtype=gap.dtype, device=gap.device)])


def reduced(losses: torch.Tensor, owner: torch.Tensor, n_completions: int, settings) -> torch.Tensor:
    """The micro-batch's losses summed over its units (the loss type's reduction)."""
    return LOSS_TYPES[settings.loss_type].reduction(losses, owner, n_completions, settings)


class GRPOLoss:
    """The objective's loss function: (model, inputs, targets, extra) -> (loss summed over units, stats)."""

    def __init__(self, settings, reward_names: list[str]):
        self.settings, self.reward_names = settings, reward_names
        self.stat_width = len(STATS) + 2 * len(reward_names)

    def __call__(self, model, inputs: dict, targets: torch.Tensor, extra: dict):
        log_probs, positions = token_log_probs(model, inputs, targets, self.settings.temperature)
        owner = extra["sequence_index"].reshape(-1)[positions]
        n = extra["n_sequences"]
        old = extra["old_log_probs"].float() if "old_log_probs" in extra else log_probs.detach()
        reference = extra["reference_log_probs"].float() if "reference_log_probs" in extra else None
        weights = extra.get("is_ratio")
        if "sampling_log_probs" in extra:  # vLLM's log-probs of its tokens, against this very forward's (no other)
            difference = log_probs.detach().float() - extra["sampling_log_probs"].float()
            extra["gap_parts"].append(sampler_gap(difference).detach())
            if self.settings.vllm_importance_sampling_correction:
                weights = importance_weights(difference, owner, n, self.settings)
        losses, logged = per_token_losses(log_probs, old, reference, owner, extra["advantages"], n, self.settings,
                                          weights)
        loss = reduced(losses, owner, n, self.settings)
        if not log_probs.requires_grad:  # no completion token here (all masked): a zero that still has a backward
            loss = loss + sum(parameter.sum() * 0.0 for parameter in model.parameters() if parameter.requires_grad)
        return loss, self.stats(extra, logged, positions.numel(), log_probs.device)

    def stats(self, extra: dict, logged: dict, tokens: int, device) -> torch.Tensor:
        rewards = extra["rewards"].double()  # [completions, functions], NaN where a function gave None
        total = extra["total_reward"].double()  # [completions], NaN where no function scored
        scored = ~torch.isnan(total)
        values = {name: torch.as_tensor(value, dtype=torch.float64, device=device).reshape(())
                  for name, value in logged.items()}
        values.update(tokens=tokens, completions=extra["n_sequences"], truncated=extra["truncated"].sum(),
                      reward_sum=total[scored].sum(), reward_squares=(total[scored] ** 2).sum(),
                      rewards_counted=scored.sum(), advantage_zero_std=extra["zero_std"].sum())
        row = [torch.as_tensor(values.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
               for name in STATS]
        for column in range(rewards.shape[1]):
            counted = ~torch.isnan(rewards[:, column])
            row += [rewards[counted, column].sum(), counted.sum().double()]
        return torch.stack(row)

    def summarise(self, stats: list[float], units: int) -> dict:
        """The train line's numbers: rewards (their mean and spread, and each function's mean), completion
        length, the share truncated and of zero-spread groups, clipping and KL per completion token."""
        named = dict(zip(STATS, stats))
        completions, tokens = max(named["completions"], 1), max(named["tokens"], 1)
        counted = named["rewards_counted"]
        mean = named["reward_sum"] / counted if counted else float("nan")
        spread = math.sqrt(max(named["reward_squares"] / counted - mean * mean, 0.0)) if counted else float("nan")
        line = {"reward": round(mean, 6), "reward_std": round(spread, 6)}
        for index, name in enumerate(self.reward_names):
            total, count = stats[len(STATS) + 2 * index: len(STATS) + 2 * index + 2]
            line[f"rewards/{name}"] = round(total / count, 6) if count else None
        line.update(completion_length=round(named["tokens"] / completions, 2),
                    truncated_ratio=round(named["truncated"] / completions, 4),
                    frac_reward_zero_std=round(named["advantage_zero_std"] / completions, 4))
        if LOSS_TYPES[self.settings.loss_type].clips:
            line["clip_ratio"] = round(named["clipped"] / tokens, 6)
        if self.settings.beta != 0.0:
            line["kl"] = round(named["kl_sum"] / tokens, 6)
        return line
