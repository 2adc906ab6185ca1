"""The memory a training process holds before any model or data: its libraries. The plan counts it on a CPU.

On a GPU the device's memory holds the run alone; on a CPU the device is the host's memory, and every rank's process
holds torch, transformers, accelerate and tuneloop's own modules there before it loads anything: 0.4–0.5 GB on this
project's machine, about an eighth of the quickstart's peak, which the estimate left out. It is measured once per
host, Python, library versions and allocator, in a fresh interpreter that imports what every run imports, and cached
(as the peak FLOPS are, plan/flops.py), so `tuneloop plan` and the run it plans say the same figure. Ranks starting
together take turns (a lock): the first measures, the others read its figure.
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
PROBE_TIMEOUT = 120


def process_memory_bytes() -> int:
    """This host's figure (0 where it cannot be measured: the estimate then leaves it out, as before)."""
    import torch
    import transformers

    if not Path("/proc/self/status").is_file():  # (Linux's own peak: elsewhere the estimate leaves it out)
        return 0

    allocator = "mimalloc" if "mimalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"
    key = (f"{sys.version.split()[0]} | torch {torch.__version__} | transformers {transformers.__version__} | "
           f"{allocator}")
    cache = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else cache_root() / CACHE
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_name(cache.name + ".lock"), "a")
    except OSError:  # a read-only home: measured each time
        return _measured()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(cache)
        if isinstance(known.get(key), int):
            return known[key]
        figure = _measured()
        if figure:
            from tuneloop.run_files import write_json

            try:
                write_json(cache, {**known, key: figure}, recorded=False)
            except OSError:
                pass
        return figure


def _measured() -> int:
    try:
        probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
        return int(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else 0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def _read(cache: Path) -> dict:
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
