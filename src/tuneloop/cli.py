"""Command line: `tuneloop check|plan|preprocess|train CONFIG`, `report`, `bench`, `setup`.

A user error (bad key, bad row, missing file) prints one message on stderr and exits 2,
never a traceback. Heavy imports (torch, transformers) happen inside the commands, so
`--help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from tuneloop.arguments import positive_gb, ranks
from tuneloop.errors import DIVERGED_EXIT_CODE, PREEMPTED_EXIT_CODE, TrainingDiverged, UserError

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


def _config(args):
    from tuneloop.console import load_config_saying_warnings

    return load_config_saying_warnings(args)


def command_check(args) -> int:
    """No data, no model, no torch: the config alone, every problem at once."""
    from tuneloop.check import check_report
    from tuneloop.config import load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(args.config, args.set)
    print("\n".join(check_report(cfg)))
    for warning in caught:
        print(f"  warning: {warning.message}")
    return 0


def command_plan(args) -> int:
    from tuneloop.console import ConsoleHooks
    from tuneloop.plan.build import build_plan, world_size_from_env
    from tuneloop.plan.text import describe
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data
    from tuneloop.trackers import check_trackers

    cfg = _config(args)
    hooks = ConsoleHooks(sys.stderr if args.json else None)  # (--json keeps stdout for the plan alone)
    check_trackers(cfg)  # what `train` refuses when it starts, `plan` refuses too
    resolved = resolve_run(cfg)
    tokenizer, rows = prepare_data(cfg, resolved, hooks=hooks)
    hooks.prepared()
    plan = build_plan(cfg, resolved, rows, tokenizer, args.world_size or world_size_from_env(), args.device_memory)
    print(json.dumps(plan.to_json(), indent=2) if args.json else describe(plan))
    return 0


def command_preprocess(args) -> int:
    from tuneloop.console import ConsoleHooks
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    cfg = _config(args)
    hooks = ConsoleHooks()
    tokenizer, rows = prepare_data(cfg, resolve_run(cfg), force=args.force, hooks=hooks)
    prepared = rows.prepared
    hooks.prepared()
    stats = prepared.stats
    if getattr(rows, "prompts", None) is not None:  # online RL: prompts, whose completions the run generates
        prompts = rows.prompts
        print(f"read {len(prompts.ids)} prompts ({int(prompts.lengths.sum())} tokens; {stats.dropped_too_long} "
              f"longer than sequence_len − trl.max_completion_length dropped); they are tokenized again at each run "
              "(no cache: a prompt set is small)")
        for index in range(min(args.show, len(prompts.ids))):
            columns = ", ".join(f"{key}={value!r}" for key, value in prompts.columns[index].items())
            print(f"\n--- prompt {index} ({prompts.where[index]}; {len(prompts.ids[index])} tokens; columns for the "
                  f"rewards: {columns or 'none'}) ---")
            print(tokenizer.decode(prompts.ids[index]))
        return 0
    if prepared.train is None:  # a streamed run reads its training rows as it goes
        print(f"streamed: the training rows are read and tokenized as the run goes; prepared {stats.eval_rows} "
              f"eval rows{f' into {prepared.cache_dir}' if stats.eval_rows else ''}")
        return 0
    units = "pairs" if prepared.train.group > 1 and not prepared.train.labelled else "rows"
    identical = f", {stats.dropped_identical_pairs} identical pairs dropped" if stats.dropped_identical_pairs else ""
    identical += f", {stats.dropped_too_short} shorter than min_sample_len dropped" if stats.dropped_too_short else ""
    identical += f", {stats.dropped_duplicates} repeats dropped" if stats.dropped_duplicates else ""
    print(f"prepared {stats.train_rows} train and {stats.eval_rows} eval {units} from {stats.rows_read} read "
          f"({stats.dropped_too_long} longer than sequence_len={cfg.sequence_len} dropped, "
          f"{stats.dropped_no_trained_tokens} with no trained tokens dropped{identical}) into {prepared.cache_dir}"
          f"{f' with {prepared.worker_processes} worker processes' if prepared.worker_processes else ''}")
    store = prepared.train
    # a preference unit is two sequences: chosen and rejected, or (KTO) the row's reply and a mismatched one
    names = ("chosen", "rejected") if units == "pairs" else ("reply", "mismatched reply, for the KL estimate")
    for index in range(min(args.show, stats.train_rows)):
        for position, store_index in enumerate(store.unit_rows(index)):
            row = store[store_index]
            part = f", {names[position]}" if store.group > 1 else ""
            label = f", {'desirable' if row['label'] else 'undesirable'}" if store.labelled and position == 0 else ""
            print(f"\n--- row {index}{part}{label} ({row['length']} tokens, {row['n_targets']} trained; trained text "
                  f"between {TRAINED_OPEN} {TRAINED_CLOSE}) ---")
            images = _image_runs(tokenizer, store, store_index)
            print(marked_text(row["input_ids"], row["labels"], tokenizer, images))
    return 0


def _image_runs(tokenizer, store, index: int) -> tuple[int, list[int]] | None:
    """A vision-language row's image token id and each of its images' token counts (data/images.py), or None."""
    from tuneloop.data.images import image_inputs_of

    vision = image_inputs_of(tokenizer)
    if vision is None or not getattr(store, "has_images", False):
        return None
    return vision.never_trained[0], [int(count) for _, count in store.images(index)]


def marked_text(input_ids: list[int], labels: list[int], tokenizer,
                images: tuple[int, list[int]] | None = None) -> str:
    """The row's text with each run of trained tokens wrapped in ⟦ ⟧; `images` (the image token's id, each image's
    token count): each image's tokens shown as ⟨image 1: 256 tokens⟩ (tile tags between them included)."""
    from tuneloop.data.labels import IGNORE_INDEX

    if images is not None:
        image_id, counts = images
        pieces, start, at, number = [], 0, 0, 0
        while at < len(input_ids):
            if input_ids[at] != image_id or number == len(counts):
                at += 1
                continue
            pieces.append(marked_text(input_ids[start:at], labels[start:at], tokenizer))
            seen = 0
            while at < len(input_ids) and seen < counts[number]:
                seen += int(input_ids[at] == image_id)
                at += 1
            number += 1
            pieces.append(f"⟨image {number}: {counts[number - 1]} token{'s' if counts[number - 1] != 1 else ''}⟩")
            start = at
        pieces.append(marked_text(input_ids[start:], labels[start:], tokenizer))
        return "".join(pieces)
    pieces, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or (labels[end] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(input_ids[start:end])
            pieces.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if labels[start] != IGNORE_INDEX else text)
            start = end
    return "".join(pieces)


