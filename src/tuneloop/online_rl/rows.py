"""An online RL run's rows behind data/source.py's interface: the plan counts its steps, the loop reads them.

A step takes `prompts_per_step` = global batch ÷ num_generations prompts (the global batch counts completions, as
TRL's does), in a seeded shuffle per epoch; a last set of prompts too small for a whole step is left out of that
epoch (TRL's sampler drops it too). Each generation trains `num_iterations` optimizer steps. The step's
completion tokens are known only once they are generated, so the Step the loop reads is made at that moment, from
the weights the previous step left (rollout.py).

With num_iterations > 1 a checkpoint may fall inside a generation: each rank then keeps its rollout beside its RNG
state, and a resume trains on exactly those completions (the weights that generated them are gone).

On a vLLM server (trl.use_vllm) each generation starts by sending the server the weights the previous step left
(generation/weight_sync.py), and its log-prob gap is checked against the plan's tolerance: a gap beyond it means
the server did not sample from the trained weights, and the run stops before training on those completions. With
`trl.async_prefetch` the next generation's requests run in a thread while the loop trains the current step: its
completions come from weights one step old (the importance correction weighs them back), the gap then holds that
step's change and is logged, not checked (but on a session's first generation, which is never stale).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from tuneloop import run_files
from tuneloop.data.source import StepCounts, steps_for_epochs
from tuneloop.data.steps import Step, TrainingSteps
from tuneloop.errors import UserError
from tuneloop.online_rl.rewards import TrainerProgress
from tuneloop.online_rl.rollout import Rollouts, generation_prompts, merged_gaps
from tuneloop.rl_methods import matches_features

# steps in a row with nothing to learn from before the run says so: most completions cut at max_completion_length
# (TRL's quickstart trains on zero reward that way), or no group whose rewards differ (every advantage 0)
SILENT_STEPS = 3
MOSTLY_TRUNCATED = 0.5

# Test hook: in async mode, wait for each prefetched generation at once (staleness 0): the thread's path, the
# synchronous result
ASYNC_STALENESS_ENV = "TUNELOOP_TEST_ASYNC_STALENESS"

@dataclass
class _Stats:
    eval_rows: int = 0
    dropped_too_long: int = 0


@dataclass
class _Prepared:
    """What the session and plan read of `rows.prepared`: no eval set (online RL evaluates by its rewards)."""

    stats: _Stats
    eval = None


def prompts_per_step(cfg, world_size: int) -> int:
    completions = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world_size
    group = cfg.trl_settings.num_generations
    if completions % group:
        raise UserError(f"config: the global batch is {completions} completions (micro_batch_size "
                        f"{cfg.micro_batch_size} × gradient_accumulation_steps {cfg.gradient_accumulation_steps} × "
                        f"{world_size} ranks), which is not a whole number of groups of trl.num_generations {group}: "
                        "make the global batch a multiple of num_generations")
    return completions // group


def prompt_rows(cfg, tokenizer) -> "PromptRows":
    """An online RL run's rows: its prompts read and tokenized, its generation settings checked."""
    from tuneloop.online_rl.prompts import read_prompts
    from tuneloop.online_rl.rollout import check_generation_kwargs

    check_generation_kwargs(cfg.trl_settings)
    return PromptRows(cfg, read_prompts(cfg, tokenizer))


