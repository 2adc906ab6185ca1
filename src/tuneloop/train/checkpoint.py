"""Checkpoints written atomically, and resumed exactly.

A checkpoint folder `checkpoint-STEP` holds the model (or adapter) weights as safetensors,
the optimizer and scheduler state, every RNG state, a copy of metrics.jsonl up to STEP, and
`tuneloop_state.json`, written last: it is the completeness marker. Everything is written
into a hidden temporary folder that is renamed into place only when complete, so a kill at
any moment leaves either the whole checkpoint or none. A folder without the marker is never
a checkpoint.

The sampler is deterministic (seed, epoch), so the position in the data is just the step
number: resuming skips to the exact micro-batch without reading or collating what was seen.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import torch

from tuneloop import run_files
from tuneloop.data.stream_steps import STREAM_POSITION
from tuneloop.engines.base import SHARDS
from tuneloop.errors import CheckpointFailed, UserError
from tuneloop.run_files import complete_checkpoints
from tuneloop.train.model_folder import config_says_dtype_of
from tuneloop.train.state import restore_rng_states, rng_states

# plan keys that must match for a checkpoint to continue the same run
# (the mesh: a checkpoint of another layout of the N-D keys is named with both; FSDP2's DCP shards reshard onto the
# new one under --force-resume)
COMPATIBLE_PLAN_KEYS = ("world_size", "mesh", "batching", "train_rows", "train_tokens", "steps_per_epoch")
# what checkpoints written before the settings were recorded are compared on instead
OLDER_PLAN_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "sequence_len")
# Test hook: kill this process (SIGKILL) half-way through writing the checkpoint of that step,
# so the kill test can prove a torn save is never resumed from.
CRASH_DURING_SAVE_ENV = "TUNELOOP_TEST_CRASH_DURING_SAVE"
FULL_DISK_BYTES = 1 << 20


def write_rank_rng(output_dir: Path, step: int, rank: int, stream_position=None) -> None:
    """Every rank, before the main process writes the checkpoint: ranks draw different amounts of
    randomness (dropout on different shapes), so each resumes from its own RNG state; in a streamed run, each
    also reads its own share of the data, so its StreamPosition is kept beside its RNG state."""
    states = rng_states()
    if stream_position is not None:
        states[STREAM_POSITION] = stream_position.to_json()
    torch.save(states, run_files.pending_rank_rng(output_dir, step, rank))


def write_on_every_rank(accelerator, output_dir: Path, what: str, on_main, on_every_rank=None,
                        clean_up=None) -> None:
    """Every rank runs `on_every_rank()` (its own RNG file, say), then the main process `on_main()`.
    A failure on any rank (a full disk) becomes the same CheckpointFailed on every rank, so a
    multi-rank run stops together with one message, instead of the other ranks crashing in (or,
    while the failed rank lives, waiting at) the next collective. `clean_up()` runs on failure."""
    failure = _attempt(on_every_rank, output_dir, what) if on_every_rank else None
    failures = _gathered(accelerator, failure)
    if not any(failures):
        failure = _attempt(on_main, output_dir, what) if accelerator.is_main_process else None
        failures = [_from_main(accelerator, failure)]
    message = next((f for f in failures if f), None)
    if message:
        if clean_up and accelerator.is_main_process:
            clean_up()
        raise CheckpointFailed(message)


def remove_pending(output_dir: Path, step: int, world_size: int) -> None:
    """The RNG files and engine shards of a checkpoint that never came."""
    for rank in range(world_size):
        run_files.pending_rank_rng(output_dir, step, rank).unlink(missing_ok=True)
    shutil.rmtree(run_files.pending_shards(output_dir, step), ignore_errors=True)


def _attempt(action, output_dir: Path, what: str) -> str | None:
    """None when `action()` worked, else the user's message (the half-written folder is gone by then)."""
    try:
        action()
        return None
    except Exception as error:  # torch.save and safetensors report a full disk as RuntimeError and friends
        try:  # looking at the disk can fail too (EIO, a vanished mount): this rank must still answer
            full = _looks_like_full_disk(error, output_dir)
            kept = complete_checkpoints(output_dir)
            newest = kept[-1].name if kept else "none"
        except OSError:
            full, newest = False, "unknown (the output folder cannot be read)"
        reason = "the disk is full" if full else f"{type(error).__name__}: {error}"
        then = ("run again" if newest == "none" else
                "resume (auto_resume_from_checkpoints: true)")
        return (f"checkpoint: could not save {what} to {output_dir}: {reason}. Nothing was overwritten; "
                f"the newest complete checkpoint is {newest}. Free space and {then}.")


