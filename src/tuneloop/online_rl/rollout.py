"""One generation of an online RL step: completions from the weights as they are, their rewards and advantages,
and the micro-batches the loop trains on.

The step's completions are laid out as TRL lays them out: prompt p's `num_generations` completions side by side,
the whole list cut into one slice per rank (rank r: completions r·L … r·L + L − 1, L = micro_batch_size ×
gradient_accumulation_steps), so a prompt's group may span ranks. Each rank generates its own slice on the run's
engine (generation/: transformers' generate on the training weights, or a vLLM server synced to them), seeded by
(seed, generation, rank), so a resumed run generates exactly what the uninterrupted one did and the training's own
random state is left as it was. The rewards of every rank are gathered (one collective per step, which also carries
the token counts and any reward or engine error), the advantages taken over whole groups, and each rank keeps its
own.

An engine that reports its sampling log-probs (vLLM) has them compared with the trainer's own: their gap (mean and
max |Δ| over the step's tokens) proves the server sampled from the trained weights, and TRL 1.16's
importance-sampling correction (`vllm_importance_sampling_*`, loss.py) weighs each token's loss by exp(trainer −
sampler) per token or summed per completion, truncated or masked outside its bounds. TRL computes the trainer's
side with one more forward without gradient; with num_iterations 1 that forward equals the training forward's own
(the same weights and inputs, detached), so the loss compares there and no forward is added; with num_iterations
> 1 the rollout's forward of the generating weights serves, before any training.

A trained completion runs up to and including its first stop token (eos or the template's turn end); one that
reaches max_completion_length without one is truncated (`mask_truncated_completions: true` leaves it out of the
loss, as TRL does). Its micro-batch rows are prompt + completion, right-padded, the completion tokens the targets.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tuneloop.data.collate import MicroBatch
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.errors import UserError
from tuneloop.online_rl.feature_matching import completion_cap
from tuneloop.online_rl.loss import importance_weights
from tuneloop.online_rl.rewards import online_reward_names, score

# Test hook: a JSON file {prompt index: [the tokens of its completion j, ...]} trained instead of generated ones, so
# that runs of different layouts (2 ranks, 1 process) can be given the very same completions
FIXED_COMPLETIONS_ENV = "TUNELOOP_TEST_COMPLETIONS"


def nanstd(values: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """The sample standard deviation (n − 1), NaNs left out; NaN where fewer than two values count."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = variance.sqrt()
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int, scaling: str,
                     aggregation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, zero-spread flags, the weighted total reward) of every completion of the step, from its
    [completions, functions] rewards (NaN where a function gave None). As TRL 1.16 computes them:
    - sum_then_normalize (GRPO): the weighted sum, minus its group's mean, over its group's (or the batch's) std;
    - normalize_then_sum (GDPO): each function normalised in its group, weighted and summed, then normalised over
      the batch.
    A completion no function scored gets advantage 0."""
    unscorable = torch.isnan(rewards).all(dim=1)
    total = (rewards * weights).nansum(dim=1)
    total[unscorable] = math.nan
    if aggregation == "normalize_then_sum":
        grouped = rewards.view(-1, group, rewards.shape[1])
        normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
            nanstd(grouped, dim=1, keepdim=True) + 1e-4)
        summed = (normalised.reshape(-1, rewards.shape[1]) * weights).nansum(dim=1)
        summed[unscorable] = math.nan
        spread = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
        advantages = (summed - torch.nanmean(summed)) / (spread + 1e-4)
    else:
        by_group = total.view(-1, group)
        centred = (by_group - torch.nanmean(by_group, dim=1, keepdim=True)).reshape(-1)
        if scaling == "batch":
            spread = nanstd(total).expand_as(total) if total.numel() > 1 else torch.zeros_like(total)
        else:
            spread = nanstd(by_group, dim=1).repeat_interleave(group)
        advantages = centred / (spread + 1e-4) if scaling != "none" else centred
    zero_spread = torch.isclose(spread, torch.zeros_like(spread))
    return torch.nan_to_num(advantages, nan=0.0), zero_spread, total


def check_generation_kwargs(settings) -> None:
    """`trl.generation_kwargs` names settings of transformers' GenerationConfig (and vLLM's `stop_token_ids`, more
    stop tokens), or vLLM's sampling parameters when generation runs there: anything else would be stored and
    ignored, so it is refused by name."""
    from transformers import GenerationConfig

    if settings.use_vllm:
        from tuneloop.generation.vllm_server import check_vllm_generation_kwargs

        return check_vllm_generation_kwargs(settings)
    known = set(GenerationConfig().to_dict()) | {"stop_token_ids"}
    for key in settings.generation_kwargs or {}:
        if key in ("max_new_tokens", "max_tokens", "max_length"):
            raise UserError(f"config: `trl.generation_kwargs.{key}`: a completion's length is "
                            "`trl.max_completion_length`; set that instead")
        if key not in known:
            raise UserError(f"config: `trl.generation_kwargs.{key}` is not a setting of transformers' generate "
                            "(generation runs through transformers here, not vLLM): remove it, or use a "
                            "GenerationConfig name (top_k, min_p, repetition_penalty, no_repeat_ngram_size, ...)")


@dataclass
class Completions:
    """This rank's generated completions: tokens, trained lengths, whether each was cut at the length limit."""

    prompt_ids: list  # each completion's prompt tokens
    tokens: list  # each completion's tokens up to and including its stop token (or max_completion_length)
    trained: list  # how many of them are trained (0 for a masked truncated completion)
    truncated: list
    sampling_log_probs: list | None = None  # the engine's log-prob of each of `tokens` (vLLM), else None

    @property
    def trained_tokens(self) -> int:
        return int(sum(self.trained))

    def reordered(self, order) -> "Completions":
        fields = (self.prompt_ids, self.tokens, self.trained, self.truncated)
        sampled = None if self.sampling_log_probs is None else [self.sampling_log_probs[i] for i in order]
        return Completions(*([values[i] for i in order] for values in fields), sampled)


