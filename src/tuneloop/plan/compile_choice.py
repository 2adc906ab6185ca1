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
- not both: compile only where the run is predicted to take over UNMEASURED_RUN_SECONDS eager (a cold compile is
  then a small share of it), from the eager record or else from the model's FLOPs at ASSUMED_MFU of the peak; the
  run's own record then decides the next plan.

The decision and its numbers are a line of the plan; `torch_compile: true` or `false` decides without asking.
"""

from __future__ import annotations

import hashlib
import json
import time

from tuneloop.cache import cache_root

RECORDS = "compile_records.json"
UNMEASURED_RUN_SECONDS = 1800.0
ASSUMED_MFU = 0.45  # the quickstart's eager MFU on Zen 4 was 45–48%; on slower-than-peak machines the run is longer,
# so the estimate errs towards not compiling
MIN_RECORDED_STEPS = 3  # a shorter run has no steady steps to speak of
KEPT_RUNS = 3  # the pace is the median of the last few runs (one short run's pace drifts by ~10%); the first
# step is the latest run's (it depends on what the compile caches hold now)


def shape_key(cfg, resolved, model_config, world_size: int) -> str:
    """What a compiled step's graph and speed depend on: the model's shape, what is trained, precision, attention,
    checkpointing, the ranks, the device and torch."""
    import torch

    from tuneloop.plan.flops import _cpu_name

    shape = {name: getattr(model_config, name, None) for name in (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "tie_word_embeddings")}
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else f"{_cpu_name()}, {torch.get_num_threads()} threads")
    parts = {"shape": shape, "adapter": cfg.adapter, "lora_r": cfg.lora_r if cfg.adapter else None,
             "precision": resolved.precision.name if resolved.precision else None,
             "attention": resolved.attention.used, "checkpointing": bool(cfg.gradient_checkpointing),
             "chunked_loss": cfg.chunked_cross_entropy, "mode": cfg.torch_compile_mode,
             "backend": cfg.torch_compile_backend, "world_size": world_size, "device": device,
             "torch": torch.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_records() -> dict:
    try:
        return json.loads((cache_root() / RECORDS).read_text())
    except (OSError, ValueError):
        return {}


def record_run(key: str | None, compiled: bool, summary: dict) -> None:
    """After a finished run (main process): its first step and steady pace, for the next plan's decision."""
    from tuneloop.run_files import write_json

    rate = summary.get("real_tokens_per_second_after_first_step")
    if not key or not rate or (summary.get("steps") or 0) < MIN_RECORDED_STEPS or not summary.get(
            "first_step_seconds"):
        return
    records = read_records()
    kind = records.setdefault(key, {}).setdefault("compiled" if compiled else "eager", [])
    kind.append({"first_step_seconds": summary["first_step_seconds"], "seconds_per_real_token": 1.0 / rate,
                 "recorded": time.strftime("%Y-%m-%d %H:%M:%S")})
    del kind[:-KEPT_RUNS]
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        write_json(cache_root() / RECORDS, records)
    except OSError:
        pass  # a cache that cannot be written only leaves the next plan without the measurement


def _measured(runs: list | None) -> dict | None:
    if not runs or not isinstance(runs, list):
        return None
    paces = sorted(run["seconds_per_real_token"] for run in runs)
    return {"first_step_seconds": runs[-1]["first_step_seconds"], "seconds_per_real_token": paces[len(paces) // 2]}


def decide(records: dict, key: str, real_tokens: int, flops_per_token: float | None,
           peak_flops: float | None) -> tuple[bool, str]:
    """(compile?, why in words) for `torch_compile: auto`, over a run of `real_tokens` real tokens."""
    measured = records.get(key, {})
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
    long_enough = seconds > UNMEASURED_RUN_SECONDS
    return long_enough, (f"not measured compiled here for this model yet; the run should take ~{seconds / 60:.0f} "
                         f"min eager ({source}): " + (
                             "long enough that compiling the first step is a small share (the run measures it for "
                             "the next plan)" if long_enough else
                             f"under {UNMEASURED_RUN_SECONDS / 60:.0f} min, too short to risk a cold compile "
                             "(`torch_compile: true` once measures it)"))
