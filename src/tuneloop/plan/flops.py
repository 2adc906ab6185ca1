"""Model FLOPs utilisation (MFU): the share of the machine's peak that the run turns into the model's work.

Model FLOPs per real token, counted from the model as it is built (model.py's meta-device copy, adapter included;
model.count_matmul_weights):

- each weight matrix a token passes through costs 2 FLOPs per weight in the forward, 2 in the backward for the
  gradient of its input, and 2 more for the gradient of the weight when it is trained: 6 per weight in a full
  fine-tune, 4 per frozen weight under LoRA;
- attention's two products (scores, weighted values) cost 4 FLOPs per layer, attention width and position
  attended to in the forward, three times that with the backward. A causal token attends to itself and the
  tokens before it in its own sequence (packing keeps sequences apart), so averaged over the data's tokens it
  attends to Σ len·(len+1)/2 / Σ len positions: the count the data needs, not the padded width;
- recomputation (gradient checkpointing) is not counted: MFU counts the model's work, not what the hardware redid;
- the output head is counted for the positions it meets: under the chunked loss only those with a target
  (train/chunked_loss.py), every position otherwise.

The peak: the vendor's dense bf16/fp16 tensor-core figure for GPUs this table knows, one per rank; otherwise,
and on every CPU, the best of a few square matmuls at the run's precision on this machine. On a CPU the ranks
of a host share its cores, so the host is the device, and the probe runs on as many threads as the run uses
there (each rank's threads × the ranks on the host, at most the host's cores): the peak of what the run was
given. Measured once per device, thread count, precision and torch version, and cached. `peak_tflops` (per
GPU, or per host's CPU) overrides both.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from tuneloop.cache import cache_root

# dense (not sparse) bf16/fp16 tensor-core TFLOPS from the vendors' data sheets; the first name found in the
# device's name wins (so "H100 PCIe" is looked up before "H100")
GPU_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                   ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]
PROBE_SIZE = {"cpu": 2048, "cuda": 8192}  # long enough to reach the matmul's speed, short enough to run in ~1 s
PROBE_REPEATS = 10
PROBE_PRODUCT_SECONDS = 0.2  # the longest one CPU probe product may take (a slow dtype is probed smaller)
PEAK_CACHE = "peak_flops.json"


@dataclass
class FlopsCount:
    per_token: float | None  # model FLOPs per real token of a training step (None: not counted, see why)
    why_not: str | None = None
    attention_context: float = 0.0  # positions a token attends to, on average over the data


def attention_context(lengths: np.ndarray) -> float:
    """Positions a token attends to, averaged over the tokens of rows of these lengths (causal, per sequence)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return float((lengths * (lengths + 1) / 2).sum() / lengths.sum()) if lengths.size and lengths.sum() else 0.0