class ReaderGone:
    """A stream whose reader may go away (`tuneloop train … | head`): then what is printed goes nowhere, and the
    run goes on (it must not die of its log: its model and checkpoints are what matters)."""

    def __init__(self, stream):
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._went()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._went()

    def _went(self) -> None:
        self.gone = True
        try:  # the interpreter's last flush of the real stream would complain at exit otherwise
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def command_train(args) -> int:
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderGone(sys.stdout), ReaderGone(sys.stderr)
    try:
        return _train(args)
    finally:
        sys.stdout, sys.stderr = streams


def _train(args) -> int:
    from tuneloop.console import ConsoleHooks
    from tuneloop.run import TrainingSession

    cfg = _config(args)
    with TrainingSession(cfg, hooks=ConsoleHooks()) as session:  # leaving it, the ranks wait for each other
        result = session.run(overwrite=args.overwrite, force_resume=args.force_resume,
                             ignore_memory_estimate=args.ignore_memory_estimate,
                             ignore_disk_check=args.ignore_disk_check)
        if result.error is not None:
            # said before the ranks leave: a launcher stops the other ranks as soon as one exits non-zero
            return _say_error(result.error)
        if session.is_main:
            _say_outcome(result)
        return PREEMPTED_EXIT_CODE if result.stopped_by_signal else 0


