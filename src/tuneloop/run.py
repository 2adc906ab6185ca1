"""One run, composed from a config: prepare the data -> plan -> load the model -> loop -> outputs.

This is tuneloop's entry point below the command line. `tuneloop train` is

    cfg = load_run_config("run.yml")               # (tuneloop.config)
    with TrainingSession(cfg, hooks) as session:   # one per process; the ranks leave together
        result = session.run()

and so is the benchmark, or a notebook. Nothing here prints: what happens is told to the hooks
(`RunHooks.planned`, the loop's phases) and returned in a RunResult; the command line decides what
to say and which exit code it means.

Errors come back two ways. A problem found before training, on one rank (a bad row, an output_dir
that holds another run) is raised as a UserError. A problem every rank meets at the same point (the
loss diverged, a checkpoint could not be written, the summary could not be written) is returned in
`RunResult.error`, so that each rank can report it before the ranks leave the session together: a
launcher stops the other ranks as soon as one exits.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tuneloop import run_files
from tuneloop.config import TuneloopConfig
from tuneloop.engines.base import forget_accelerate_state, leave_the_group
from tuneloop.errors import CheckpointFailed, TrainingDiverged, UserError
from tuneloop.rl_methods import is_online
from tuneloop.train.hooks import RunHooks, TogetherHooks


# Test hook: rank 0 prepares its data this many seconds more slowly (the other ranks must wait without timing out)
SLOW_PREPARE_ENV = "TUNELOOP_TEST_SLOW_PREPARE_SECONDS"


def prepare_data(cfg: TuneloopConfig, resolved, force: bool = False, hooks: RunHooks | None = None):
    """(tokenizer, training rows): the rows tokenized, masked and cached once, or a stream read as the run goes
    (data/source.py), or online RL's prompts (online_rl/rows.py); `hooks` hear of the progress of a cache being built, and of what the user should know."""
    from transformers.utils import logging as transformers_logging

    from tuneloop.data.source import prepare_rows
    from tuneloop.host.hardware import quiet_deepspeed_on_cpu
    from tuneloop.model.kinds import check_encoder_decoder_settings
    from tuneloop.model.tokenizer import load_tokenizer
    from tuneloop.model.vision import attach_image_inputs

    quiet_deepspeed_on_cpu()
    transformers_logging.disable_progress_bar()  # per-file load/save bars drown the plan and the step lines
    if resolved.encoder_decoder:
        check_encoder_decoder_settings(cfg)
    tokenizer = load_tokenizer(cfg, encoder_decoder=resolved.encoder_decoder)
    attach_image_inputs(cfg, resolved.model_kind, tokenizer)  # a vision-language model's processor (else nothing)
    if os.environ.get(SLOW_PREPARE_ENV) and os.environ.get("RANK", "0") == "0":
        time.sleep(float(os.environ[SLOW_PREPARE_ENV]))
    if is_online(cfg):  # prompts, whose completions the run generates as it trains (online_rl/)
        from tuneloop.online_rl.rows import prompt_rows

        return tokenizer, prompt_rows(cfg, tokenizer)
    return tokenizer, prepare_rows(cfg, resolved, tokenizer, force=force, hooks=hooks or RunHooks())


def model_shape(plan) -> dict:
    """What a checkpoint's weights fit: the model's class and size, and what is trained (an adapter's rank shows)."""
    return {"model": plan.model.split(";")[0], "trainable_parameters": plan.memory["trainable_parameters"]}


def ranks_on_this_host() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@dataclass
class RunResult:
    output_dir: Path
    plan: object | None = None  # the TrainingPlan the run followed
    outcome: object | None = None  # the loop's RunOutcome: steps, tokens, evals, what stopped it
    summary: dict | None = None  # what summary.json says (main process only)
    resumed_from: Path | None = None
    already_finished: bool = False  # auto-resume found a finished run in output_dir: nothing was done
    error: Exception | None = None  # met by every rank at once (see the module's docstring)
    push_failure: str | None = None  # main process: the final hub push failed (a warning: the run is done)

    @property
    def stopped_by_signal(self) -> bool:
        return self.outcome is not None and self.outcome.stopped_by == "signal"