def count_flops(config, frozen: int, trained: int, lengths: np.ndarray, head_skipped: float = 0.0) -> FlopsCount:
    """`head_skipped`: FLOPs per real token the output head does not do, where the chunked loss multiplies only
    the positions with a target by it (head_flops_skipped)."""
    if getattr(config, "is_encoder_decoder", False):
        return FlopsCount(None, "not counted for encoder-decoder models (their tokens meet different weights)")
    experts = max(getattr(config, name, None) or 0 for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts > 1:
        return FlopsCount(None, "not counted for mixture-of-experts models (a token meets only some experts)")
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not (layers and heads and width):
        return FlopsCount(None, "not counted: the model's config names no layers, heads or hidden size")
    head_dim = getattr(config, "head_dim", None) or width // heads
    context = attention_context(lengths)
    weights = 4 * frozen + 6 * trained - head_skipped
    attention = 3 * 4 * layers * heads * head_dim * context
    return FlopsCount(float(weights + attention), None, round(context, 1))


def head_flops_skipped(head_weights: tuple[int, bool], real_tokens: int | None, target_tokens: int | None) -> float:
    """Per real token: the head's FLOPs (6 per weight trained, 4 frozen) for the share of positions without a
    target, which the chunked loss never multiplies by it."""
    weights, head_trained = head_weights
    if not weights or not real_tokens or target_tokens is None:
        return 0.0
    return (6 if head_trained else 4) * weights * max(0.0, 1 - target_tokens / real_tokens)


@dataclass
class Peak:
    flops: float | None  # the run's peak per second: every GPU's, or every host's CPU
    source: str  # where the figure comes from, in words


def gpu_table_peak(name: str) -> float | None:
    for known, tflops in GPU_PEAK_TFLOPS:
        if known.lower() in name.lower():
            return tflops * 1e12
    return None


def run_peak(precision: str, peak_tflops: float | None, world_size: int, ranks_per_host: int) -> Peak:
    """The peak of the devices the run trains on, at its precision ("no", "bf16", "fp16"). A GPU is a device
    per rank; on CPUs the ranks of a host share its cores, so a host is the device (see the module's text)."""
    import torch

    cuda = torch.cuda.is_available()
    devices = world_size if cuda else max(1, world_size // max(1, ranks_per_host))
    unit = "GPU" if cuda else "CPU"
    times = f"{devices} × " if devices > 1 else ""
    if peak_tflops:
        return Peak(peak_tflops * 1e12 * devices, f"{times}{peak_tflops:g} TFLOPS per {unit} (peak_tflops)")
    dtype = {"no": "fp32"}.get(precision, precision)
    if cuda:
        name = torch.cuda.get_device_name(0)
        table = gpu_table_peak(name) if precision in ("bf16", "fp16") else None
        if table:
            return Peak(table * devices, f"{times}{table / 1e12:g} TFLOPS ({name}, dense {dtype}, data sheet)")
    threads = min(_cores(), torch.get_num_threads() * max(1, ranks_per_host))
    flops, where = measured_peak(precision, threads)
    article = "an" if dtype.startswith("f") else "a"  # (an fp32, a bf16)
    return Peak(flops * devices, f"{times}{flops / 1e9:,.0f} GFLOPS ({article} {dtype} matmul measured on {where})")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def measured_peak(precision: str, threads: int = 1) -> tuple[float, str]:
    """The best of PROBE_REPEATS square matmuls at the precision's dtype: on the GPU, or on `threads` threads
    of this CPU whatever this process's own thread count. Measured once and cached; ranks starting together
    take turns (a lock), so each reads the figure the first one wrote."""
    import fcntl

    import torch

    cuda = torch.cuda.is_available()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    where = torch.cuda.get_device_name(0) if cuda else f"{_cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"
    key = f"{where} | {str(dtype).removeprefix('torch.')} | torch {torch.__version__}"
    cache = cache_root() / PEAK_CACHE
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_suffix(".lock"), "a")
    except OSError:  # a read-only home: measure, and measure again next time
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read_cache(cache)
        if key not in known:
            known[key] = _probe("cuda" if cuda else "cpu", dtype, threads)
            if lock is not None:
                _write_cache(cache, known)
        return float(known[key]), where
    finally:
        if lock is not None:
            lock.close()  # (releases the lock)


def _probe(device: str, dtype, threads: int) -> float:
    import torch

    size = PROBE_SIZE[device]
    own = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)  # the cores the whole run uses on this host, not this rank's share
    try:
        if device == "cpu":  # a dtype this CPU has no fast kernel for (bf16 without AVX512-BF16/AMX: ~2 GFLOPS, 95 s
            size = min(size, _affordable_size(dtype))  # for one 2048² product) is measured on smaller squares
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best = float("inf")
        for _ in range(PROBE_REPEATS + 1):  # the first is a warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(own)
    return 2 * size**3 / best


# below this rate at 256² a dtype has no fast kernel here (emulated bf16 on an AVX2 CPU: ~2 GFLOPS); above it the
# probe keeps its full size, whose 2048² product a fast kernel finishes in well under a second
SLOW_DTYPE_FLOPS = 10e9


def _affordable_size(dtype, seconds: float = PROBE_PRODUCT_SECONDS, small: int = 256) -> int:
    """The side of a square product that takes about `seconds` here, from one timed product of side `small`; the
    full probe size where the dtype is not clearly slow (a small product underrates a fast kernel's rate)."""
    import torch

    a, b = torch.randn(small, small).to(dtype), torch.randn(small, small).to(dtype)
    torch.mm(a, b)
    start = time.perf_counter()
    torch.mm(a, b)
    rate = 2 * small**3 / max(time.perf_counter() - start, 1e-9)
    if rate >= SLOW_DTYPE_FLOPS:
        return PROBE_SIZE["cpu"]
    return max(small, int((rate * seconds / 2) ** (1 / 3)))


def _read_cache(cache) -> dict:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache, known: dict) -> None:
    """Replaced whole (a reader never sees half a file)."""
    import tempfile

    try:
        handle, temp = tempfile.mkstemp(dir=cache.parent, prefix=".peak-")
        with os.fdopen(handle, "w") as out:
            json.dump(known, out, indent=1)
        os.replace(temp, cache)
    except OSError:
        pass


def mfu(real_tokens_per_second: float | None, per_token: float | None, peak: float | None) -> float | None:
    """The share of the run's peak (every device's) that its real tokens per second (every rank's) make."""
    if not (real_tokens_per_second and per_token and peak):
        return None
    return real_tokens_per_second * per_token / peak