def _say_outcome(result) -> None:
    from tuneloop.console import done_line

    if result.already_finished:
        print(f"{result.output_dir} holds a finished run (summary.json); nothing to resume")
    elif result.stopped_by_signal:
        print(f"stopped by a signal after step {result.outcome.steps}; checkpoint saved in {result.output_dir}. "
              "Run again with auto_resume_from_checkpoints: true to continue.", flush=True)
    else:  # before the other ranks leave: a launcher may stop this one
        print(done_line(result.summary, result.outcome.evals, result.output_dir, bool(result.plan.torch_compile),
                        bool(result.outcome.stopped_by)), flush=True)


def command_report(args) -> int:
    from tuneloop import run_files
    from tuneloop.report import write_report

    output_dir = Path(args.output_dir)
    if not (output_dir / run_files.PLAN).is_file() or not (output_dir / run_files.METRICS).is_file():
        raise UserError(f"report: {output_dir} holds no run ({run_files.PLAN} and {run_files.METRICS} are missing)")
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
    from tuneloop.demo.embedded import ensure_embedded_dataset, ensure_embedded_model

    print(f"embedded model: {ensure_embedded_model()}")
    print(f"embedded data:  {ensure_embedded_dataset()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tuneloop", description="Fine-tune Hugging Face language models from one "
                                     "YAML file (axolotl's key names), in a loop as fast as a hand-written one.")
    from tuneloop import __version__

    parser.add_argument("--version", action="version", version=f"tuneloop {__version__}")
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
    train_parser.add_argument("--ignore-memory-estimate", action="store_true",
                              help="start even when the plan's memory estimate is far above the device's memory")
    train_parser.add_argument("--ignore-disk-check", action="store_true",
                              help="start even when output_dir's disk looks too small for the model and a checkpoint")
    train_parser.set_defaults(handler=command_train)
    check_parser = with_config("check", "validate a config without reading data or the model (under a second)")
    check_parser.set_defaults(handler=command_check)
    plan_parser = with_config("plan", "print every number of the run before training")
    plan_parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan_parser.add_argument("--world-size", type=ranks, default=None,
                             help="plan a launch on N ranks without launching it")
    plan_parser.add_argument("--device-memory", type=positive_gb, default=None, metavar="GB",
                             help="memory of each device in GB (default: this machine's), to see whether the run "
                                  "fits on machines you do not have yet")
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
    from tuneloop.use.commands import add_use_commands  # infer, eval, merge-lora, export, push: use what a run trained

    add_use_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tuneloop.host.allocator import restart_with_mimalloc, tune_host_allocator
    from tuneloop.host.import_noise import quiet_import_noise
    from tuneloop.host.kernel_caches import bound_kernel_caches
    from tuneloop.train.compiling import keep_compiled_artifacts

    # before torch's first matmul, for this process and every one it starts (host/kernel_caches.py)
    bound_kernel_caches()
    if argv is None:  # the process's own command line (not a call from Python): start again under mimalloc
        restart_with_mimalloc()
    tune_host_allocator()  # before torch allocates anything (host/allocator.py)
    keep_compiled_artifacts()
    quiet_import_noise()  # before transformers imports torchao (host/import_noise.py)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (UserError, TrainingDiverged) as error:
        return _say_error(error)
    except KeyboardInterrupt:  # (train handles its own Ctrl-C: a checkpoint at the end of the step)
        print(f"error: interrupted (Ctrl-C) during `tuneloop {args.command}`; what it was writing is not left "
              "half-written (caches and saves appear whole or not at all): run it again", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # `tuneloop check CONFIG | head -1`: the reader has gone, and so do we, quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's last flush would raise again otherwise)
        return 141  # as a process stopped by SIGPIPE


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
