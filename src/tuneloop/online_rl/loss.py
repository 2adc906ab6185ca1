"""GRPO's objective over a micro-batch of scored completions, for every loss type of TRL 1.16.

The completion tokens are the micro-batch's targets (the prompt and the padding are -100), so the policy's
log-probabilities come from the same chunked projection as the preference losses (train/preference.py): only
completion positions meet the output head. Everything per token is flat (one entry per completion token, in the
order of the batch's target positions) with `owner` naming its completion; a per-completion value is broadcast to
its tokens, which is what TRL's (B, T) tensors times the completion mask compute.

Per token, with r = exp(log π − log π_old) (token level; the completion's mean log-ratio at sequence level) and A
the completion's advantage:
  grpo, bnpo, dr_grpo, dapo, luspo   −min(r·A, clip(r, 1−ε, 1+ε_high)·A)   (r capped at `delta` when set)
  cispo                              −min(r, ε_high) · A · log π            (the min without gradient)
  sapo                               −σ(τ(r − 1))·4/τ · A                   (τ by the sign of A)
  vespo                              −φ(w) · A · log π     (φ, without gradient: a gamma weight of the sequence ratio)
plus β·KL (k3 estimator, times r when use_bias_correction_kl) when β ≠ 0. Summed over the unit of settings.py's
LOSS_TYPES: the loop divides by the step's units (all ranks), so accumulation and ranks give one batch's loss
wherever TRL's normalisation spans the step, and TRL's own per-micro-batch mean for bnpo.
"""

from __future__ import annotations

import math

import torch

from tuneloop.log_probs import token_log_probs

# the stats every micro-batch reports (summed over the window, then summarise()d for the train line), followed by
# a (sum, count) pair per reward function
STATS = ("kl_sum", "clipped_low", "clipped_high", "clipped", "tokens", "completions", "truncated", "reward_sum",
         "reward_squares", "rewards_counted", "advantage_zero_std")


def per_token_losses(log_probs: torch.Tensor, old: torch.Tensor, reference: torch.Tensor | None, owner: torch.Tensor,
                     advantages: torch.Tensor, n_completions: int, settings) -> tuple[torch.Tensor, dict]:
    """(each completion token's loss, the clip and KL numbers to log). All arguments are flat over the tokens but
    `advantages` ([n_completions])."""
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
    low, high = 1 - settings.epsilon, 1 + settings.clip_high
    loss_type = settings.loss_type
    logged = {}
    if loss_type == "cispo":
        losses = -torch.clamp(ratio, max=settings.clip_high).detach() * advantage * log_probs
    elif loss_type == "sapo":
        temperature = torch.where(advantage > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        losses = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantage
    elif loss_type == "vespo":
        losses = -vespo_weights(log_ratio, owner, advantages, n_completions, settings)[owner] * advantage * log_probs
    else:  # the clipped surrogate of grpo, bnpo, dr_grpo, dapo and luspo
        clipped = torch.clamp(ratio, low, high)
        capped = torch.clamp(ratio, max=settings.delta) if settings.delta is not None else ratio
        losses = -torch.min(capped * advantage, clipped * advantage)
        below, above = (ratio < low) & (advantage < 0), (ratio > high) & (advantage > 0)
        logged = {"clipped_low": below.sum(), "clipped_high": above.sum(), "clipped": (below | above).sum()}
    if settings.beta != 0.0:
        difference = reference - log_probs
        kl = torch.exp(difference) - difference - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        losses = losses + settings.beta * kl
        logged["kl_sum"] = kl.detach().sum()
    return losses, logged


@torch.no_grad()
def vespo_weights(log_ratio, owner, advantages, n_completions: int, settings) -> torch.Tensor:
    """VESPO's φ(w) per completion: e^λ · w^k · e^(−λw) of the sequence's importance weight w, in log space, with
    (k, λ) by the sign of its advantage; no gradient (it scales the log-probability's)."""
    lower = math.log(1e-8)
    sums = torch.zeros(n_completions, dtype=log_ratio.dtype, device=log_ratio.device)
    sums = sums.index_add(0, owner, torch.clamp(log_ratio, -20.0, 20.0))
    log_w = torch.clamp(sums, lower, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def reduced(losses: torch.Tensor, owner: torch.Tensor, n_completions: int, settings) -> torch.Tensor:
    """The micro-batch's losses summed over its units (settings.py's LOSS_TYPES)."""
    loss_type = settings.loss_type
    if loss_type in ("grpo", "sapo"):  # each completion's mean over its tokens, summed over completions
        counts = torch.bincount(owner, minlength=n_completions).to(losses.dtype).clamp(min=1.0)
        sums = torch.zeros(n_completions, dtype=losses.dtype, device=losses.device).index_add(0, owner, losses)
        return (sums / counts).sum()
    if loss_type == "dr_grpo":  # a constant length for every completion
        return losses.sum() / settings.max_completion_length
    if loss_type == "bnpo":  # this micro-batch's mean over its tokens
        return losses.sum() / max(losses.numel(), 1)
    return losses.sum()  # luspo: per-completion sums; dapo, cispo, vespo: per token


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
        losses, logged = per_token_losses(log_probs, old, reference, owner, extra["advantages"], n, self.settings)
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
        if self.settings.loss_type not in ("cispo", "sapo", "vespo"):
            line["clip_ratio"] = round(named["clipped"] / tokens, 6)
        if self.settings.beta != 0.0:
            line["kl"] = round(named["kl_sum"] / tokens, 6)
        return line
