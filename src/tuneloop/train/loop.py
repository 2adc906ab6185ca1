"""The training loop: plain code, every number taken from the TrainingPlan.

Token-weighted accumulation: the loss of an optimizer step is the sum of per-token losses
over all its micro-batches on all ranks, divided by the number of target tokens in the whole
step. That count is known on the host before the step starts (the sampler is deterministic
and every rank can count every rank's rows), so normalising costs no device sync and no
collective. Each micro-batch's summed loss is scaled by world_size / step_units because
DDP averages gradients over ranks. A preference objective sums over pairs instead of tokens
(its unit), and the step's pairs are counted the same way.

We use `accelerator.no_sync` for the non-final micro-batches of a step rather than
`accelerator.accumulate`: the latter divides the loss by the accumulation count (a mean of
micro-batch means) and ties stepping to the dataloader's end, which would break both the
exact normalisation and the plan's step count on a short last window.

The host waits for the device only at logging, eval and save steps. Everything a resume needs
lives in one RunState (state.py); the loop advances it and a checkpoint writes it whole.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tuneloop import run_files
from tuneloop.data.batching import epoch_micro_batches
from tuneloop.data.collate import collator_for
from tuneloop.data.images import image_inputs_of
from tuneloop.engines.base import join_process_group
from tuneloop.host.hardware import peak_host_rss_bytes
from tuneloop.optim import build_scheduler
from tuneloop.plan.build import TrainingPlan
from tuneloop.plan.flops import mfu
from tuneloop.quant.qat import fake_quantization_of
from tuneloop.train import checkpoint
from tuneloop.train.compiling import compile_for_training, eager_for_eval
from tuneloop.train.evaluate import evaluate
from tuneloop.train.guards import LossWatchdog, StopRequests
from tuneloop.train.hooks import RunHooks
from tuneloop.train.model_folder import has_best, publish_best, publish_final, save_best
from tuneloop.train.objectives import Objective, ObjectiveModule
from tuneloop.train.state import RunState
from tuneloop.train.track import LossWindow, MetricsLog


@dataclass(kw_only=True)
class RunOutcome:
    steps: int
    tokens: int
    train_seconds: float
    real_tokens: int = 0
    targets_collated: int = 0  # target tokens the collator produced: the loss's denominators, summed
    evals: list = field(default_factory=list)
    stopped_by: str | None = None  # "signal", "early_stopping" or None (ran the whole plan)
    first_step_seconds: float | None = None  # this session's first step (under torch.compile: compiling)
    first_step_real_tokens: int = 0  # all ranks'
    eval_seconds: float = 0.0  # every eval of this session (the step-0 one too; a best-model save inside them)
    save_seconds: float = 0.0  # checkpoints and the final model
    training_seconds: float = 0.0  # train_seconds without the evals and checkpoints inside the loop
    held_per_rank: list = field(default_factory=list)  # each rank's weights and optimizer bytes (engines.held_bytes)
    stream: dict | None = None  # a streamed run: its passes, and the rows every rank read and left out this session
    mesh: str | None = None  # the DeviceMesh the engine built (N-D keys), in the plan's words


class TrainingLoop:
    """One run's loop on this rank. Built once (optimizer, scheduler, collators, restored state), run once."""

    def __init__(self, cfg, plan: TrainingPlan, rows, tokenizer, model, accelerator, objective: Objective,
                 identity: dict, stop: StopRequests, hooks: RunHooks, resume_from: Path | None = None,
                 reference: dict | None = None, reference_model=None):
        self.cfg, self.plan, self.tokenizer, self.accelerator = cfg, plan, tokenizer, accelerator
        self.objective, self.identity, self.stop, self.hooks = objective, identity, stop, hooks
        self.output_dir = Path(cfg.output_dir)
        self.rank, self.world_size = accelerator.process_index, plan.world_size
        # the rows this process reads, of how many readers (tensor/context-parallel ranks share their rows)
        self.data_rank, self.data_ranks = plan.data_rank(self.rank), plan.data_ranks
        reference = reference or {}  # precomputed reference log-probs per store row: {"train": ..., "eval": ...}
        decoder_start = getattr(model.config, "decoder_start_token_id", None)  # encoder-decoders only
        self.resume_from = resume_from
        self.state = RunState()
        if resume_from is not None:
            self.state = RunState.from_json(checkpoint.read_state(resume_from), self.rank, self.world_size)
        # the training data, prepared or streamed (data/source.py), from the run state's step on; online RL
        # generates each step's from the policy as the previous step left it (online_rl/rows.py)
        self.steps = rows.steps(plan, tokenizer, accelerator, hooks, start_step=self.state.step,
                                resume_from=resume_from, reference=reference, decoder_start_token_id=decoder_start,
                                unit=objective.unit, policy=model, reference_model=reference_model,
                                output_dir=self.output_dir)
        prepared = rows.prepared
        self.eval_batches, self.eval_collate = [], None
        self.eval_rounds, self.eval_filler = 0, None  # the most eval batches a rank holds; one any rank can run
        if prepared.eval is not None:
            spec = plan.eval_batching
            every_rank = epoch_micro_batches(np.asarray(prepared.eval.unit_column("length")), spec, 0,
                                             shuffle=False, even=False)
            self.eval_batches = every_rank[self.data_rank]
            self.eval_rounds = max(len(batches) for batches in every_rank)
            self.eval_filler = next((batches[0] for batches in every_rank if batches), None)
            self.eval_collate = collator_for(prepared.eval, tokenizer.pad_token_id, spec.mode == "packed",
                                             plan.padding.unfixed(), reference.get("eval"), decoder_start,
                                             images=image_inputs_of(tokenizer))

        # `qat:` fake-quantized layers, on or off for the step the run starts from; swapped in before the model is
        # compiled and wrapped (the same parameters under the same names: checkpoints stay plain)
        self.fake_quantization = fake_quantization_of(cfg, model, self.state.step)
        if plan.resolved.compiled:  # before DDP wraps the model; in place: names and checkpoints stay the eager ones
            compile_for_training(cfg, plan.resolved, model)
        # what the loop runs (the model and its loss, wrapped by the engine: DDP, FSDP2 or DeepSpeed), its
        # optimizer, and the language model itself
        spec = plan.resolved.engine
        join_process_group(spec)
        self.engine = spec.build(cfg, plan, accelerator)
        if resume_from is not None:  # refused before the engine is built, not from inside it
            checkpoint.check_engine_can_resume(resume_from, self.engine)
        self.model, self.optimizer = self.engine.prepare(ObjectiveModule(model, objective))
        # context parallel: each rank runs its slice of every row (engines/context_parallel.py)
        self.collate, self.context = self.steps.collate, None
        if plan.context_ranks > 1:
            self.collate, self.eval_collate = self.sliced(self.steps.collate), self.sliced(self.eval_collate)
        self.peak_rss_at_start = peak_host_rss_bytes()  # the model loaded and sharded: its loading's peak, per rank
        self.language_model = model
        # stepped by us, once per optimizer step
        self.scheduler = build_scheduler(cfg, plan, self.engine.scheduler_optimizer)
        if resume_from is not None:
            checkpoint.load_training_state(resume_from, self.engine, self.scheduler, self.rank)
        self.resumed = resume_from is not None
        self.metrics = MetricsLog(self.output_dir / run_files.METRICS, accelerator.is_main_process)
        self.watchdog = LossWatchdog(cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience, accelerator.device,
                                     streaks=self.state.bad_steps_in_a_row)
        self.loss_window = LossWindow(accelerator.device, objective.stat_width, objective.summarise,
                                      copies=self.world_size // self.data_ranks,
                                      loss_copies=self.world_size // plan.gradient_ranks)
        self.real_tokens = 0  # this session's, on this rank: for throughput, not part of the run state
        self.seconds = {"eval": 0.0, "save": 0.0}  # this session's wall time in evals and saves

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        plan, state = self.plan, self.state
        eval_at, save_at = set(plan.eval_steps_at), set(plan.save_steps_at)
        if not self.resumed and 0 in eval_at:
            self.evaluate(0)
        # a checkpoint written at the step early stopping fired (a later final save failed): stop again at once
        stopped_by = "early_stopping" if self.resumed and state.plateaued(self.cfg.early_stopping_patience) else None
        self.model.train()
        self.loss_window.restart()
        self.hooks.loop_started()
        train_start = time.perf_counter()
        outside_steps_before = self.seconds["eval"] + self.seconds["save"]
        first_step = None  # (seconds, real tokens on this rank) of this session's first step

        steps = iter(self.steps)
        while state.step < plan.total_steps and not stopped_by:
            planned = next(steps)
            self.fake_quantization.follow(state.step)  # `qat:` on from step fake_quant_after_n_steps (quant/qat.py)
            lr, grad_norm = self.train_step(planned.window, planned.targets, planned.units)
            step = state.step
            self.steps.after_step(step)  # (online RL: the step's sampler-vs-trainer log-prob gap, checked)
            if self.accelerator.is_main_process:
                self.hooks.stepped(step)
            if first_step is None:
                first_step = self.time_first_step(train_start)

            # a save also logs, so the metrics of a resumed run equal those of an uninterrupted one (the
            # window being averaged is not part of the run state)
            logged = step % self.cfg.logging_steps == 0 or step == plan.total_steps or step in save_at
            if logged:
                self.log_train_line(step, lr, grad_norm)
            improved = False  # (save_strategy: best saves only at the evals that improve its metric)
            if step in eval_at:
                improved = self.evaluate(step)
                if state.plateaued(self.cfg.early_stopping_patience):
                    stopped_by = "early_stopping"
            saved = step in save_at and (improved or plan.saves_at_best is None)
            if saved:
                self.save(step)
            # a signal during the last step changes nothing: the run is complete and saves its model
            if step < plan.total_steps and not stopped_by and self.stop.requested(self.accelerator, step):
                stopped_by = "signal"
                if not saved:
                    if not logged:
                        self.log_train_line(step, lr, grad_norm)
                    self.save(step)

        if stopped_by != "signal":
            self.stop.finishing(self.output_dir / run_files.TEMP_FINAL)
        self.watchdog.check_before_save(self.accelerator)  # the final model is not saved from a diverged run
        train_seconds = time.perf_counter() - train_start
        training_seconds = train_seconds - (self.seconds["eval"] + self.seconds["save"] - outside_steps_before)
        held = self.engine.held_bytes()  # as the steps held them
        self.engine.training_ended()  # (the model holds the weights it is saved with: fp32 masters, under bf16)
        self.fake_quantization.remove()  # the plain layers back, holding the trained weights: saved as a plain model
        self.hooks.loop_ended(self.language_model)
        if stopped_by != "signal":
            best_instead = stopped_by == "early_stopping" or self.cfg.load_best_model_at_end
            self.publish_model(best_instead=best_instead and has_best(self.output_dir))
        # counted on each rank (real tokens this session; targets over the whole run): reduced once, here
        device = self.accelerator.device
        copies = self.world_size // self.data_ranks  # ranks that computed the same rows (tensor parallel)
        real_total, first_real = (int(v) // copies for v in self.accelerator.reduce(
            torch.tensor([self.real_tokens, first_step[1] if first_step else 0], device=device), reduction="sum"))
        held = self.gather_counts([held["weights"], held["optimizer"], self.peak_rss_at_start])
        return RunOutcome(
            steps=state.step, tokens=state.tokens_seen, train_seconds=train_seconds, real_tokens=real_total,
            targets_collated=sum(self.gather_counts(state.targets_collated)) // copies, evals=state.evals,
            stopped_by=stopped_by, first_step_seconds=first_step[0] if first_step else None,
            first_step_real_tokens=first_real, eval_seconds=self.seconds["eval"], save_seconds=self.seconds["save"],
            training_seconds=training_seconds,
            held_per_rank=[{"weights": held[i], "optimizer": held[i + 1], "peak_host_rss_at_start": held[i + 2]}
                           for i in range(0, len(held), 3)],
            stream=self.steps.read_counts(self.gather_counts), mesh=self.engine.built_mesh)

    @contextlib.contextmanager
    def timed(self, what: str):
        """Wall time spent in `what` ("eval" or "save"), for the summary's split of the run's time; the train lines'
        throughput leaves it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.seconds[what] += seconds
            self.loss_window.leave_out(seconds)

    def time_first_step(self, train_start: float) -> tuple[float, int]:
        """The first step's wall time (one device sync). Under torch.compile it is mostly compiling, so the
        throughput of the step lines starts after it."""
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - train_start
        if self.plan.resolved.compiled:
            self.loss_window.restart_clock()
        return seconds, self.real_tokens

    def train_step(self, window: list, step_tokens: int, step_units: int) -> tuple[float, torch.Tensor]:
        """One optimizer step over this rank's micro-batches `window`; returns the rate it used and the grad norm.
        `step_units`: what the step's loss is a mean over (its target tokens, or its pairs), on every rank."""
        accelerator, hooks, model, engine = self.accelerator, self.hooks, self.model, self.engine
        # every engine averages over the data ranks (and context-parallel ranks); the step's loss is a mean per unit
        scale = self.plan.gradient_ranks / step_units
        step_loss = torch.zeros((), device=accelerator.device, dtype=torch.float64)
        step_stats = None  # the objective's per-unit sums (rewards, ...), when it has some
        for index, micro in enumerate(window):
            with hooks.phase("collate"):
                batch = self.collate(micro)
            hooks.micro_batch(batch)
            with hooks.phase("to(device)"):
                batch = batch.to(accelerator.device)
            last = index == len(window) - 1
            with engine.accumulating(last):  # gradients reduced over ranks in the step's last backward only
                with hooks.phase("forward and loss"), accelerator.autocast():
                    loss_sum, stats = model(batch.inputs, batch.targets, batch.extra)
                with hooks.phase("backward"):
                    engine.backward(loss_sum * scale)
            step_loss += loss_sum.detach().double()
            if stats is not None:
                step_stats = stats if step_stats is None else step_stats + stats
            self.loss_window.real_tokens += batch.n_real_tokens
            self.real_tokens += batch.n_real_tokens
            self.state.targets_collated += batch.n_targets
            del loss_sum
        with hooks.phase("clip grad norm"):
            grad_norm = engine.clip_grad_norm(self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]  # the rate this update uses
        with hooks.phase("optimizer step"):
            engine.optimizer_step()
        if grad_norm is None:  # an engine that clips inside its step (DeepSpeed)
            grad_norm = engine.grad_norm_of_last_step()
        with hooks.phase("scheduler step"):
            self.scheduler.step()
        with hooks.phase("zero_grad"):
            engine.zero_grad()
        self.state.step += 1
        self.state.tokens_seen += step_tokens
        self.loss_window.add_step(step_loss, step_units, step_tokens, step_stats)
        self.watchdog.observe(self.state.step, step_loss * self.plan.gradient_ranks / step_units, grad_norm)
        return lr, grad_norm

    # ---- what happens at some steps ------------------------------------------------------------
    def log_train_line(self, step: int, lr: float, grad_norm: torch.Tensor) -> None:
        with self.hooks.phase("logging"):
            closed = self.loss_window.close(self.accelerator)
            line = {"step": step, "epoch": self.epoch_at(step), "loss": closed["loss"], **closed["stats"], "lr": lr,
                    "grad_norm": float(grad_norm), "tokens": self.state.tokens_seen,
                    "tokens_per_second": closed["tokens_per_second"],
                    "real_tokens_per_second": closed["real_tokens_per_second"], **self.steps.line_numbers()}
            utilisation = mfu(closed["real_tokens_per_second"], self.plan.flops_per_token, self.plan.peak_flops)
            if utilisation is not None:
                line["mfu"] = round(utilisation, 4)
            self.record(line)
            self.watchdog.check(self.accelerator)

    def evaluate(self, step: int) -> bool:
        """Runs the eval and records it; True when it is the best so far by metric_for_best_model."""
        with self.hooks.phase("eval"), self.timed("eval"), eager_for_eval(self.plan.resolved.compiled):
            # a sharded engine gathers weights in every forward: each rank runs as many as the busiest one
            lockstep = (self.eval_rounds, self.eval_filler) if self.engine.lockstep_eval else None
            result = evaluate(self.engine.eval_runner(), self.eval_batches, self.eval_collate, self.objective,
                              self.accelerator, lockstep=lockstep)
            self.record({"step": step, "epoch": self.epoch_at(step), **result})
            best = self.state.record_eval(step, result, *self.cfg.best_metric)
            if best and (self.cfg.early_stopping_patience or self.cfg.load_best_model_at_end):
                weights = self.engine.full_state_dict()  # a sharded model is gathered by every rank together
                checkpoint.write_on_every_rank(
                    self.accelerator, self.output_dir, "the best model",
                    on_main=lambda: save_best(self.language_model, self.tokenizer, self.output_dir, weights))
        return best

    def save(self, step: int) -> None:
        with self.hooks.phase("save"), self.timed("save"):
            self.watchdog.check_before_save(self.accelerator)  # never checkpoint a diverged model
            self.state.bad_steps_in_a_row = self.watchdog.streaks()
            streaks = self.gather_counts(self.state.bad_steps_in_a_row)
            marker = {**self.state.to_json(self.gather_counts(self.state.targets_collated),
                                           [streaks[i:i + 2] for i in range(0, len(streaks), 2)]),
                      "plan": self.plan.to_json(), "engine": self.engine.identity(), **self.identity}

            engine = self.engine
            # a sharded model's checkpoint holds its shards; its whole weights only when asked (FULL_STATE_DICT)
            whole = engine.saves_whole_weights
            weights = engine.full_state_dict() if whole else None  # collective, for a sharded model

            def write_on_every_rank() -> None:
                checkpoint.write_rank_rng(self.output_dir, step, self.rank, self.steps.position)
                if engine.writes_shards:  # collective
                    engine.save_shards(run_files.pending_shards(self.output_dir, step))

            def write_on_main() -> None:
                written = checkpoint.write_checkpoint(self.output_dir, step, marker, self.language_model,
                                                      engine.optimizer_state(), self.scheduler, self.world_size,
                                                      model_state=weights, weights=whole, tokenizer=self.tokenizer)
                best = self.state.best_step if self.plan.saves_at_best else None
                checkpoint.prune_checkpoints(self.output_dir, self.cfg.save_total_limit, keep=written,
                                             protect=best and self.output_dir / f"checkpoint-{best}")

            checkpoint.write_on_every_rank(
                self.accelerator, self.output_dir, f"step {step}", on_main=write_on_main,
                on_every_rank=write_on_every_rank,
                clean_up=lambda: checkpoint.remove_pending(self.output_dir, step, self.world_size))
            if self.accelerator.is_main_process:  # (a hub push of it starts here: use/hub.py)
                self.hooks.saved(run_files.checkpoint_dir(self.output_dir, step))

    def publish_model(self, best_instead: bool) -> None:
        if self.world_size > 1:  # decided once: a sharded model's gather below is a collective every rank must meet
            from accelerate.utils import broadcast_object_list

            best_instead = broadcast_object_list([best_instead])[0]
        model = self.language_model
        with self.timed("save"):
            weights = None if best_instead else self.engine.full_state_dict()  # collective, for a sharded model
            checkpoint.write_on_every_rank(
                self.accelerator, self.output_dir, "the final model",
                on_main=lambda: publish_best(self.output_dir) if best_instead
                else publish_final(model, self.tokenizer, self.output_dir, weights))

    # ---- small helpers ------------------------------------------------------------------------
    def sliced(self, collate):
        """`collate`, then this rank's slice of each row (context parallel: every cp rank of a data coordinate runs
        the same micro-batch, each on its slice)."""
        if collate is None:
            return None
        if self.context is None:
            import torch.distributed as dist

            from tuneloop.engines import context_parallel

            group = self.engine.context_group()
            context_parallel.join(group)
            self.context = context_parallel.ContextShare(self.plan.context_ranks, dist.get_rank(group))
        return lambda micro: self.context(collate(micro))

    def record(self, metrics: dict) -> None:
        if not self.metrics.write(metrics) and len(self.metrics.pending) == 1:  # said once, when it begins
            self.hooks.notice(f"could not write {self.metrics.path} (a full disk?): the lines are kept and written "
                              "when there is room; a checkpoint needs room too, and stops the run if there is none")
        if self.accelerator.is_main_process:
            self.hooks.logged(metrics)

    def epoch_at(self, step: int) -> float:
        """The passes over the data so far (a stream's: the pass it is in, counted from 0, as it has no length)."""
        return self.steps.epoch_at(step)

    def gather_counts(self, counts: int | list[int]) -> list[int]:
        """Every rank's count(s), on every rank, rank by rank (collective)."""
        device = self.accelerator.device
        local = torch.tensor(counts if isinstance(counts, list) else [counts], device=device)
        return [int(v) for v in self.accelerator.gather(local).tolist()]
