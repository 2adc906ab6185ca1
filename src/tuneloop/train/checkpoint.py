"""Checkpoints written atomically: a temporary folder, renamed into place only when complete.

A checkpoint folder `checkpoint-STEP` holds the model (or adapter) weights as safetensors,
the optimizer and scheduler state, every RNG state, and `tuneloop_state.json`, written last
as the completeness marker. A folder without the marker is never a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "tuneloop_state.json"
PREFIX = "checkpoint-"


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def complete_checkpoints(output_dir: Path) -> list[Path]:
    found = [p for p in output_dir.glob(f"{PREFIX}*") if p.is_dir() and (p / STATE_FILE).is_file()
             and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save_checkpoint(output_dir: Path, step: int, state: dict, model, optimizer, scheduler, accelerator,
                    save_total_limit: int | None) -> Path | None:
    """Collective: every rank calls it; the main process writes."""
    accelerator.wait_for_everyone()
    final = output_dir / f"{PREFIX}{step}"
    if accelerator.is_main_process:
        temp = output_dir / f".tmp-{PREFIX}{step}"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        accelerator.unwrap_model(model).save_pretrained(temp, safe_serialization=True)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": rng_states()}, temp / "training_state.pt")
        (temp / STATE_FILE).write_text(json.dumps(state, indent=2))
        for path in (p for p in temp.iterdir() if p.is_file()):  # durable before the rename shows it
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temp, final)
        prune_checkpoints(output_dir, save_total_limit, keep=final)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(output_dir: Path, limit: int | None, keep: Path) -> None:
    """Keep the newest `limit` complete checkpoints; never the one just written."""
    if not limit:
        return
    complete = complete_checkpoints(output_dir)
    for old in complete[:-limit]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
