"""The model the run leaves behind: a standard Hugging Face folder in output_dir.

Files appear in output_dir only when complete: the model is written into a hidden folder first
and each file is then renamed into place, so a kill or a full disk during the final save never
leaves a torn `model.safetensors` where `from_pretrained` would find it. Early stopping keeps the
best model so far in `best/` the same way and publishes it at the end.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tuneloop.train.checkpoint import fsync_files, fsync_folder_entry

BEST_DIR = "best"
OLD_BEST_DIR = f".old-{BEST_DIR}"


def save_hf_folder(model, tokenizer, folder: Path) -> None:
    """from_pretrained(folder) loads it (the adapter, for LoRA)."""
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = True  # off for training (packing needs it off); on for whoever generates next
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def publish_final(model, tokenizer, output_dir: Path) -> None:
    """Main process only: the trained model, written whole before any file lands in output_dir."""
    temp = output_dir / ".tmp-final"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        save_hf_folder(model, tokenizer, temp)
        _move_files_into(temp, output_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def has_best(output_dir: Path) -> bool:
    return any((output_dir / name).is_dir() for name in (BEST_DIR, OLD_BEST_DIR))


def save_best(model, tokenizer, output_dir: Path) -> None:
    """Main process only: the best model so far (by eval loss), for early stopping; replaced atomically."""
    temp = output_dir / f".tmp-{BEST_DIR}"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        save_hf_folder(model, tokenizer, temp)
        fsync_files(temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        model.config.use_cache = False  # save_hf_folder switched it on; training goes on
    best, old = output_dir / BEST_DIR, output_dir / OLD_BEST_DIR
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        best.rename(old)  # a kill from here on leaves .old-best, which publish_best falls back to
    temp.rename(best)
    shutil.rmtree(old, ignore_errors=True)


def publish_best(output_dir: Path) -> None:
    """Early stopping: the folder's model is the best one, not the last one."""
    best = output_dir / BEST_DIR
    if not best.is_dir():  # killed between the two renames of save_best
        (output_dir / OLD_BEST_DIR).rename(best)
    temp = output_dir / ".tmp-final"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        shutil.copytree(best, temp)
        _move_files_into(temp, output_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _move_files_into(source: Path, output_dir: Path) -> None:
    # on disk before the renames (a power loss must not leave an empty model.safetensors behind a
    # summary.json that says the run finished); a rename within one file system is atomic, so each file
    # in output_dir is either the old one or whole
    fsync_files(source)
    for path in sorted(source.iterdir()):
        os.replace(path, output_dir / path.name)
    fsync_folder_entry(output_dir)