class PromptRows:
    def __init__(self, cfg, prompts):
        self.cfg, self.prompts = cfg, prompts
        self.prepared = _Prepared(_Stats(dropped_too_long=prompts.dropped_too_long))

    @property
    def key(self) -> str:
        return self.prompts.key

    @property
    def units(self) -> int:
        return len(self.prompts.ids)

    def rows_training_none_of(self, token_ids: set[int]) -> None:
        return None  # the trained tokens are generated as the run goes

    def count_steps(self, spec, accumulation: int, padding, max_steps: int | None, num_epochs: float) -> StepCounts:
        cfg, settings = self.cfg, self.cfg.trl_settings
        per_step = prompts_per_step(cfg, spec.world_size)
        generations_per_epoch = len(self.prompts.ids) // per_step
        if generations_per_epoch == 0:
            raise UserError(f"plan: {len(self.prompts.ids)} prompts make no whole step of {per_step} prompts; use more "
                            "prompts or a smaller global batch")
        steps_per_epoch = generations_per_epoch * settings.num_iterations
        total_steps = max_steps or steps_for_epochs(steps_per_epoch, num_epochs)
        lengths = self.prompts.lengths
        longest = int(lengths.max()) + settings.max_completion_length
        return StepCounts(
            train_rows=len(lengths), train_tokens=int(lengths.sum()), trainable_tokens=0,
            dropped_too_long=self.prompts.dropped_too_long, dropped_no_trained_tokens=0, dropped_identical_pairs=0,
            micro_batches_per_epoch=steps_per_epoch * accumulation,
            rows_cut_per_epoch=len(lengths) - generations_per_epoch * per_step, steps_per_epoch=steps_per_epoch,
            total_steps=total_steps, epochs_to_run=math.ceil(total_steps / steps_per_epoch),
            total_trainable_tokens=None, total_real_tokens=None, packing_efficiency=None, padding_fraction=None,
            max_micro_batch_tokens=spec.micro_batch_size * longest,
            # the attention each token does, at its longest: every prompt with a full-length completion
            sequence_lengths=lengths + settings.max_completion_length,
            rollout=self.rollout_numbers(spec, per_step, total_steps, generations_per_epoch))

    def rollout_numbers(self, spec, per_step: int, total_steps: int, generations_per_epoch: int) -> dict:
        """What the plan says of the generations: their count and size, and the generated tokens at most (each
        generation's cap: max_completion_length, or EBFT's adaptive one, computed as the run will)."""
        from tuneloop.online_rl.feature_matching import completion_cap
        from tuneloop.online_rl.rewards import online_reward_names

        cfg, settings = self.cfg, self.cfg.trl_settings
        completions = per_step * settings.num_generations
        generations = math.ceil(total_steps / settings.num_iterations)
        caps = [completion_cap(cfg, self.prompts, generation_prompts(len(self.prompts.ids), per_step,
                                                                     generations_per_epoch, generation, cfg.seed))
                for generation in range(generations)]
        return {"prompts_per_step": per_step, "num_generations": settings.num_generations,
                "completions_per_step": completions, "completions_per_rank": completions // spec.world_size,
                "generations": generations, "num_iterations": settings.num_iterations,
                "max_completion_length": settings.max_completion_length,
                "completion_caps": [min(caps), max(caps)] if caps and min(caps) < settings.max_completion_length
                else None,
                "generated_tokens_at_most": completions * sum(caps),
                "reference_replies": self.reply_numbers(),
                "loss_type": settings.loss_type, "unit": settings.unit, "beta": settings.beta,
                "reward_funcs": online_reward_names(cfg), **self.feature_numbers(),
                "aggregation": settings.aggregation(self.cfg.rl), "scale_rewards": settings.reward_scaling,
                # (EBFT's own reward scores every completion: its steps are never unscored)
                "unscored_steps_allowed": None if matches_features(cfg) else settings.unscored_steps_allowed,
                **self.engine_numbers(spec)}

    def reply_numbers(self) -> dict | None:
        """The rows' reference replies (prompts.py's REPLY_COLUMNS), in tokens: how long a typical answer runs."""
        lengths = [length for length in self.prompts.reply_lengths if length is not None]
        if not lengths:
            return None
        ordered = sorted(lengths)
        return {"rows": len(lengths), "median_tokens": ordered[len(ordered) // 2],
                "p90_tokens": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                "longer_than_max_completion_length": sum(length > self.cfg.trl_settings.max_completion_length
                                                         for length in lengths)}

    def feature_numbers(self) -> dict:
        """`rl: ebft`: where its reward's features come from, which layers and how they are compared."""
        if not matches_features(self.cfg):
            return {}
        from tuneloop.model.model_config import model_config
        from tuneloop.online_rl.feature_matching import plan_numbers

        return {"feature_matching": plan_numbers(self.cfg, model_config(self.cfg))}

    def engine_numbers(self, spec) -> dict:
        """Where the completions are generated, and what proves the server sampled from the trained weights."""
        settings = self.cfg.trl_settings
        if not settings.use_vllm:
            return {"engine": "transformers"}
        from tuneloop.generation.vllm_server import server_url
        from tuneloop.generation.weight_sync import sync_mode

        half = bool(self.cfg.bf16 and self.cfg.bf16 != "false") or bool(self.cfg.fp16)
        correction = None
        if settings.vllm_importance_sampling_correction:
            correction = {"mode": settings.vllm_importance_sampling_mode, "clip_min": settings.clip_min,
                          "clip_max": settings.clip_max}
        return {"engine": "vllm", "server": server_url(self.cfg), "served_model": str(self.cfg.base_model),
                "weight_sync": sync_mode(self.cfg), "logprob_gap_checked_by": settings.logprob_tolerance(half)[0],
                "logprob_tolerance": settings.logprob_tolerance(half)[1],
                "gap_checked": settings.regex is None and (settings.top_k or 0) in (0, -1) and settings.top_p >= 1.0
                and settings.min_p in (None, 0.0),
                "importance_sampling": correction, "staleness": 1 if settings.asynchronous else 0}

    def steps(self, plan, tokenizer, accelerator, hooks, *, start_step: int, resume_from=None,
              reference: dict | None = None, decoder_start_token_id: int | None = None, unit: str = "tokens",
              policy=None, reference_model=None, output_dir: Path | None = None) -> TrainingSteps:
        return RolloutSteps(self, plan, tokenizer, accelerator, hooks, start_step, resume_from, policy,
                            reference_model, output_dir)


class RolloutSteps(TrainingSteps):
    """The plan's steps, each generated when the loop asks for it (see the module's text)."""

    def __init__(self, rows: PromptRows, plan, tokenizer, accelerator, hooks, start_step: int, resume_from,
                 policy, reference_model, output_dir: Path | None):
        from tuneloop.data.chat_templates import end_of_turn_ids, resolve_template
        from tuneloop.online_rl.rewards import load_reward_functions

        cfg = rows.cfg
        self.cfg, self.plan, self.prompts, self.hooks = cfg, plan, rows.prompts, hooks
        self.policy, self.reference_model, self.accelerator = policy, reference_model, accelerator
        self.rank, self.world_size, self.start_step = accelerator.process_index, plan.world_size, start_step
        self.settings = cfg.trl_settings
        self.per_step = prompts_per_step(cfg, plan.world_size)
        self.generations_per_epoch = plan.steps_per_epoch // self.settings.num_iterations
        template = resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)
        functions = load_reward_functions(self.settings.reward_funcs or [], cfg._config_dir, accelerator.device)
        stops = end_of_turn_ids(tokenizer, template, cfg.eot_tokens)
        model_stops = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
        stops |= set(model_stops if isinstance(model_stops, list) else [model_stops] if model_stops is not None
                     else [])  # the model's own (Llama 3's <|eom_id|>, say), as TRL adds them
        self.engine = generation_engine(cfg, tokenizer, accelerator)
        matching = None
        if matches_features(cfg):
            from tuneloop.online_rl.feature_matching import FeatureMatching

            matching = FeatureMatching(cfg, rows.prompts, tokenizer, plan.micro_batch_size, policy.config)
        self.rollouts = Rollouts(cfg, rows.prompts, tokenizer, functions, accelerator, stops, plan.micro_batch_size,
                                 plan.gradient_accumulation_steps, self.engine, matching)
        rollout = plan.rollout or {}
        self.tolerance = rollout.get("logprob_tolerance")
        self.checked_by = rollout.get("logprob_gap_checked_by", "max")
        self.gap_checked = rollout.get("gap_checked", False)
        self.prefetch = None  # (generation, Future of its Sampled): async mode's generation ahead
        self.pool = ThreadPoolExecutor(max_workers=1) if self.settings.asynchronous else None
        self.staleness = int(os.environ.get(ASYNC_STALENESS_ENV, "1"))
        self.since_line = _LineNumbers()
        self.silent_streak = 0
        self.stale = False  # whether the current rollout's completions came from weights a step old (async)
        self.yielded_at = time.perf_counter()
        self.completions_log = (output_dir / run_files.COMPLETIONS if output_dir is not None and
                                self.settings.log_completions and accelerator.is_main_process else None)
        # every rank sends its completions' text along with their rewards when the main process logs or prints them
        self.keeps_records = self.settings.log_completions or bool(self.settings.num_completions_to_print)
        self.current = None  # (generation, StepRollout) being trained
        if resume_from is not None and start_step % self.settings.num_iterations:
            self.current = self._saved_rollout(resume_from)

    def step_prompts(self, generation: int) -> list[int]:
        return generation_prompts(len(self.prompts.ids), self.per_step, self.generations_per_epoch, generation,
                                  self.cfg.seed)

    def __iter__(self) -> Iterator[Step]:
        iterations = self.settings.num_iterations
        for step in range(self.start_step, self.plan.total_steps):
            generation = step // iterations
            if self.current is None or self.current[0] != generation:
                with self.hooks.phase("generation"):
                    rollout, stale = self._rollout(step, generation)
                self.current = (generation, rollout)
                self.stale = stale
                self._check_gap(step + 1, rollout.gap)  # (num_iterations > 1: measured before any training)
                self.since_line.add(rollout, self._signal_warning(step + 1, rollout))
                self._show(step + 1, rollout.records)
            rollout = self.current[1]
            self.yielded_at = time.perf_counter()
            yield Step(rollout.window, rollout.targets, rollout.units)

    def after_step(self, step: int) -> None:
        """Every rank, after the loop's optimizer step `step`: its time, and the gap its training forward found
        between the server's log-probs and its own (checked here: that forward was the only one)."""
        now = time.perf_counter()
        self.since_line.training_seconds += now - self.yielded_at
        self.yielded_at = now
        rollout = self.current[1]
        if not rollout.gap_parts:
            return
        local = torch.stack(rollout.gap_parts).double().cpu()
        mine = {"max": float(local[:, 0].max()), "sum": float(local[:, 1].sum()), "count": int(local[:, 2].sum())}
        rollout.gap_parts.clear()
        gap = mine if self.world_size == 1 else merged_gaps(self.rollouts._gathered(mine, self.world_size))
        self.since_line.add_gap(gap)
        self._check_gap(step, gap, trained=True)

    def _rollout(self, step: int, generation: int):
        """This generation's rollout, and whether its completions came from weights older than the current ones.
        Sync: the weights sent, then sampled. Async: the prefetched sample taken (or one made now, on a session's
        first generation), the weights sent, and the next generation's sample started in the thread."""
        progress = TrainerProgress(step, self.plan.total_steps, self.epoch_at(step))
        prompts = self.step_prompts(generation)
        sampled, stale = None, False
        if self.prefetch is not None and self.prefetch[0] == generation:
            sampled, stale = self.prefetch[1].result(), True
            self.prefetch = None
        started = time.perf_counter()
        self.engine.sync(self.policy, step)  # (after the prefetched requests are answered: none sees new weights)
        self.since_line.sync_seconds += time.perf_counter() - started
        self.since_line.synced = self.engine.name == "vllm"
        if self.pool is not None and self.staleness == 0:  # test hook: the thread's path, nothing overlapping
            sampled = self.pool.submit(self.rollouts.sample, self.policy, generation, prompts, self.rank).result()
        elif self.pool is not None:
            if sampled is None:  # (a session's first generation: from the weights as they are)
                sampled = self.rollouts.sample(self.policy, generation, prompts, self.rank)
            if step + 1 < self.plan.total_steps:
                upcoming = generation + 1
                self.prefetch = (upcoming, self.pool.submit(self.rollouts.sample, self.policy, upcoming,
                                                            self.step_prompts(upcoming), self.rank))
        rollout = self.rollouts.make(self.policy, self.reference_model, generation, prompts, self.rank,
                                     self.world_size, keep_records=self.keeps_records, progress=progress,
                                     sampled=sampled)
        return rollout, stale

    def _check_gap(self, step: int, gap: dict | None, trained: bool = False) -> None:
        """A synced step's completions were sampled from the trained weights: their log-probs agree with the
        trainer's to the plan's tolerance, or the run stops (before the next step; the last checkpoint stays)."""
        if gap is None or self.stale or not self.gap_checked:
            return
        measured = gap["max"] if self.checked_by == "max" else gap["sum"] / max(gap["count"], 1)
        if measured <= self.tolerance:
            return
        what = ("step {step} trained on them and is not saved" if trained else "nothing trained on them").format(
            step=step)
        raise UserError(f"train: step {step}: the vLLM server's log-probs of its completions differ from the "
                        f"trainer's by up to {gap['max']:.3g} (mean {gap['sum'] / max(gap['count'], 1):.3g}), above "
                        f"the plan's tolerance {self.tolerance:g} (of the {self.checked_by}): the server did not "
                        "sample from the trained weights (a weight sync that did not take, another model or dtype "
                        "behind the URL); "
                        f"{what}, and the last checkpoint is as it was. Restart the server with `tuneloop "
                        "vllm-serve CONFIG` (or raise trl.vllm_logprob_tolerance if this is its arithmetic)")

    def line_numbers(self) -> dict:
        return self.since_line.close()

    def _signal_warning(self, step: int, rollout) -> str | None:
        """After SILENT_STEPS steps in a row with (almost) nothing to learn from, a warning on each such step's line
        (and in report.md), said on the console the first time of a streak."""
        truncated = rollout.truncated_ratio >= MOSTLY_TRUNCATED
        flat = rollout.zero_spread_ratio >= 1.0
        self.silent_streak = self.silent_streak + 1 if truncated or flat else 0
        if self.silent_streak < SILENT_STEPS:
            return None
        if truncated:
            text = (f"{rollout.truncated_ratio:.0%} of the completions reached trl.max_completion_length "
                    f"{self.settings.max_completion_length} without a stop token, {self.silent_streak} steps in a "
                    "row: rewards of cut answers train little (raise max_completion_length)")
        else:
            text = (f"every group's rewards are equal, {self.silent_streak} steps in a row: every advantage is 0 and "
                    "nothing trains (check the reward functions, or make the task easier)")
        if self.silent_streak == SILENT_STEPS and self.accelerator.is_main_process:
            self.hooks.notice(f"step {step}: {text}")
        return text

    def collate(self, micro):
        return micro  # made whole by the rollout

    def epoch_at(self, step: int) -> float:
        return round(step / self.plan.steps_per_epoch, 4)

    @property
    def position(self):
        """Inside a generation's iterations, its rollout (saved beside this rank's RNG state)."""
        if self.settings.num_iterations == 1 or self.current is None:
            return None
        return _SavedRollout(self.current)

    def _saved_rollout(self, checkpoint: Path):
        saved = checkpoint / run_files.RANK_RNG.format(rank=self.rank)
        found = torch.load(saved, weights_only=False).get(ROLLOUT_KEY) if saved.is_file() else None
        if found is None:
            raise UserError(f"resume: {checkpoint} was written inside a generation's trl.num_iterations and holds no "
                            f"rollout for rank {self.rank}; resume it with the ranks it was written with")
        return found["generation"], found["rollout"]

    def _show(self, step: int, records: list | None) -> None:
        if not records or not self.accelerator.is_main_process:
            return
        if self.completions_log is not None:
            for record in records:
                run_files.append_json_line(self.completions_log, {"step": step, **record})
            self.hooks.completions(step, records)  # (the trackers' tables)
        for record in records[:self.settings.num_completions_to_print or 0]:
            self.hooks.told(f"step {step} completion (reward {record['reward']}): {record['completion'][:200]!r}")


