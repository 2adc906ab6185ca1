"""The memory a training process holds before any model or data: its libraries. The plan counts it on a CPU.

On a GPU the device's memory holds the run alone; on a CPU the device is the host's memory, and every rank's process
holds torch, transformers, accelerate and tuneloop's own modules there before it loads anything: 0.4–0.5 GB on this
project's machine, about an eighth of the quickstart's peak, which the estimate left out. It is measured once per
host, Python, library versions and allocator, in a fresh interpreter that imports what every run imports, and cached
(as the peak FLOPS are, plan/flops.py), so `tuneloop plan` and the run it plans say the same figure. Ranks starting
together take turns (a lock): the first measures, the others read its figure.

The second figure is what the CPU's matmul kernel caches hold when full (host/kernel_caches.py), which a run in bf16 on
a CPU reaches wherever its shapes vary (~0.08 GB at tuneloop's capacities on this project's machine; 0.63 GB at the
libraries' defaults): measured the same way, once per host and capacities.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

from tuneloop.cache import cache_root

CACHE = "process_memory.json"
CACHE_ENV = "TUNELOOP_PROCESS_MEMORY"  # another file for the figures
# what every run imports before its model (the model's own module is counted with the model)
# (its own peak, VmHWM: ru_maxrss would not do, since Linux carries the parent's peak over fork and exec into it)
PROBE = ("import tuneloop.run, tuneloop.train.loop, transformers.modeling_utils, accelerate; "
         "print(next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmHWM')))")
# the caches' growth over new shapes of a bf16 matmul (the first product, before the count starts, loads the kernels'
# own libraries)
KERNEL_CACHES_PROBE = (
    "import re, torch\n"
    "resident = lambda: int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
    "weight = torch.randn(64, 64, dtype=torch.bfloat16)\n"
    "torch.randn(8, 64, dtype=torch.bfloat16) @ weight\n"
    "before = resident()\n"
    "for rows in range(65, 65 + SHAPES):\n"
    "    torch.randn(rows, 64, dtype=torch.bfloat16) @ weight\n"
    "print(max(0, resident() - before))")
MAX_PROBED_SHAPES = 4096  # ~2 ms a new shape: a few seconds at most, once per host
PROBE_TIMEOUT = 120


def process_memory_bytes() -> int:
    """This host's figure (0 where it cannot be measured: the estimate then leaves it out, as before)."""
    import torch
    import transformers

    key = f"{sys.version.split()[0]} | torch {torch.__version__} | transformers {transformers.__version__}"
    return _cached(key, PROBE)


def kernel_caches_bytes() -> int:
    """What the CPU's matmul kernel caches hold when full (host/kernel_caches.py), on this host at its capacities:
    counted where a run's matmuls are 16-bit on a CPU. Measured as the growth of a fresh interpreter over more new bf16
    matmul shapes than the caches keep (tiny ones: an entry costs the same whatever the matmul's size)."""
    import torch

    from tuneloop.host.kernel_caches import capacities

    sizes = capacities()
    shapes = min(2 * max(sizes.values()), MAX_PROBED_SHAPES)
    key = f"matmul kernel caches {sizes} | torch {torch.__version__}"
    return _cached(key, KERNEL_CACHES_PROBE.replace("SHAPES", str(shapes)))


def _cached(key: str, probe: str) -> int:
    """The probe's figure, measured once per host, Python, library versions and allocator (0: not measurable)."""
    if not Path("/proc/self/status").is_file():  # (Linux's own figures: elsewhere the estimate leaves it out)
        return 0
    allocator = "mimalloc" if "mimalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"
    key = f"{key} | {allocator}"
    cache = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else cache_root() / CACHE
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_name(cache.name + ".lock"), "a")
    except OSError:  # a read-only home: measured each time
        return _measured(probe)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(cache)
        if isinstance(known.get(key), int):
            return known[key]
        figure = _measured(probe)
        if figure:
            from tuneloop.run_files import write_json

            try:
                write_json(cache, {**known, key: figure}, recorded=False)
            except OSError:
                pass
        return figure


def _measured(probe: str) -> int:
    try:
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        return int(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else 0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def _read(cache: Path) -> dict:
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
