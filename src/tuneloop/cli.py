"""Command line: `tuneloop train|plan|preprocess|setup CONFIG`.

A user error (bad key, bad row, missing file) prints one message on stderr and exits 2,
never a traceback. Heavy imports (torch, transformers) happen inside the commands, so
`--help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from tuneloop.errors import (DIVERGED_EXIT_CODE, PREEMPTED_EXIT_CODE, CheckpointFailed, TrainingDiverged,
                             UserError)

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


def _config(args):
    from tuneloop.config import load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(args.config, args.set)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return cfg


def _prepared(cfg, force: bool = False):
    from transformers.utils import logging as transformers_logging

    from tuneloop.data.prepare import prepare
    from tuneloop.model import load_tokenizer

    transformers_logging.disable_progress_bar()  # per-file load/save bars drown the plan and the step lines

    tokenizer = load_tokenizer(cfg)
    return tokenizer, prepare(cfg, tokenizer, force=force)


def _plan(cfg, prepared, world_size: int):
    import numpy as np

    from tuneloop.embedded import resolve_model_path
    from tuneloop.memory import estimate_memory
    from tuneloop.model import mixed_precision
    from tuneloop.plan import attach_memory_estimate, make_plan

    plan = make_plan(cfg, np.asarray(prepared.train["length"]), np.asarray(prepared.train["n_targets"]),
                     prepared.stats.eval_rows, prepared.stats.dropped_too_long, world_size)
    estimate = estimate_memory(cfg, resolve_model_path(cfg.base_model), plan.max_micro_batch_tokens,
                               mixed_precision(cfg))
    attach_memory_estimate(plan, estimate)
    return plan


def command_plan(args) -> int:
    from tuneloop.plan import describe, world_size_from_env

    cfg = _config(args)
    _, prepared = _prepared(cfg)
    plan = _plan(cfg, prepared, args.world_size or world_size_from_env())
    print(json.dumps(plan.to_json(), indent=2) if args.json else describe(plan))
    return 0


def command_preprocess(args) -> int:
    cfg = _config(args)
    tokenizer, prepared = _prepared(cfg, force=args.force)
    stats = prepared.stats
    print(f"prepared {stats.train_rows} train and {stats.eval_rows} eval rows from {stats.rows_read} read "
          f"({stats.dropped_too_long} longer than sequence_len={cfg.sequence_len} dropped, "
          f"{stats.dropped_no_trained_tokens} with no trained tokens dropped) into {prepared.cache_dir}")
    for index in range(min(args.show, stats.train_rows)):
        row = prepared.train[index]
        print(f"\n--- row {index} ({row['length']} tokens, {row['n_targets']} trained; trained text "
              f"between {TRAINED_OPEN} {TRAINED_CLOSE}) ---")
        print(marked_text(row["input_ids"], row["labels"], tokenizer))
    return 0


def marked_text(input_ids: list[int], labels: list[int], tokenizer) -> str:
    """The row's text with each run of trained tokens wrapped in ⟦ ⟧."""
    pieces, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or (labels[end] != -100) != (labels[start] != -100):
            text = tokenizer.decode(input_ids[start:end])
            pieces.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if labels[start] != -100 else text)
            start = end
    return "".join(pieces)


def command_train(args) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from tuneloop.model import load_model, mixed_precision
    from tuneloop.plan import describe
    from tuneloop.train import checkpoint, run_dir
    from tuneloop.train.guards import StopRequests
    from tuneloop.train.loop import train

    cfg = _config(args)
    output_dir = Path(cfg.output_dir)
    if cfg.auto_resume_from_checkpoints and not args.overwrite and run_dir.finished_run(output_dir):
        print(f"{output_dir} holds a finished run (summary.json); nothing to resume")
        return 0
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision(cfg))
    if cfg.tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    set_seed(cfg.seed)
    with accelerator.main_process_first():  # rank 0 fills the data cache, the others read it
        tokenizer, prepared = _prepared(cfg)
    plan = _plan(cfg, prepared, accelerator.num_processes)
    identity = {"data_key": prepared.cache_dir.name, "base_model": cfg.base_model, "adapter": cfg.adapter}
    resume = None
    if accelerator.is_main_process:
        resume = run_dir.prepare_output_dir(cfg, output_dir, args.overwrite)
        if resume is not None:
            run_dir.check_resumable(checkpoint.read_state(resume), plan.to_json(), identity, args.force_resume)
            run_dir.continue_from(output_dir, resume)
        (output_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))
        print(describe(plan), flush=True)
        if resume is not None:
            print(f"resuming from {resume} (step {checkpoint.step_of(resume)})", flush=True)
    resume = _shared(accelerator, resume)
    model = load_model(cfg, tokenizer, checkpoint=resume)
    try:
        with StopRequests() as stop:
            outcome = train(cfg, plan, prepared, tokenizer, model, accelerator, identity, resume_from=resume,
                            stop=stop)
    except (TrainingDiverged, CheckpointFailed) as error:  # raised on every rank at the same collective
        # said before the ranks leave: a launcher stops the other ranks as soon as one exits non-zero
        exit_code = _say_error(error)
        _leave_together(accelerator)
        return exit_code
    exit_code = PREEMPTED_EXIT_CODE if outcome.stopped_by == "signal" else 0
    try:
        if accelerator.is_main_process:
            try:
                _finish_on_main(output_dir, outcome, plan)
            except UserError as error:  # the summary or report could not be written
                exit_code = _say_error(error)
    finally:
        _leave_together(accelerator)  # every rank, also when the main process failed here
    return exit_code


