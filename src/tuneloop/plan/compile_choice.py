"""`torch_compile: auto`: compile where the run is long enough to repay compiling, judged from what this machine
measured for this model.

Compiling costs the first step (on the embedded SmolLM2-135M on 2 Zen 4 cores: 71 s cold for the whole decoder as
one graph, 12 s with torch's compile caches warm, 15–18 s cold with packed attention's graph break per layer,
against 5 s for an eager first step) and then runs each step faster (1.10–1.14× there). Whether a run repays it
depends on the model, the machine and the run's length, so every finished run of three steps or more records its
first step's seconds and its steady seconds per real token, compiled or eager, under a key of what the compiled
graph depends on (`shape_key`), in `compile_records.json` of tuneloop's cache (the last KEPT_RUNS of each). The
plan then decides:

- both measured: compile where the steps after the first would save more time than compiling adds to the first;
- not both: compile only where the run is predicted to take over UNMEASURED_RUN_SECONDS eager on this kind of
  device (a cold compile is then a small share of it), from the eager record or else from the model's FLOPs at
  ASSUMED_MFU of the peak; the run's own record then decides the next plan.

The decision and its numbers are a line of the plan; `torch_compile: true` or `false` decides without asking.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from tuneloop.cache import cache_root

RECORDS = "compile_records.json"
# How long an unmeasured run must be predicted to take eager before compiling it. On a CPU compiling is slow and
# gains little (above: 10-13 s more for the first step, warm, to run 1.10-1.14x); on a GPU it is quick and gains much
# (an H200, a ~1B LLaMA on packed 8x2048 rows: a cold compile added 17.6 s to the first step, then the steps ran
# 1.37x the eager pace for a full fine-tune and 1.69x for LoRA; at three times that compile and half that gain a
# ten-minute run still repays it).
UNMEASURED_RUN_SECONDS = {"cpu": 1800.0, "cuda": 600.0}
ASSUMED_MFU = 0.45  # the quickstart's eager MFU on Zen 4 was 45–48%; on slower-than-peak machines the run is longer,
# so the estimate errs towards not compiling
MIN_RECORDED_STEPS = 3  # a shorter run has no steady steps to speak of
KEPT_RUNS = 3  # the pace is the median of the last few runs (one short run's pace drifts by ~10%); the first
# step is the latest run's (it depends on what the compile caches hold now)


def records_path() -> Path:
    """``$TUNELOOP_COMPILE_RECORDS``, else compile_records.json in tuneloop's cache (the tests point it elsewhere,
    so the suite never depends on what this machine ran before)."""
    configured = os.environ.get("TUNELOOP_COMPILE_RECORDS")
    return Path(configured) if configured else cache_root() / RECORDS


def shape_key(cfg, resolved, model_config, world_size: int) -> str:
    """What a compiled step's graph and speed depend on: the model's shape, what is trained, precision, attention,
    checkpointing, the micro-batch's shape and batching, the engine and ranks, the device and torch."""
    import torch

    from tuneloop.plan.flops import _cpu_name

    shape = {name: getattr(model_config, name, None) for name in (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "tie_word_embeddings")}
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else f"{_cpu_name()}, {torch.get_num_threads()} threads")
    parts = {"shape": shape, "adapter": cfg.adapter, "lora_r": cfg.lora_r if cfg.adapter else None,
             "trained": [cfg.lora_target_modules, cfg.lora_target_linear, cfg.unfrozen_parameters],
             "batch": [cfg.micro_batch_size, cfg.sequence_len, resolved.batching], "engine": resolved.engine.name,
             "precision": resolved.precision.name if resolved.precision else None,
             "attention": resolved.attention.used, "checkpointing": bool(resolved.gradient_checkpointing),
             "chunked_loss": cfg.chunked_cross_entropy, "mode": cfg.torch_compile_mode,
             "backend": cfg.torch_compile_backend, "world_size": world_size, "device": device,
             "torch": torch.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_records() -> dict:
    """The records, or {} where the file is missing, unreadable or not what record_run writes."""
    try:
        records = json.loads(records_path().read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def record_run(key: str | None, compiled: bool, outcome, resumed: bool) -> None:
    """After a finished run (main process): its first step and its steady pace (the training steps after the
    first, without the evals and checkpoints between them), for the next plan's decision. Not a resumed session
    (its first step reloads, its steps are fewer than the run's) nor one of fewer than MIN_RECORDED_STEPS."""
    from tuneloop.run_files import write_json

    first = outcome.first_step_seconds
    steady_seconds = outcome.training_seconds - (first or 0)
    steady_tokens = outcome.real_tokens - outcome.first_step_real_tokens
    if not key or resumed or not first or outcome.steps < MIN_RECORDED_STEPS or steady_seconds <= 0 \
            or steady_tokens <= 0:
        return
    path = records_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs ending together: one read-modify-write after the other
            records = read_records()
            runs = records.setdefault(key, {}).get("compiled" if compiled else "eager")
            runs = (runs if isinstance(runs, list) else []) + [{
                "first_step_seconds": first, "seconds_per_real_token": steady_seconds / steady_tokens,
                "recorded": time.strftime("%Y-%m-%d %H:%M:%S")}]
            records[key]["compiled" if compiled else "eager"] = runs[-KEPT_RUNS:]
            write_json(path, records, recorded=False)
    except (OSError, AttributeError, TypeError):
        pass  # a cache that cannot be written (or holds something else) only leaves the next plan unmeasured


def _measured(runs) -> dict | None:
    if not isinstance(runs, list):
        return None
    runs = [run for run in runs if isinstance(run, dict) and isinstance(run.get("seconds_per_real_token"), float)
            and isinstance(run.get("first_step_seconds"), (int, float)) and run["seconds_per_real_token"] > 0]
    if not runs:
        return None
    paces = sorted(run["seconds_per_real_token"] for run in runs)
    return {"first_step_seconds": runs[-1]["first_step_seconds"], "seconds_per_real_token": paces[len(paces) // 2]}


def decide(records: dict, key: str, real_tokens: int, flops_per_token: float | None,
           peak_flops: float | None, device: str = "cpu") -> tuple[bool, str]:
    """(compile?, why in words) for `torch_compile: auto`, over a run of `real_tokens` real tokens on `device`
    ("cpu" or "cuda")."""
    measured = records.get(key)
    measured = measured if isinstance(measured, dict) else {}
    eager, compiled = _measured(measured.get("eager")), _measured(measured.get("compiled"))
    if eager and compiled:
        extra = max(0.0, compiled["first_step_seconds"] - eager["first_step_seconds"])
        saved = real_tokens * (eager["seconds_per_real_token"] - compiled["seconds_per_real_token"])
        speedup = eager["seconds_per_real_token"] / compiled["seconds_per_real_token"]
        words = (f"measured here for this model: compiling adds {extra:.0f} s to the first step, then the steps run "
                 f"{speedup:.2f}× the eager pace; over this run's {real_tokens:,} real tokens that saves ~{saved:.0f} s")
        return saved > extra, words
    if eager:
        seconds, source = real_tokens * eager["seconds_per_real_token"], "at the eager pace measured here"
    elif flops_per_token and peak_flops:
        seconds, source = real_tokens * flops_per_token / (peak_flops * ASSUMED_MFU), \
            f"at {ASSUMED_MFU:.0%} of the peak"
    else:
        return False, "not measured here for this model, and the run's length cannot be estimated"
    threshold = UNMEASURED_RUN_SECONDS[device]
    long_enough = seconds > threshold
    where = "on a GPU" if device == "cuda" else "on a CPU"
    return long_enough, (f"not measured both ways here for this model yet; the run should take ~{seconds / 60:.0f} "
                         f"min eager ({source}): " + (
                             f"over {threshold / 60:.0f} min {where}, long enough that compiling the first step is "
                             "a small share (the run measures it for the next plan)" if long_enough else
                             f"under {threshold / 60:.0f} min {where}, too short to risk a cold compile "
                             "(`torch_compile: true` once measures it)"))