def cut_completions(prompt_ids: list, generated: list, stops, settings, log_probs: list | None = None,
                    limit: int | None = None) -> Completions:
    """Each completion up to and including its first stop token; one with none is truncated at the limit
    (max_completion_length, or the step's cap: EBFT's adaptive one) (its sampling log-probs, when given, cut
    alike)."""
    limit = settings.max_completion_length if limit is None else limit
    tokens, trained, truncated = [], [], []
    stop_set = set(stops)
    for row in generated:
        end = next((index + 1 for index, token in enumerate(row) if token in stop_set), None)
        cut = end is None
        row = row[:end] if end is not None else row[:limit]
        tokens.append(row)
        truncated.append(cut)
        trained.append(0 if cut and settings.mask_truncated_completions else len(row))
    if log_probs is not None:
        log_probs = [list(values[:len(row)]) for values, row in zip(log_probs, tokens)]
    return Completions([list(ids) for ids in prompt_ids], tokens, trained, truncated, log_probs)


def completion_rows(completions: Completions, start: int, stop: int, pad: int) -> tuple[dict, torch.Tensor, dict]:
    """(inputs, targets, extra) of completions start … stop − 1: prompt + completion right-padded, the trained
    completion tokens as targets (the position before each token predicts it), `sequence_index` naming the row."""
    rows = range(start, stop)
    lengths = [len(completions.prompt_ids[i]) + len(completions.tokens[i]) for i in rows]
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    attention = torch.zeros((len(lengths), width), dtype=torch.long)
    targets = torch.full((len(lengths), width), IGNORE_INDEX, dtype=torch.long)
    owner = torch.full((len(lengths), width), -1, dtype=torch.long)
    for row, index in enumerate(rows):
        prompt, tokens = completions.prompt_ids[index], completions.tokens[index]
        sequence = list(prompt) + list(tokens)
        input_ids[row, :len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        attention[row, :len(sequence)] = 1
        trained = completions.trained[index]
        if trained:
            first = len(prompt) - 1  # the last prompt position predicts the first completion token
            targets[row, first:first + trained] = torch.as_tensor(tokens[:trained], dtype=torch.long)
            owner[row, first:first + trained] = row
    return {"input_ids": input_ids, "attention_mask": attention}, targets, {"sequence_index": owner,
                                                                             "n_sequences": len(lengths)}


@dataclass
class StepRollout:
    """A generation's micro-batches on this rank, and the step's numbers over every rank."""

    window: list  # MicroBatch, on the host
    targets: int  # trained completion tokens of the step, every rank
    units: int  # what the step's loss is a mean over, every rank
    records: list  # every rank's completions with their rewards (main process, when they are logged)
    generated_tokens: int = 0  # every rank's
    generation_seconds: float = 0.0  # the slowest rank's
    gap: dict | None = None  # the sampler-vs-trainer log-prob gap over every rank: sum, count, max (vLLM)
    truncated_ratio: float = 0.0  # every rank's completions cut at max_completion_length
    zero_spread_ratio: float = 0.0  # completions whose group's rewards do not differ (advantage 0)
    gap_parts: list | None = None  # (vLLM, when the loss compares) this rank's [max, sum, count] per micro-batch
    line: dict | None = None  # numbers of the step's rewards for the train line (EBFT's terms)


@dataclass
class Sampled:
    """One rank's completions of a generation, or the error its engine raised (carried to the step's gather, so
    every rank stops together)."""

    owned: list  # the prompt index of each completion
    completions: Completions | None
    error: str | None
    seconds: float = 0.0


class Rollouts:
    """Makes each step's rollout on this rank (see the module's text)."""

    def __init__(self, cfg, prompts, tokenizer, functions, accelerator, stop_ids: set[int], micro_batch_size: int,
                 accumulation: int, engine, matching=None):
        self.cfg, self.settings, self.prompts, self.tokenizer = cfg, cfg.trl_settings, prompts, tokenizer
        self.functions, self.accelerator, self.stop_ids = functions, accelerator, stop_ids
        self.micro_batch_size, self.accumulation = micro_batch_size, accumulation
        self.engine = engine
        self.matching = matching  # EBFT's feature-matching reward (feature_matching.py): the step's first reward
        self.reward_names = online_reward_names(cfg)
        weights = self.settings.reward_weights or [1.0] * len(self.reward_names)
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.aggregation = self.settings.aggregation(cfg.rl)
        self.unscored_steps = 0  # steps in a row that no reward function scored (trl.unscored_steps_allowed)

    def seed_of(self, generation: int, rank: int) -> int:
        return (self.cfg.seed * 1_000_003 + generation * 7_919 + rank) % (2 ** 63)

    def sample(self, policy, generation: int, step_prompts: list[int], rank: int) -> Sampled:
        """This rank's completions of one generation over `step_prompts` (the step's prompt indices, every rank's).
        Touches no collective and no training state: it may run in a thread beside the training (async mode)."""
        settings, group = self.settings, self.settings.num_generations
        local = self.micro_batch_size * self.accumulation
        owned = [step_prompts[c // group] for c in range(rank * local, (rank + 1) * local)]
        prompt_ids = [self.prompts.ids[p] for p in owned]
        stops = self.stops()
        cap = completion_cap(self.cfg, self.prompts, step_prompts)
        if os.environ.get(FIXED_COMPLETIONS_ENV):
            fixed = json.loads(Path(os.environ[FIXED_COMPLETIONS_ENV]).read_text())
            chosen = [fixed[str(p)][c % group] for p, c in zip(owned, range(rank * local, (rank + 1) * local))]
            return Sampled(owned, cut_completions(prompt_ids, chosen, stops, settings, limit=cap), None)
        try:
            generated = self.engine.generate(policy, prompt_ids, self.seed_of(generation, rank), stops,
                                             self.accelerator.autocast, cap)
        except UserError as raised:
            return Sampled(owned, None, str(raised))
        return Sampled(owned, cut_completions(prompt_ids, generated.tokens, stops, settings, generated.log_probs,
                                              cap), None, generated.seconds)

    def stops(self) -> list[int]:
        return sorted(self.stop_ids | set((self.settings.generation_kwargs or {}).get("stop_token_ids") or []))

    def make(self, policy, reference, generation: int, step_prompts: list[int], rank: int, world_size: int,
             keep_records: bool, progress=None, sampled: Sampled | None = None) -> StepRollout:
        """This rank's share of one generation: sampled now, or given (sampled ahead, async mode); scored, and cut
        into micro-batches."""
        settings, group = self.settings, self.settings.num_generations
        local = self.micro_batch_size * self.accumulation
        if sampled is None:
            sampled = self.sample(policy, generation, step_prompts, rank)
        owned, completions, error = sampled.owned, sampled.completions, sampled.error
        table = texts = features = None
        names = []
        prompts = [self.prompts.prompts[p] for p in owned]
        where = [self.prompts.where[p] for p in owned]
        if error is None:
            texts = self.tokenizer.batch_decode(completions.tokens, skip_special_tokens=True)
            shown = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                     for prompt, text in zip(prompts, texts)]
            names = [key for key in dict.fromkeys(key for p in owned for key in self.prompts.columns[p])
                     if key not in ("completion", "completion_ids")]  # (TRL passes its own under those names)
            columns = {key: [self.prompts.columns[p].get(key) for p in owned] for key in names}
            try:
                table = score(self.functions, prompts, shown, completions.tokens, columns, where, progress)
                if self.matching is not None:  # (pooled here, compared over whole groups once gathered)
                    features = self.matching.local_features(policy, reference, completions, owned,
                                                            set(self.stops()), self.accelerator.device,
                                                            self.accelerator.autocast)
            except UserError as raised:
                error = str(raised)
        records = ([{"prompt": prompt, "completion": text, "completion_ids": ids, "where": place}
                    for prompt, text, ids, place in zip(prompts, texts, completions.tokens, where)]
                   if keep_records and texts else None)
        generated = sum(len(tokens) for tokens in completions.tokens) if completions else 0
        cut = sum(completions.truncated) if completions else 0
        shared = self._gathered((table, error, completions.trained_tokens if completions else 0, records, generated,
                                 sampled.seconds, cut, owned, features), world_size)
        failed = next((item[1] for item in shared if item[1]), None)
        if failed:
            raise UserError(f"train: {failed}; no weight of this step changed, and the last checkpoint is as it was")
        rewards = torch.tensor([row for item in shared for row in item[0]], dtype=torch.float64).reshape(
            local * world_size, len(self.functions))
        line = None
        if self.matching is not None:
            matched = self.matching.step_rewards(torch.cat([item[8][0] for item in shared]),
                                                 {p: f for item in shared for p, f in item[8][1].items()},
                                                 [p for item in shared for p in item[7]])
            rewards, line = torch.cat([matched.rewards.unsqueeze(1), rewards], dim=1), matched.line
        self._check_scored(rewards, generation, names)
        advantages, zero_spread, total = group_advantages(rewards, self.weights, group, settings.reward_scaling,
                                                          self.aggregation)
        mine = slice(rank * local, (rank + 1) * local)
        # this rank's completions in a seeded shuffle before they are cut into micro-batches (as TRL shuffles them):
        # a micro-batch then mixes prompts, which bnpo's per-micro-batch mean depends on
        order = np.random.default_rng([self.cfg.seed, generation, rank]).permutation(local)
        window, gap, gap_parts = self._micro_batches(policy, reference, completions.reordered(order),
                                                     advantages[mine][order], rewards[mine][order],
                                                     total[mine][order], zero_spread[mine][order])
        if gap is not None and world_size > 1:
            gap = merged_gaps(self._gathered(gap, world_size))
        step_tokens = sum(item[2] for item in shared)
        units = {"completion_tokens": max(step_tokens, 1), "completions": local * world_size,
                 "micro_batches": self.accumulation * world_size}[settings.unit]
        logged = []
        if keep_records:
            for index, record in enumerate(record for item in shared for record in item[3]):
                logged.append({**record, "reward": _number(total[index]), "advantage": _number(advantages[index]),
                               "rewards": {name: _number(rewards[index, k])
                                           for k, name in enumerate(self.reward_names)}})
        return StepRollout(window, step_tokens, units, logged, sum(item[4] for item in shared),
                           max(item[5] for item in shared), gap, sum(item[6] for item in shared) / len(rewards),
                           float(zero_spread.float().mean()), gap_parts, line)

    def _check_scored(self, rewards: torch.Tensor, generation: int, columns: list[str]) -> None:
        """A step on which no function scored any completion (every value None: NaN here) trains nothing, every
        advantage 0: past trl.unscored_steps_allowed such steps in a row the run stops (every rank alike: the
        rewards are every rank's), naming the functions and the columns they were given."""
        settings = self.settings
        if not bool(torch.isnan(rewards).all()):
            self.unscored_steps = 0
            return
        self.unscored_steps += settings.num_iterations  # (a generation trains that many steps)
        if self.unscored_steps <= settings.unscored_steps_allowed:
            return
        step = generation * settings.num_iterations + 1
        names = list(settings.reward_funcs or [])
        functions = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        streak = f", {self.unscored_steps} steps in a row" if self.unscored_steps > 1 else ""
        given = f"the columns: {', '.join(columns)}" if columns else "no dataset column"
        raise UserError(f"train: step {step}: no reward function scored any of the step's {len(rewards)} completions "
                        f"({functions} returned None for every one){streak}, so every advantage is 0 and nothing "
                        f"trains; they were given {given} (besides prompts, completions, completion_ids and "
                        "trainer_state): make a function return a number where it applies (check the column names "
                        "and the answer format it reads), or train through such steps with "
                        f"trl.unscored_steps_allowed: {self.unscored_steps}; no weight of this step changed, and the "
                        "last checkpoint is as it was")

    def _gathered(self, item, world_size: int) -> list:
        if world_size == 1:
            return [item]
        from accelerate.utils import gather_object

        return gather_object([item])

    def _micro_batches(self, policy, reference, completions: Completions, advantages, rewards, total,
                       zero_spread) -> tuple[list, dict | None, list | None]:
        from tuneloop.log_probs import reference_mode, token_log_probs

        settings, device = self.settings, self.accelerator.device
        sampled = completions.sampling_log_probs is not None
        checked_here = sampled and settings.num_iterations > 1  # (else the loss compares, in the training forward)
        pad, window, gaps, gap_parts = self.tokenizer.pad_token_id, [], [], []
        for start in range(0, len(completions.tokens), self.micro_batch_size):
            stop = start + self.micro_batch_size
            inputs, targets, extra = completion_rows(completions, start, stop, pad)
            extra.update(advantages=advantages[start:stop].float(), rewards=rewards[start:stop].float(),
                         total_reward=total[start:stop].float(), zero_std=zero_spread[start:stop],
                         truncated=torch.tensor(completions.truncated[start:stop]))
            batch = MicroBatch(inputs, targets, int((targets != IGNORE_INDEX).sum()),
                               int(inputs["attention_mask"].sum()), extra)
            on_device = None
            if settings.num_iterations > 1 or settings.beta != 0.0:
                on_device = batch.to(device)
            with torch.no_grad(), self.accelerator.autocast():  # as the training forward computes
                # the generating policy's log-probs: the ratio's denominator (and, on vLLM, what its sampling log-probs
                # are compared with)
                if settings.num_iterations > 1:
                    extra["old_log_probs"] = token_log_probs(policy, on_device.inputs, on_device.targets,
                                                             settings.temperature)[0].float().cpu()
                if settings.beta != 0.0:
                    if reference is not None:
                        values = token_log_probs(reference, on_device.inputs, on_device.targets, settings.temperature)
                    else:
                        with reference_mode(policy):
                            values = token_log_probs(policy, on_device.inputs, on_device.targets,
                                                     settings.temperature)
                    extra["reference_log_probs"] = values[0].cpu()
            if sampled:
                sampler = torch.tensor([value for index in range(start, stop)
                                        for value in completions.sampling_log_probs[index][:completions.trained[index]]],
                                       dtype=torch.float32)
                if checked_here:
                    owner = extra["sequence_index"].reshape(-1)[(targets != IGNORE_INDEX).reshape(-1)]
                    difference = extra["old_log_probs"] - sampler
                    gaps.append(difference.abs())
                    if settings.vllm_importance_sampling_correction:
                        extra["is_ratio"] = importance_weights(difference, owner, extra["n_sequences"], settings)
                else:
                    extra["sampling_log_probs"] = sampler
                    extra["gap_parts"] = gap_parts  # (filled by the loss: loss.py)
            window.append(batch)
        if not checked_here:
            return window, None, gap_parts if sampled else None
        gap = torch.cat(gaps) if gaps else torch.zeros(0)
        return window, {"sum": float(gap.sum()), "count": int(gap.numel()),
                        "max": float(gap.max()) if gap.numel() else 0.0}, None


def merged_gaps(gaps: list) -> dict:
    return {"sum": sum(g["sum"] for g in gaps), "count": sum(g["count"] for g in gaps),
            "max": max(g["max"] for g in gaps)}


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 6)


def prompt_order(prompts: int, epoch: int, seed: int) -> np.ndarray:
    """The prompts of an epoch in a seeded shuffle (TRL shuffles its dataset too)."""
    return np.random.default_rng([seed, epoch]).permutation(prompts)


def generation_prompts(prompts: int, per_step: int, generations_per_epoch: int, generation: int,
                       seed: int) -> list[int]:
    """The prompt indices of a generation, every rank's (the plan and the run read them alike)."""
    epoch, within = divmod(generation, generations_per_epoch)
    order = prompt_order(prompts, epoch, seed)
    return [int(p) for p in order[within * per_step:(within + 1) * per_step]]
