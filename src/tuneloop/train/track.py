"""Metrics: one JSON object per line in output_dir/metrics.jsonl, and the window of steps a train line
averages over. (What the console shows of them is console.py's.)"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from tuneloop import run_files


class MetricsLog:
    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled  # only the main process writes
        self.pending: list[str] = []  # lines a full disk kept out, written with the next one that fits

    def write(self, record: dict) -> bool:
        """Appends the line; False where it could not be written (a full disk): it is kept and written with the
        next line, and a line never goes in half (the file is cut back to where it was)."""
        if not self.enabled:
            return True
        if not self.path.exists():
            run_files.record(self.path.parent, self.path.name)
        # NaN and inf are written as they are (json's NaN/Infinity): a bad loss must never vanish
        self.pending.append(json.dumps(record) + "\n")
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with open(self.path, "a") as handle:
                handle.write("".join(self.pending))
                handle.flush()
        except OSError:
            try:
                os.truncate(self.path, size)
            except OSError:
                pass
            return False
        self.pending.clear()
        return True


class LossWindow:
    """The optimizer steps since the last train line. The summed loss (and an objective's other sums: a
    preference loss's rewards) stay on the device, so a step that is not logged costs no host sync; units
    and real tokens are counted on the host."""

    def __init__(self, device, stat_width: int = 0, summarise=None, copies: int = 1, loss_copies: int | None = None):
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        # how many ranks count the same rows' tokens (tensor- and context-parallel ranks): their sums over ranks
        # count each row that many times; and how many compute the same loss (tensor-parallel ranks: a
        # context-parallel rank's loss is its slice's part of the row's)
        self.copies = copies
        self.loss_copies = copies if loss_copies is None else loss_copies
        self.summarise = summarise  # (the window's stats, its units) -> numbers for the train line
        self.stats = torch.zeros(stat_width, device=device, dtype=torch.float64)
        self.units = 0  # units (target tokens, or pairs) of the window's steps: the loss's denominator
        self.clock_tokens = 0  # the same, since the clock started: the throughput's numerator
        self.real_tokens = 0
        self.start = time.perf_counter()

    def restart(self) -> None:
        """The clock starts now (the first window does not count model loading or the step-0 eval)."""
        self.start = time.perf_counter()

    def add_step(self, summed_loss: torch.Tensor, units: int, tokens: int, stats: torch.Tensor | None = None) -> None:
        self.loss += summed_loss
        if stats is not None:
            self.stats += stats
        self.units += units
        self.clock_tokens += tokens

    def leave_out(self, seconds: float) -> None:
        """An eval or a checkpoint took `seconds` inside the window: the throughput (and MFU) of a train line is the
        steps' own, as the run's summary's is; the step after an eval read ~1/3 slower for it in the quickstart."""
        self.start += seconds

    def restart_clock(self) -> None:
        """Throughput counts from now (the step that just ended was compiling); the loss keeps every step."""
        self.start = time.perf_counter()
        self.clock_tokens = self.real_tokens = 0

    def close(self, accelerator) -> dict:
        """Loss per token and throughput over the window, summed over ranks (collectives: every rank
        calls it at the same step); the next window starts now."""
        loss = float(accelerator.reduce(self.loss, reduction="sum")) / self.loss_copies / self.units
        stats = {}
        if self.summarise is not None:  # a preference objective's rewards (and the fraction of pairs ranked right)
            summed = accelerator.reduce(self.stats, reduction="sum") / self.loss_copies
            stats = self.summarise(summed.tolist(), self.units)
            self.stats.zero_()
        real = int(accelerator.reduce(torch.tensor(self.real_tokens, device=self.loss.device),
                                      reduction="sum")) // self.copies
        elapsed = time.perf_counter() - self.start
        clocked = self.clock_tokens > 0  # nothing since the clock restarted: no throughput to tell
        closed = {"loss": loss, "stats": stats,
                  "tokens_per_second": round(self.clock_tokens / elapsed, 1) if clocked else None,
                  "real_tokens_per_second": round(real / elapsed, 1) if clocked else None}
        self.loss.zero_()
        self.units, self.clock_tokens, self.real_tokens, self.start = 0, 0, 0, time.perf_counter()
        return closed