class TrainingSession:
    """One training run in this process: every rank opens one, runs it, and leaves it with the others."""

    def __init__(self, cfg: TuneloopConfig, hooks: RunHooks | None = None):
        self.cfg = cfg
        self.hooks = hooks or RunHooks()
        self.resolved = None  # what the run is (resolved.py): decided when the session opens
        self.accelerator = None
        self.trackers = None  # main process: the trackers the config asks for (trackers.py), started with the plan
        self.output_lock = None  # main process: output_dir held for this run (run_files.OutputDirLock)
        self.hub = None  # main process, with hub_model_id: the run's pushes to the Hugging Face Hub (use/hub.py)
        self._main_first_count = 0  # the steps the main process takes first (see _wait_for_main)
        self.ignore_disk_check = False
        self.seconds: dict[str, float] = {}  # wall time of the steps before the loop: data, model load

    def __enter__(self) -> "TrainingSession":
        from datetime import timedelta

        from tuneloop.host.allocator import tune_host_allocator
        from tuneloop.host.hardware import quiet_deepspeed_on_cpu
        from tuneloop.host.kernel_caches import bound_kernel_caches

        tune_host_allocator()  # (a session opened from Python, not the CLI: host/allocator.py)
        bound_kernel_caches()  # (likewise: host/kernel_caches.py)
        quiet_deepspeed_on_cpu()  # (before Accelerate is imported)
        import torch
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, set_seed

        from tuneloop.engines.base import join_process_group
        from tuneloop.resolved import resolve_run

        self.resolved = resolve_run(self.cfg)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 or not torch.distributed.is_initialized():
            # a process that made its own Accelerator before (a notebook that ran the HF Trainer, a test) left
            # accelerate's process-wide state with its precision, and accelerate would refuse ours; a launched rank
            # whose earlier run ended (end_training closed its group: a sweep of runs in one launch) would keep
            # that state and never join a group again
            forget_accelerate_state()
        timeout = timedelta(seconds=self.cfg.ddp_timeout) if self.cfg.ddp_timeout else None
        join_process_group(self.resolved.engine, timeout)  # (before Accelerate's, which then uses it)
        handlers = [InitProcessGroupKwargs(timeout=timeout)] if timeout else []
        kind = self.resolved.model_kind
        if kind is not None and kind.name == "vision_language":
            # DDP wants a gradient for every trainable parameter on every rank; a VLM leaves some without one (the
            # vision tower's layers after `vision_feature_layer`, CLIP's post_layernorm; the whole tower in a
            # micro-batch of text-only rows), so DDP must look for the unused ones each step
            handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=self.resolved.precision.mixed,
                                       kwargs_handlers=handlers or None)
        if self.cfg.tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        set_seed(self.cfg.seed)
        return self

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def run(self, overwrite: bool = False, force_resume: bool = False, ignore_memory_estimate: bool = False,
            ignore_disk_check: bool = False) -> RunResult:
        """The run; every error it meets comes back in `RunResult.error` (see the module's docstring): each is
        met by every rank at the same point, a main-rank decision being shared before it is acted on.
        `overwrite`: replace an earlier run's files; `force_resume`: resume a checkpoint of other settings;
        `ignore_memory_estimate` / `ignore_disk_check`: start although the device's memory or output_dir's disk
        looks too small."""
        started = time.perf_counter()
        result = None
        self.ignore_disk_check = ignore_disk_check
        try:
            result = self._run(overwrite, force_resume, ignore_memory_estimate, started)
            return result
        except (UserError, TrainingDiverged) as error:
            return RunResult(Path(self.cfg.output_dir), error=error)
        finally:
            if self.trackers is not None:  # the summary, when there is one, and the trackers' runs closed
                self.trackers.finish(result.summary if result is not None else None)
            if self.output_lock is not None:
                self.output_lock.close()
                self.output_lock = None

    def _run(self, overwrite: bool, force_resume: bool, ignore_memory_estimate: bool, started: float) -> RunResult:
        from accelerate.utils import set_seed

        from tuneloop.config.schema import result_settings
        from tuneloop.host.hardware import check_hardware
        from tuneloop.model.load import load_model
        from tuneloop.model.tokenizer import apply_run_template
        from tuneloop.plan.build import build_plan
        from tuneloop.plan.memory import check_memory_fits
        from tuneloop.train.guards import StopRequests
        from tuneloop.train.loop import TrainingLoop
        from tuneloop.train.objectives import objective_of
        from tuneloop.trackers import check_trackers
        from tuneloop.train.resume import check_finished_run_matches, check_output_dir_apart, finished_run

        cfg, resolved, accelerator = self.cfg, self.resolved, self.accelerator
        output_dir = Path(cfg.output_dir)
        check_output_dir_apart(cfg)
        check_hardware(cfg, resolved)
        check_trackers(cfg)  # (started after the plan by the main process; what would stop them is said before the
        # data is read, by every rank alike)
        settings = result_settings(cfg)
        if cfg.auto_resume_from_checkpoints and not overwrite and finished_run(output_dir):
            check_finished_run_matches(output_dir, settings)
            return RunResult(output_dir, already_finished=True)
        if cfg.hub_model_id:  # the token, the hub and the repo, before the data is read: a failure stops every rank
            self._decided_on_main(self._open_hub)
        if cfg.rl and cfg.trl_settings.use_vllm:  # the generation server answers, with this model, before the data
            from tuneloop.generation.vllm_server import check_server

            self._decided_on_main(lambda: check_server(cfg))
        # rank 0 fills the data cache, the others read it
        clock = time.perf_counter()
        tokenizer, rows = self._on_main_first(lambda: prepare_data(cfg, resolved, hooks=self.hooks))
        self.seconds["data"] = time.perf_counter() - clock
        apply_run_template(cfg, tokenizer)  # after the data: a dataset may have asked for the tokenizer's own
        plan = build_plan(cfg, resolved, rows, tokenizer, accelerator.num_processes)
        if accelerator.num_processes > 1 and plan.compile_decision is not None:
            # each rank read its own host's compile records (plan/compile_choice.py); every rank runs rank 0's
            # decision, since a compiled rank pads its rows to other widths than an eager one
            decision = self._shared_or_raised(tuple(plan.compile_decision), None)
            if decision[0] != plan.compile_decision[0]:  # the same choice for another reason needs no new plan
                plan = build_plan(cfg, resolved, rows, tokenizer, accelerator.num_processes,
                                  compile_decision=(decision[0], f"{decision[1]} (rank 0's decision)"))
        if not ignore_memory_estimate:
            check_memory_fits(plan, ranks_on_this_host() if accelerator.device.type == "cpu" else 1)
        identity = {"data_key": rows.key, "settings": settings, "model_shape": model_shape(plan)}
        resume = self._decided_on_main(lambda: self._start_output_dir(plan, identity, overwrite, force_resume))
        clock = time.perf_counter()
        # a sharded engine's checkpoint may hold its weights only in shards: the loop loads them into the model
        on_meta = resolved.engine.builds_on_meta(accelerator.process_index, accelerator.num_processes)
        # seeded again: what ran since the seed was set draws or not by the state of this host's caches (the peak
        # probe, a data cache filled or read), and a fresh model's or an adapter's first weights must not follow
        set_seed(cfg.seed)
        model = load_model(cfg, resolved, tokenizer, checkpoint=None if resolved.engine.sharded else resume,
                           on_meta=on_meta)
        reference_model, reference = self._reference(model, tokenizer, rows, resume)
        self.seconds["model_load"] = time.perf_counter() - clock
        watchers = [watcher for watcher in (self.trackers, self.hub) if watcher is not None]
        hooks = TogetherHooks(self.hooks, *watchers) if watchers else self.hooks
        try:
            with StopRequests() as stop:
                loop = TrainingLoop(cfg, plan, rows, tokenizer, model, accelerator,
                                    objective_of(cfg, reference_model), identity, stop, hooks, resume_from=resume,
                                    reference=reference, reference_model=reference_model)
                outcome = loop.run()
        except (TrainingDiverged, CheckpointFailed) as error:  # raised on every rank at the same collective
            if self.hub is not None:
                self.hub.abandon(output_dir)
            return RunResult(output_dir, plan, resumed_from=resume, error=error)
        result = RunResult(output_dir, plan, outcome, resumed_from=resume)
        if self.is_main:
            try:
                result.summary = write_outputs(output_dir, outcome, plan,
                                               {**self.seconds, "total": time.perf_counter() - started})
            except UserError as error:  # the other ranks are already on their way out
                result.error = error
            else:
                from tuneloop.plan.compile_choice import record_run

                record_run(plan.compile_key, plan.resolved.compiled, outcome, resume is not None)  # for `auto`
            self._finish_push(result)
        return result

    def _open_hub(self) -> None:
        """Main process: the run's hub pushes, its repo reached (a UserError, before anything is trained, if not)."""
        from tuneloop.use.hub import HubPush

        self.hub = HubPush(self.cfg, self.hooks.notice)

    def _finish_push(self, result: RunResult) -> None:
        """Main process, after the outputs: the queued checkpoint pushes waited for, then the finished run pushed. A
        failure is a warning kept in `result.push_failure`, never the run's error: the run is done and its files are
        intact (`tuneloop push` uploads them later). A run stopped by a signal does not wait: it has a deadline."""
        if self.hub is None:
            return
        if result.stopped_by_signal:
            self.hub.abandon(result.output_dir)
            return
        final = result.error is None  # (a run whose summary could not be written is not pushed as finished)
        result.push_failure = self.hub.finish(result.output_dir, final=final)
        if result.push_failure:
            self.hooks.notice(result.push_failure)
        elif final:
            self.hooks.told(f"pushed to {self.hub.url}")

    def _reference(self, model, tokenizer, rows, resume: Path | None):
        """A preference run's reference: (frozen model or None, precomputed log-probs or None). See
        train/reference.py; a supervised run has neither."""
        from tuneloop.model.load import load_model
        from tuneloop.train.reference import live_reference_model, precomputed_reference

        cfg, resolved = self.cfg, self.resolved
        if not cfg.rl:
            return None, None
        if not cfg.precompute_ref_log_probs:
            return live_reference_model(cfg, model, lambda: load_model(cfg, resolved, tokenizer), resume is not None,
                                        self.accelerator.device), None

        def starting_model():  # a resumed full fine-tuning run holds trained weights: the reference is the base
            return model if resume is None or cfg.adapter else load_model(cfg, resolved, tokenizer)

        def compute():  # (preference data is prepared whole, never streamed)
            return precomputed_reference(cfg, resolved, starting_model, rows.prepared, tokenizer, self.accelerator,
                                         rows.key)

        with self.hooks.phase("reference log-probs"):
            return None, self._on_main_first(compute)

    def _start_output_dir(self, plan, identity: dict, overwrite: bool, force_resume: bool) -> Path | None:
        """Main process: a fresh output_dir, or the checkpoint to resume from (checked against this run)."""
        import yaml

        from tuneloop.train import checkpoint, resume
        from tuneloop.train.disk import check_room, output_sizes

        output_dir = Path(self.cfg.output_dir)
        notices: list[str] = []
        resume.make_output_dir(output_dir)
        self.output_lock = run_files.OutputDirLock(output_dir)  # released when the run ends (or its process dies)
        chosen = resume.prepare_output_dir(self.cfg, output_dir, overwrite, notices)
        self.output_lock.sign()
        if self.output_lock.descriptor is None:
            notices.append(f"{output_dir}'s file system gives no locks: one run at a time in it is not enforced")
        if not self.ignore_disk_check:
            check_room(output_dir, output_sizes(self.cfg, plan), notices.append)
        if chosen is not None:
            state = checkpoint.read_state(chosen)
            said, overridden = resume.check_resumable(state, plan.to_json(), identity, self.cfg.lr_scheduler,
                                                      force_resume)
            notices += said
            resume.continue_from(output_dir, chosen)
            run_files.append_json_line(output_dir / run_files.RESUMES, {
                "checkpoint": str(chosen), "step": state["step"], "forced": bool(overridden),
                "overridden": overridden})
        try:
            run_files.write_text(output_dir / run_files.RUN_CONFIG,
                                 yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
            run_files.write_json(output_dir / run_files.PLAN, plan.to_json())
        except OSError as error:
            raise UserError(f"output: cannot write in {output_dir} ({error.strerror or error})") from None
        for notice in notices:
            self.hooks.notice(notice)
        self.hooks.planned(plan, chosen)
        self._start_trackers(plan, output_dir)
        return chosen

    def _start_trackers(self, plan, output_dir: Path) -> None:
        """Main process: the trackers the config asks for, started now so that one that cannot start stops the
        run before its first step (a UserError, shared with the other ranks like every decision made here)."""
        from tuneloop.trackers import Trackers, wanted_trackers

        if not wanted_trackers(self.cfg):
            return
        self.trackers = Trackers(self.hooks.notice)
        for where in self.trackers.start(self.cfg, plan, output_dir):
            self.hooks.told(f"tracking: {where}")

    def _decided_on_main(self, decide):
        """`decide()` on the main process; its answer on every rank. A user error there (an output_dir that
        holds another run, say) stops every rank with the same message, instead of leaving the others to die
        in the next collective with gloo's connection-closed traceback."""
        if self.accelerator.num_processes == 1:
            return decide()
        value, error = self._attempt_on_main(decide)
        return self._shared_or_raised(value, error)

    def _on_main_first(self, action):
        """`action()` on the main process, then on the others (they read what it made: the data cache). A user
        error on any rank (a bad row) stops every rank with its message."""
        if self.accelerator.num_processes == 1:
            return action()
        from accelerate.utils import gather_object

        result, error = self._attempt_on_main(action)
        self._wait_for_main(error)
        if not self.is_main:
            try:
                result = action()
            except UserError as raised:
                error = str(raised)
        failed = [message for message in gather_object([error]) if message]
        if failed:
            raise UserError(failed[0])
        return result

    def _wait_for_main(self, error: str | None) -> None:
        """The main process's outcome (its user error, or none) on every rank. The others wait for it on the
        launcher's key-value store, ten minutes at a time, not in a collective: rank 0 may prepare a large dataset for
        longer than any collective's timeout (axolotl #2684), and the ranks that wait must not time out meanwhile."""
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        self._main_first_count += 1
        key = f"tuneloop/main-first/{self._main_first_count}"
        if self.is_main:
            store.set(key, error or "")
        else:
            while True:
                try:
                    store.wait([key], timedelta(minutes=10))
                    break
                except dist.DistStoreError as waited:  # no answer yet: wait on (a lost store raises otherwise)
                    if "timeout" not in str(waited).lower():
                        raise
            error = store.get(key).decode() or None
        if error is not None:
            raise UserError(error)

    def _attempt_on_main(self, action) -> tuple:
        if not self.is_main:
            return None, None
        try:
            return action(), None
        except UserError as raised:
            return None, str(raised)

    def _shared_or_raised(self, value, error):
        """The main process's (value, error) on every rank (a collective); the error raised everywhere."""
        from accelerate.utils import broadcast_object_list

        value, error = broadcast_object_list([value, error])
        if error is not None:
            raise UserError(error)
        return value

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is None:
                self.leave_together()
        finally:
            if self.accelerator.num_processes == 1:
                forget_accelerate_state()
                leave_the_group()
            elif exc_type is None:  # (after an unexpected error the other ranks may be anywhere: left as it is)
                leave_the_group()

    def leave_together(self) -> None:
        """Ranks wait for each other (rank 0 writes the summary and report meanwhile), then tear down.

        Why the wait: gloo's worker thread lets go of the last collective's tensors a moment after the
        collective returns, and it needs the GIL to do so. A rank that exits at once can reach interpreter
        finalization first; the worker then dies inside C++ and the process aborts with "terminate called
        without an active exception" (SIGABRT) after a complete run: seen on rank 1 of 2 in about one
        run in five on 2 busy cores. A barrier releases the GIL while it waits, so the worker finishes.
        An unexpected error (a bug, not a UserError: those come back in the result) skips this: the other ranks
        may be anywhere, and a barrier could wait forever.
        """
        self.accelerator.wait_for_everyone()
        if self.accelerator.num_processes > 1:
            # the barrier is itself a last collective: give every rank's gloo worker the GIL to finish it before
            # end_training closes the connections (a rank that closed first left its peer a "Connection closed"
            # and a SIGABRT on 2 busy cores, about once in a few hundred two-rank runs of the suite)
            time.sleep(0.1)
        self.accelerator.end_training()


def write_outputs(output_dir: Path, outcome, plan, seconds: dict | None = None) -> dict:
    """Main process, after the loop: summary.json and the report. Returns the summary."""
    from tuneloop.report import write_report

    try:
        summary = summary_of(outcome, plan, seconds)
        run_files.write_json(output_dir / run_files.SUMMARY, summary)
        write_report(output_dir)
    except OSError as error:
        saved = "a checkpoint is" if outcome.stopped_by == "signal" else "the model is"
        raise UserError(f"output: {saved} saved in {output_dir}, but the summary or report could not be written "
                        f"({error.strerror or error}). `tuneloop report {output_dir}` redraws the report; "
                        "resuming (auto_resume_from_checkpoints: true) repeats the steps after the last "
                        "checkpoint.") from None
    return summary


def summary_of(outcome, plan, seconds: dict | None = None) -> dict:
    """The run in numbers. Throughput after the first step is what MFU is taken from: under torch.compile the
    first step is mostly compiling, and without it the first step still warms up allocators and caches.
    `seconds`: the wall time before the loop (data, model_load) and of the whole session (total)."""
    from tuneloop.plan.flops import mfu

    def per_second(tokens: int, seconds: float | None) -> float | None:
        return round(tokens / seconds, 1) if seconds and seconds > 0 and tokens else None

    after_first = per_second(outcome.real_tokens - outcome.first_step_real_tokens,
                             outcome.train_seconds - (outcome.first_step_seconds or 0))
    # MFU is the training steps' use of the device: the evals' and checkpoints' time is left out, as their FLOPs
    # are not counted (the throughput above keeps them: it is what the user waits for)
    steps_only = per_second(outcome.real_tokens - outcome.first_step_real_tokens,
                            outcome.training_seconds - (outcome.first_step_seconds or 0))
    utilisation = mfu(steps_only, plan.flops_per_token, plan.peak_flops)
    return {"steps": outcome.steps, "planned_steps": plan.total_steps, "tokens": outcome.tokens,
            "targets_collated": outcome.targets_collated, "real_tokens": outcome.real_tokens,
            "train_seconds": round(outcome.train_seconds, 4),
            "real_tokens_per_second": per_second(outcome.real_tokens, outcome.train_seconds),
            "first_step_seconds": round(outcome.first_step_seconds, 3) if outcome.first_step_seconds else None,
            "real_tokens_per_second_after_first_step": after_first,
            "real_tokens_per_second_of_the_steps": steps_only,  # after the first, evals and saves left out
            "mfu": round(utilisation, 4) if utilisation is not None else None,
            "stopped_by": outcome.stopped_by,
            "first_eval_loss": outcome.evals[0]["eval_loss"] if outcome.evals else None,
            "last_eval_loss": outcome.evals[-1]["eval_loss"] if outcome.evals else None,
            "seconds": time_split(outcome, seconds or {}),
            "held_bytes_per_rank": outcome.held_per_rank,  # weights and optimizer state, counted on each rank
            **({"stream": outcome.stream} if outcome.stream is not None else {}),
            **({"mesh": outcome.mesh} if outcome.mesh is not None else {}),  # as built, beside the plan's
            "peak_memory_gb": peak_memory(plan)}


def time_split(outcome, before_loop: dict) -> dict:
    """Where the session's wall time went. Training is the loop without its evals and checkpoints; the rest of
    total (planning, the summary) is what none of the parts name."""
    parts = {"data": before_loop.get("data"), "model_load": before_loop.get("model_load"),
             "training": outcome.training_seconds, "eval": outcome.eval_seconds, "saving": outcome.save_seconds,
             "total": before_loop.get("total")}
    return {name: round(value, 2) if value is not None else None for name, value in parts.items()}


def peak_memory(plan) -> dict:
    """This process's peak resident memory (host), the device's peak allocation where there is one, and the
    plan's estimate beside them. Reading either costs no device sync."""
    import resource
    import sys

    import torch

    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    rss = rss_kb if sys.platform == "darwin" else rss_kb * 1024
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"host_rss": round(rss / 1e9, 2), "cuda_allocated": round(cuda / 1e9, 2) if cuda is not None else None,
            "estimated": plan.estimated_memory_gb}