def _gathered(accelerator, value) -> list:
    """Every rank's value, on every rank (a collective)."""
    if accelerator.num_processes == 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def _from_main(accelerator, value):
    """The main process's value, on every rank (a collective)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def write_checkpoint(output_dir: Path, step: int, state: dict, model, optimizer_state: dict | None, scheduler,
                     world_size: int = 1, model_state: dict | None = None, weights: bool = True,
                     tokenizer=None) -> Path:
    """Main process only, after every rank ran write_rank_rng (and wrote its engine shards, which this moves in: see
    write_on_every_rank). A failure removes the temporary folder and re-raises: the old checkpoints are never
    touched. `optimizer_state` None: it is in the shards. `model_state`: the weights gathered from a sharded model;
    `weights` False: the checkpoint's weights are only in its shards. `tokenizer`: saved beside the weights, so that
    a checkpoint is a model folder `from_pretrained` and `tuneloop infer --model` take as it is."""
    final = run_files.checkpoint_dir(output_dir, step)
    temp = run_files.temp_checkpoint_dir(output_dir, step)
    shutil.rmtree(temp, ignore_errors=True)
    try:
        temp.mkdir(parents=True)
        if weights:
            model.save_pretrained(temp, safe_serialization=True, state_dict=model_state)
            if model_state:  # (fp32 masters of a model that computes in bf16: config.json says fp32)
                config_says_dtype_of(temp, model_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(temp)
        shards = run_files.pending_shards(output_dir, step)
        if shards.is_dir():
            os.replace(shards, temp / SHARDS)
        if os.environ.get(CRASH_DURING_SAVE_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        training_state = {"scheduler": scheduler.state_dict(), "rng": rng_states()}
        if optimizer_state is not None:
            training_state["optimizer"] = optimizer_state
        torch.save(training_state, temp / run_files.TRAINING_STATE)
        for rank in range(world_size):
            os.replace(run_files.pending_rank_rng(output_dir, step, rank), temp / run_files.RANK_RNG.format(rank=rank))
        metrics = output_dir / run_files.METRICS
        if metrics.is_file():
            shutil.copyfile(metrics, temp / run_files.METRICS)
        (temp / run_files.STATE).write_text(json.dumps(state, indent=2))
        run_files.make_readable(temp)
        run_files.fsync_files(temp)
        if final.exists():  # a stale folder of the same step without the marker (a torn earlier run)
            shutil.rmtree(final)
        run_files.record(output_dir, final.name)
        os.replace(temp, final)
        run_files.fsync_folder_entry(output_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def _looks_like_full_disk(error: Exception, folder: Path) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    if "No space left" in str(error):
        return True
    return shutil.disk_usage(folder).free < FULL_DISK_BYTES  # torch.save only says "unexpected pos"


def prune_checkpoints(output_dir: Path, limit: int | None, keep: Path, protect: Path | None = None) -> None:
    """Keep the newest `limit` complete checkpoints; never the one just written, nor `protect` (the best eval's,
    under save_strategy: best: the Trainer keeps it too, one over the limit if need be)."""
    if not limit:
        return
    for old in complete_checkpoints(output_dir)[:-limit]:
        if old not in (keep, protect):
            shutil.rmtree(old, ignore_errors=True)


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint that has its completeness marker, or None. Cheap: it reads the safetensors
    headers and the zip directories of the torch files (both sit at the ends a truncation cuts), not the tensors.
    A torn save never has a marker; this catches files damaged after the save (a disk fault, a bad copy)."""
    import zipfile

    from safetensors import safe_open

    try:
        json.loads((checkpoint / run_files.STATE).read_text())
    except (OSError, ValueError) as error:
        return f"{run_files.STATE} cannot be read ({error})"
    for weights in sorted(checkpoint.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except Exception as error:  # safetensors raises its own SafetensorError
            return f"{weights.name} is damaged ({error})"
    for state in [checkpoint / run_files.TRAINING_STATE, *sorted(checkpoint.glob("rng_state_*.pt"))]:
        try:
            zipfile.ZipFile(state).close()
        except (OSError, zipfile.BadZipFile) as error:
            return f"{state.name} is damaged ({error})"
    return None


def read_state(checkpoint: Path) -> dict:
    if not (checkpoint / run_files.STATE).is_file():
        raise UserError(f"checkpoint: {checkpoint} is not a complete tuneloop checkpoint (no {run_files.STATE})")
    try:
        state = json.loads((checkpoint / run_files.STATE).read_text())
    except (OSError, ValueError) as error:
        state, why = None, str(error)
    else:
        why = "it does not hold a checkpoint's step and plan"
    if not isinstance(state, dict) or not isinstance(state.get("plan"), dict) or "step" not in state:
        raise UserError(f"checkpoint: {checkpoint / run_files.STATE} is damaged ({why}); point "
                        "resume_from_checkpoint at another checkpoint, or start a fresh output_dir")
    return state


def incompatibilities(state: dict, plan: dict, identity: dict) -> list[str]:
    """What differs between a checkpoint's run and this one, in words: the prepared data, every setting that
    changes what is trained (config.result_settings; the run's length is resume.py's to judge), and the plan's
    batching over the data."""
    from tuneloop.config.schema import RUN_LENGTH_KEYS, changed_settings

    changed = []
    if state.get("data_key") != identity["data_key"]:
        changed.append("the prepared data (data files, tokenizer or data settings)")
    plan_keys = COMPATIBLE_PLAN_KEYS
    if "settings" in state:
        changed += changed_settings(state["settings"], identity["settings"], ignore=RUN_LENGTH_KEYS)
    else:
        settings = identity["settings"]
        for key in ("base_model", "adapter"):
            if state.get(key) != settings.get(key):
                changed.append(f"{key} ({state.get(key)} → {settings.get(key)})")
        plan_keys += OLDER_PLAN_KEYS
    for key in plan_keys:
        if state["plan"].get(key) != plan.get(key):
            changed.append(f"{key} ({state['plan'].get(key)} → {plan.get(key)})")
    return changed


def _engine_words(identity: dict) -> str:
    if identity["name"] == "deepspeed":
        return f"DeepSpeed ZeRO-{identity['zero_stage']}"
    return {"ddp": "DDP (or one process)", "fsdp2": "FSDP2"}.get(identity["name"], identity["name"])


def load_training_state(checkpoint: Path, engine, scheduler, rank: int = 0) -> None:
    """The optimizer (from the training state, or the engine's shards), the scheduler and this rank's RNG."""
    saved = torch.load(checkpoint / run_files.TRAINING_STATE, weights_only=False)
    if engine.writes_shards:
        if not (checkpoint / SHARDS).is_dir():
            raise UserError(f"checkpoint: {checkpoint} has no {SHARDS}/ folder; it was written without "
                            f"{engine.name}, and resuming needs the same engine")
        engine.load_shards(checkpoint / SHARDS)
    else:
        if "optimizer" not in saved:
            raise UserError(f"checkpoint: {checkpoint} keeps its optimizer state in engine shards; resume it with the "
                            "fsdp/deepspeed settings it was written with")
        engine.load_optimizer_state(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    own = checkpoint / run_files.RANK_RNG.format(rank=rank)
    restore_rng_states(torch.load(own, weights_only=False) if own.is_file() else saved["rng"])


def check_engine_can_resume(checkpoint: Path, engine) -> None:
    """Before the engine is built: the checkpoint was written by this engine (and ZeRO stage), and on this number of
    ranks unless the engine can redistribute its shards."""
    marker = read_state(checkpoint)
    written_with = marker.get("engine", {"name": "ddp", "zero_stage": None})
    if written_with != engine.identity():
        raise UserError(f"resume: {checkpoint} was written by {_engine_words(written_with)} and this run uses "
                        f"{_engine_words(engine.identity())}; its weights and optimizer state are laid out for the "
                        "former. Restore that engine's settings, or start a fresh output_dir.")
    written_by = marker["plan"]["world_size"]
    if engine.writes_shards and written_by != engine.plan.world_size and not engine.reshards:
        # (a different world size got this far only with --force-resume)
        raise UserError(f"resume: {checkpoint} was written by {written_by} ranks and this run has "
                        f"{engine.plan.world_size}; {engine.name}'s ZeRO partitions cannot be redistributed over "
                        f"another number of ranks. Launch {written_by} ranks, or start a fresh output_dir.")
