"""What `tuneloop train` shows while it runs, and the line it ends with.

On a terminal: the plan, then one live bar redrawn in place (steps against the plan's total, loss, lr,
real tokens/s, MFU, peak memory, time left), with each eval line printed above it. Anywhere else (a
log file, a pipe, CI): the plan, then one plain line per metrics record, as before. The bar is fed
host-side values only: the step count after every step, and the numbers of the train lines, which the
loop already brought to the host at its logging steps. Drawing it never waits for the device.

The last line, `done: ...`, is made from summary.json's values, so the two always agree.
"""

from __future__ import annotations

import math
import shutil
import sys
import time

from tuneloop.train.hooks import RunHooks

REDRAW_SECONDS = 0.2  # at most five redraws a second: a fast run's steps would otherwise flood the terminal
BAR_WIDTH = 20


def load_config_saying_warnings(args):
    """The run's config from a command's CONFIG and --set arguments, its warnings said on stderr."""
    import warnings

    from tuneloop.config import load_run_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_run_config(args.config, args.set)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return cfg


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def format_value(key: str, value) -> str:
    if key in ("mfu", "eval_token_accuracy"):
        return f"{value:.1%}"
    if isinstance(value, float) and math.isfinite(value) and key != "epoch":
        return f"{value:.4g}"
    return f"{value}"


class Pace:
    """Time left at the pace since this session's loop started (a resumed run counts from where it began)."""

    def __init__(self, total_steps: int, first_step: int):
        self.total_steps, self.first_step = total_steps, first_step
        self.started = time.perf_counter()

    def restart(self) -> None:
        self.started = time.perf_counter()

    def left(self, step: int) -> float | None:
        done = step - self.first_step
        if done <= 0 or step >= self.total_steps:
            return None
        return (time.perf_counter() - self.started) / done * (self.total_steps - step)


class ProgressLines:
    """One line per metrics record, counting against the plan: "step 7/14 | loss 1.23 | … | left ~1m05s"."""

    def __init__(self, total_steps: int, first_step: int = 0):
        self.total_steps = total_steps
        self.pace = Pace(total_steps, first_step)

    def restart(self) -> None:
        self.pace.restart()

    def line(self, record: dict) -> str:
        step = record["step"]
        parts = [f"step {step}/{self.total_steps}"]
        parts += [f"{key} {format_value(key, value)}" for key, value in record.items()
                  if key != "step" and value is not None]
        left = self.pace.left(step) if "loss" in record else None
        if left is not None:
            parts.append(f"left ~{format_duration(left)}")
        return " | ".join(parts)


def peak_memory_gb() -> float:
    """The device's peak allocation on a GPU, else this process's peak resident memory (a cheap syscall)."""
    import torch

    from tuneloop.host.hardware import peak_host_rss_bytes

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return peak_host_rss_bytes() / 1e9


class ProgressBar:
    """One line on a terminal, redrawn in place; lines printed through `above` stay above it."""

    def __init__(self, stream, total_steps: int, first_step: int = 0):
        self.stream, self.total_steps = stream, total_steps
        self.step = first_step
        self.pace = Pace(total_steps, first_step)
        self.latest: dict = {}  # the last train line's numbers
        self.drawn_at = 0.0
        self.visible = False

    def restart(self) -> None:
        self.pace.restart()

    def stepped(self, step: int) -> None:
        self.step = step
        if step == self.total_steps or time.perf_counter() - self.drawn_at >= REDRAW_SECONDS:
            self.draw()

    def train_line(self, record: dict) -> None:
        self.latest = record
        self.draw()

    def above(self, text: str, stream=None) -> None:
        """A permanent line (an eval, a warning) printed above the bar, which is then drawn again."""
        self.clear()
        print(text, file=stream or self.stream, flush=True)
        self.draw()

    def text(self) -> str:
        done = self.step / self.total_steps if self.total_steps else 1.0
        filled = int(round(done * BAR_WIDTH))
        parts = [f"step {self.step}/{self.total_steps} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:.0%}"]
        for key, label in (("loss", "loss"), ("lr", "lr"), ("real_tokens_per_second", "tok/s"), ("mfu", "mfu")):
            value = self.latest.get(key)
            if value is not None:
                parts.append(f"{label} {format_value(key, value)}")
        parts.append(f"mem {peak_memory_gb():.2f} GB")
        left = self.pace.left(self.step)
        if left is not None:
            parts.append(f"left {format_duration(left)}")
        return " | ".join(parts)

    def draw(self) -> None:
        width = shutil.get_terminal_size((120, 24)).columns - 1
        line = self.text()[:width]
        self.stream.write(f"\r{line}\x1b[K")  # \x1b[K: erase what a longer earlier line left to the right
        self.stream.flush()
        self.drawn_at, self.visible = time.perf_counter(), True

    def clear(self) -> None:
        if self.visible:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.visible = False

    def close(self) -> None:
        if self.visible:
            self.stream.write("\n")
            self.stream.flush()
            self.visible = False


class PrepareProgress:
    """Data preparation as it goes: one line redrawn on a terminal, else a plain line every PLAIN_EVERY seconds:
    rows read, the share of the data files read, rows/s, and the time left at that pace."""

    PLAIN_EVERY = 15.0

    def __init__(self, stream, live: bool):
        self.stream, self.live = stream, live
        self.started = time.perf_counter()
        self.shown_at = self.started  # a preparation shorter than the first interval says nothing
        self.visible = False

    def update(self, rows_read: int, fraction: float) -> None:
        now = time.perf_counter()
        if now - self.shown_at < (REDRAW_SECONDS if self.live else self.PLAIN_EVERY):
            return
        elapsed = now - self.started
        text = f"preparing data: {rows_read:,} rows read ({fraction:.0%} of the files)"
        if elapsed > 0:
            text += f" | {rows_read / elapsed:,.0f} rows/s"
        if 0 < fraction < 1:
            text += f" | left {format_duration(elapsed / fraction * (1 - fraction))}"
        if self.live:
            self.stream.write(f"\r{text}\x1b[K")
            self.stream.flush()
            self.visible = True
        else:
            print(text, file=self.stream, flush=True)
        self.shown_at = now

    def close(self) -> None:
        if self.visible:
            self.stream.write("\n")
            self.stream.flush()
            self.visible = False


