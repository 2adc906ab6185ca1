"""The model the run leaves behind: a standard Hugging Face folder in output_dir.

Files appear in output_dir only when complete: the model is written into a hidden folder first
and each file is then renamed into place, so a kill or a full disk during the final save never
leaves a torn `model.safetensors` where `from_pretrained` would find it. Early stopping keeps the
best model so far in `best/` the same way and publishes it at the end.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tuneloop import run_files
from tuneloop.run_files import fsync_files, make_readable, move_files_into


def save_hf_folder(model, tokenizer, folder: Path, weights: dict | None = None) -> None:
    """from_pretrained(folder) loads it (the adapter, for LoRA). `weights`: the state dict gathered from a sharded
    model (FSDP2, ZeRO-3), whose own tensors are only this rank's pieces."""
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = True  # off for training (packing needs it off); on for whoever generates next
    model.save_pretrained(folder, safe_serialization=True, state_dict=weights)
    if weights:
        config_says_dtype_of(folder, weights)
    tokenizer.save_pretrained(folder)
    from tuneloop.data.images import image_inputs_of

    if image_inputs_of(tokenizer) is not None:  # a vision-language model's processor, for AutoProcessor
        image_inputs_of(tokenizer).save(folder)
    make_readable(folder)


def config_says_dtype_of(folder: Path, weights: dict) -> None:
    """config.json names the dtype of the weights saved beside it (save_pretrained names the model's own, and a
    16-bit DeepSpeed model saves its fp32 masters): `from_pretrained(dtype="auto")` then loads what was saved."""
    import json

    import torch

    floats = {value.dtype for value in weights.values() if torch.is_tensor(value) and value.is_floating_point()}
    path = folder / "config.json"
    if len(floats) != 1 or not path.is_file():
        return
    config = json.loads(path.read_text())
    name = str(floats.pop()).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def publish_final(model, tokenizer, output_dir: Path, weights: dict | None = None) -> None:
    """Main process only: the trained model, written whole before any file lands in output_dir."""
    temp = output_dir / run_files.TEMP_FINAL
    shutil.rmtree(temp, ignore_errors=True)
    try:
        save_hf_folder(model, tokenizer, temp, weights)
        move_files_into(temp, output_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def has_best(output_dir: Path) -> bool:
    return any((output_dir / name).is_dir() for name in (run_files.BEST, run_files.OLD_BEST))


def save_best(model, tokenizer, output_dir: Path, weights: dict | None = None) -> None:
    """Main process only: the best model so far (by eval loss), for early stopping; replaced atomically."""
    temp = output_dir / run_files.TEMP_BEST
    shutil.rmtree(temp, ignore_errors=True)
    try:
        save_hf_folder(model, tokenizer, temp, weights)
        fsync_files(temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        model.config.use_cache = False  # save_hf_folder switched it on; training goes on
    best, old = output_dir / run_files.BEST, output_dir / run_files.OLD_BEST
    run_files.record(output_dir, run_files.BEST)
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        best.rename(old)  # a kill from here on leaves .old-best, which publish_best falls back to
    temp.rename(best)
    shutil.rmtree(old, ignore_errors=True)


def publish_best(output_dir: Path) -> None:
    """Early stopping: the folder's model is the best one, not the last one."""
    best = output_dir / run_files.BEST
    if not best.is_dir():  # killed between the two renames of save_best
        (output_dir / run_files.OLD_BEST).rename(best)
    temp = output_dir / run_files.TEMP_FINAL
    shutil.rmtree(temp, ignore_errors=True)
    try:
        shutil.copytree(best, temp)
        move_files_into(temp, output_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
