"""Before the first step: can output_dir hold what the run will write? (A final save that fails after hours:
LLaMA-Factory #7614.)

The run writes its final model and, when it saves, checkpoints (the model again, the optimizer state, the RNG
states). The free space is read, and a file of one checkpoint's size is allocated once and removed: a quota or a
nearly full disk that the free space does not show refuses it too. Too little for the model and one checkpoint
is refused (`--ignore-disk-check` starts anyway); too little for every checkpoint the run keeps is said.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tuneloop import run_files
from tuneloop.errors import UserError
from tuneloop.optim import OPTIMIZERS

PROBE = f"{run_files.TEMP_PREFIX}disk-probe"


@dataclass(frozen=True)
class OutputSizes:
    model: int  # the final model's files: its weights (an adapter's), as saved
    checkpoint: int  # one checkpoint: the model, the optimizer state and a little more
    checkpoints_kept: int  # how many the run keeps at once (save_total_limit), at most its saves


def output_sizes(cfg, plan) -> OutputSizes:
    memory = plan.memory
    saved_bytes = 2 if cfg.bfloat16 or cfg.float16 else 4  # (an adapter is saved in fp32)
    model = memory["trainable_parameters"] * 4 if cfg.adapter else memory["parameters"] * saved_bytes
    optimizer = memory["trainable_parameters"] * OPTIMIZERS[cfg.optimizer].state_bytes_per_param
    kept = min(plan.save_count, cfg.save_total_limit or plan.save_count)
    return OutputSizes(model, int(model + optimizer + (1 << 20)), kept)


def check_room(output_dir: Path, sizes: OutputSizes, notice) -> None:
    """Refuses (a UserError) a folder that cannot hold the model and one checkpoint; `notice(text)` where it cannot
    hold every checkpoint the run keeps."""
    needed = sizes.model + (sizes.checkpoint if sizes.checkpoints_kept else 0)
    free = shutil.disk_usage(output_dir).free
    gb = 1e9
    if free < needed:
        raise UserError(f"output: {output_dir} has {free / gb:.2f} GB free, and the run writes about {needed / gb:.2f} "
                        f"GB there (the final model {sizes.model / gb:.2f} GB"
                        + (f", a checkpoint {sizes.checkpoint / gb:.2f} GB" if sizes.checkpoints_kept else "")
                        + "): free space or choose another output_dir; `tuneloop train --ignore-disk-check` starts "
                        "anyway")
    if sizes.checkpoints_kept:
        _probe(output_dir, sizes.checkpoint)
    everything = sizes.model + sizes.checkpoint * sizes.checkpoints_kept
    if free < everything:
        notice(f"{output_dir} has {free / gb:.2f} GB free: enough for the final model and one checkpoint, not for "
               f"the {sizes.checkpoints_kept} checkpoints the run keeps ({everything / gb:.2f} GB in all); lower "
               "save_total_limit or free space")


def _probe(output_dir: Path, size: int) -> None:
    """A checkpoint-sized file allocated and removed: what a quota refuses, the free space does not show."""
    path = output_dir / PROBE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, size)
        finally:
            os.close(descriptor)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a file system that cannot allocate ahead: the free space was all there was to read
        raise UserError(f"output: {output_dir} cannot hold a checkpoint of {size / 1e9:.2f} GB ({error.strerror}: a "
                        "full disk or a quota): free space or choose another output_dir; `tuneloop train "
                        "--ignore-disk-check` starts anyway") from None
    finally:
        path.unlink(missing_ok=True)