class ConsoleHooks(RunHooks):
    """The plan, then a live bar on a terminal or a progress line per metrics record elsewhere."""

    def __init__(self, stream=None, err=None):
        self.stream = stream or sys.stdout
        self.err = err or sys.stderr
        self.live = self.stream.isatty()
        self.progress = None  # a ProgressBar (terminal) or ProgressLines, once the plan is known
        self.preparation = None  # a PrepareProgress while a data cache is built

    def preparing(self, rows_read: int, fraction: float) -> None:
        if self.preparation is None:
            self.preparation = PrepareProgress(self.stream, self.live)
        self.preparation.update(rows_read, fraction)

    def prepared(self) -> None:
        """The data is ready: the preparation line, if one was drawn, ends."""
        if self.preparation is not None:
            self.preparation.close()
            self.preparation = None

    def planned(self, plan, resume_from) -> None:
        from tuneloop.plan.text import describe
        from tuneloop.run_files import step_of

        self.prepared()
        print(describe(plan), file=self.stream, flush=True)
        first_step = 0
        if resume_from is not None:
            first_step = step_of(resume_from)
            print(f"resuming from {resume_from} (step {first_step})", file=self.stream, flush=True)
        self.progress = (ProgressBar(self.stream, plan.total_steps, first_step) if self.live
                         else ProgressLines(plan.total_steps, first_step))

    def notice(self, text: str) -> None:
        self._say(f"warning: {text}", self.err)

    def told(self, text: str) -> None:
        self._say(text, self.stream)

    def _say(self, text: str, stream) -> None:
        self.prepared()
        if isinstance(self.progress, ProgressBar):
            self.progress.above(text, stream)
        else:
            print(text, file=stream, flush=True)

    def loop_started(self) -> None:
        if self.progress is not None:
            self.progress.restart()

    def stepped(self, step: int) -> None:
        if isinstance(self.progress, ProgressBar):
            self.progress.stepped(step)

    def logged(self, record: dict) -> None:
        if not isinstance(self.progress, ProgressBar):
            print(self.progress.line(record), file=self.stream, flush=True)
        elif "loss" in record:
            self.progress.train_line(record)
        else:  # an eval line stays on screen
            self.progress.above(ProgressLines(self.progress.total_steps).line(record))

    def loop_ended(self, model) -> None:
        if isinstance(self.progress, ProgressBar):
            self.progress.close()


def done_line(summary: dict, evals: list[dict], output_dir, compiled: bool, early_stopped: bool) -> str:
    """The last line of a finished run, from summary.json's values (and the eval lines' steps)."""
    from tuneloop.plan.text import plural

    first_step = (f" (the first, compiling: {summary['first_step_seconds']:.1f} s)"
                  if summary.get("first_step_seconds") and compiled else "")
    parts = [f"done: {plural(summary['steps'], 'step')} in {summary['train_seconds']:.1f} s{first_step}"]
    if evals:
        text = f"eval loss {summary['first_eval_loss']:.4f} (step {evals[0]['step']})"
        if len(evals) > 1:
            text += f" → {summary['last_eval_loss']:.4f} (step {evals[-1]['step']})"
        parts.append(text)
    if summary.get("mfu") is not None:
        parts.append(f"MFU {summary['mfu']:.1%}")
    seconds = summary.get("seconds") or {}
    named = [(label, seconds.get(key)) for key, label in (("data", "data"), ("model_load", "model load"),
             ("training", "training"), ("eval", "eval"), ("saving", "saving"), ("total", "total"))]
    if any(value is not None for _, value in named):
        parts.append("time: " + ", ".join(f"{label} {value:.1f} s" for label, value in named if value is not None))
    memory = summary.get("peak_memory_gb") or {}
    if memory:
        measured = (f"{memory['cuda_allocated']:.2f} GB allocated on the GPU, " if memory.get("cuda_allocated")
                    is not None else "") + f"{memory['host_rss']:.2f} GB host RSS"
        estimate = f" (plan estimate {memory['estimated']:.2f} GB)" if memory.get("estimated") is not None else ""
        parts.append(f"peak memory {measured}{estimate}")
    stream = summary.get("stream")
    if stream:  # what a streamed run read, and what it left out (a prepared run's plan says it before training)
        left_out = stream["dropped_too_long"] + stream["dropped_no_trained_tokens"]
        passes = stream["passes_started"]
        trained = stream.get("rows_trained")
        parts.append(f"stream: {passes} pass{'es' if passes != 1 else ''} started, "
                     + (f"{trained} rows trained, " if trained is not None else "")
                     + f"{stream['rows_read']} source rows tokenized (read ahead, a chunk at a time), "
                     f"{left_out} left out ({stream['dropped_too_long']} longer than sequence_len)"
                     + (f", {stream['rows_without_targets']} packed rows without a trained token skipped"
                        if stream["rows_without_targets"] else ""))
    early = " (early stopping: best model kept)" if early_stopped else ""
    return "; ".join(parts) + f"{early}; model saved to {output_dir}"