def _finish_on_main(output_dir: Path, outcome, plan) -> None:
    from tuneloop.report import write_report
    from tuneloop.train.loop import write_summary

    try:
        summary = write_summary(output_dir, outcome, plan)
        write_report(output_dir)
    except OSError as error:
        saved = "a checkpoint is" if outcome.stopped_by == "signal" else "the model is"
        raise UserError(f"output: {saved} saved in {output_dir}, but the summary or report could not be written "
                        f"({error.strerror or error}). `tuneloop report {output_dir}` redraws the report; "
                        "resuming (auto_resume_from_checkpoints: true) repeats the steps after the last "
                        "checkpoint.") from None
    if outcome.stopped_by == "signal":
        print(f"stopped by a signal after step {outcome.steps}; checkpoint saved in {output_dir}. "
              "Run again with auto_resume_from_checkpoints: true to continue.", flush=True)
    else:
        print(f"done: {summary['steps']} steps in {summary['train_seconds']} s; eval loss "
              f"{summary['first_eval_loss']} → {summary['last_eval_loss']}"
              f"{' (early stopping: best model kept)' if outcome.stopped_by else ''}; model saved to {output_dir}",
              flush=True)  # before the other ranks leave: a launcher may stop this process when they do


def _leave_together(accelerator) -> None:
    """Ranks wait for each other (rank 0 writes the summary and report meanwhile), then tear down.

    Why the wait: gloo's worker thread lets go of the last collective's tensors a moment after the
    collective returns, and it needs the GIL to do so. A rank that exits at once can reach interpreter
    finalization first; the worker then dies inside C++ and the process aborts with "terminate called
    without an active exception" (SIGABRT) after a complete run: seen on rank 1 of 2 in about one
    run in five on 2 busy cores. A barrier releases the GIL while it waits, so the worker finishes.
    """
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _shared(accelerator, value):
    """The main process's value on every rank (a path decided once, by rank 0)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def command_report(args) -> int:
    from tuneloop.report import write_report

    output_dir = Path(args.output_dir)
    if not (output_dir / "plan.json").is_file() or not (output_dir / "metrics.jsonl").is_file():
        raise UserError(f"report: {output_dir} holds no run (plan.json and metrics.jsonl are missing)")
    for path in write_report(output_dir):
        print(path)
    return 0


def command_bench(args) -> int:
    """Runs benchmarks/compare.py from the source checkout (it is not part of the installed package)."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
    if not script.is_file():
        raise UserError("bench: benchmarks/compare.py is not here; run it from a source checkout of tuneloop")
    extra = ["--config", args.config] if args.config else []
    return subprocess.call([sys.executable, str(script), *extra, *args.compare_args])


def command_setup(args) -> int:
    from tuneloop.embedded import ensure_embedded_dataset, ensure_embedded_model

    print(f"embedded model: {ensure_embedded_model()}")
    print(f"embedded data:  {ensure_embedded_dataset()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tuneloop", description="Fine-tune Hugging Face language models from one "
                                     "YAML file (axolotl's key names), in a loop as fast as a hand-written one.")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(name: str, help_text: str):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("config", help="the run's YAML file")
        sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config key (value parsed as YAML); repeatable; a.b=v for nested keys")
        return sub

    train_parser = with_config("train", "prepare the data, print the plan, train, save the model")
    train_parser.add_argument("--overwrite", action="store_true",
                              help="replace another run's files in output_dir instead of refusing")
    train_parser.add_argument("--force-resume", action="store_true",
                              help="resume even if the checkpoint was written with different settings")
    train_parser.set_defaults(handler=command_train)
    plan_parser = with_config("plan", "print every number of the run before training")
    plan_parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan_parser.add_argument("--world-size", type=int, default=None,
                             help="plan a launch on N ranks without launching it")
    plan_parser.set_defaults(handler=command_plan)
    prep_parser = with_config("preprocess", "tokenize, mask and cache the data")
    prep_parser.add_argument("--show", type=int, default=0, metavar="N",
                             help="print the first N rows with the trained text marked")
    prep_parser.add_argument("--force", action="store_true", help="rebuild the cache even if it exists")
    prep_parser.set_defaults(handler=command_preprocess)
    bench_parser = commands.add_parser(
        "bench", help="tuneloop vs the Trainer vs a bare Accelerate loop, side by side (benchmarks/compare.py)")
    bench_parser.add_argument("config", nargs="?", help="benchmark this config's model, data and batch settings")
    bench_parser.add_argument("compare_args", nargs=argparse.REMAINDER,
                              help="passed to compare.py: --quick, --repeats N, --json FILE, --profile, ...")
    bench_parser.set_defaults(handler=command_bench)
    report_parser = commands.add_parser("report", help="write report.md and report.png for a run's output_dir")
    report_parser.add_argument("output_dir")
    report_parser.set_defaults(handler=command_report)
    setup_parser = commands.add_parser("setup", help="build the embedded model and data folders (once)")
    setup_parser.set_defaults(handler=command_setup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (UserError, TrainingDiverged) as error:
        return _say_error(error)


def _say_error(error: UserError | TrainingDiverged) -> int:
    """One line on stderr, no traceback; returns the exit code."""
    if isinstance(error, TrainingDiverged):
        print(f"error: training stopped: {error}. The last complete checkpoint is kept.", file=sys.stderr,
              flush=True)
        return DIVERGED_EXIT_CODE
    print(f"error: {error}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