def generation_engine(cfg, tokenizer, accelerator):
    """The run's engine: a vLLM server (checked before any data was read, run.py) or transformers' generate."""
    if cfg.trl_settings.use_vllm:
        from tuneloop.generation.vllm_server import VLLMEngine, check_server, server_is_local
        from tuneloop.generation.weight_sync import WeightSync

        return VLLMEngine(cfg, check_server(cfg, wait_seconds=0),
                          WeightSync(cfg, accelerator, server_is_local(cfg)))
    from tuneloop.generation.transformers_engine import TransformersEngine

    return TransformersEngine(cfg.trl_settings, tokenizer, accelerator.device)


class _LineNumbers:
    """Generation's numbers since the last train line: where the steps' time went, and the log-prob gap."""

    def __init__(self):
        self.steps, self.generation_seconds, self.training_seconds, self.generated_tokens = 0, 0.0, 0.0, 0
        self.sync_seconds, self.synced = 0.0, False
        self.gap_sum, self.gap_count, self.gap_max, self.warning = 0.0, 0, None, None
        self.reward_terms: dict[str, float] = {}  # EBFT's terms, summed over the steps

    def add(self, rollout, warning: str | None) -> None:
        self.steps += 1
        self.warning = warning or self.warning
        self.generation_seconds += rollout.generation_seconds
        self.generated_tokens += rollout.generated_tokens
        if rollout.gap is not None:
            self.add_gap(rollout.gap)
        for name, value in (rollout.line or {}).items():
            self.reward_terms[name] = self.reward_terms.get(name, 0.0) + value

    def add_gap(self, gap: dict) -> None:
        self.gap_sum += gap["sum"]
        self.gap_count += gap["count"]
        self.gap_max = max(self.gap_max or 0.0, gap["max"])

    def close(self) -> dict:
        if not self.steps:
            return {}
        line = {"generation_seconds": round(self.generation_seconds / self.steps, 3),
                "training_seconds": round(self.training_seconds / self.steps, 3),
                "generated_tokens_per_second": round(self.generated_tokens / max(self.generation_seconds, 1e-9), 1)}
        if self.synced:
            line["weight_sync_seconds"] = round(self.sync_seconds / self.steps, 3)
        if self.gap_max is not None:
            line["vllm_logprob_gap"] = round(self.gap_sum / max(self.gap_count, 1), 8)
            line["vllm_logprob_gap_max"] = round(self.gap_max, 8)
        line.update({name: round(total / self.steps, 6) for name, total in self.reward_terms.items()})
        if self.warning:
            line["warning"] = self.warning
        self.__init__()
        return line


ROLLOUT_KEY = "stream_position"  # (the slot train/checkpoint.py writes a rank's data position in)


class _SavedRollout:
    def __init__(self, current):
        self.current = current

    def to_json(self) -> dict:
        return {"generation": self.current[0], "rollout": self.current[1]}

