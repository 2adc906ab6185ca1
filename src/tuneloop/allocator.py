"""The host allocator, tuned for training: glibc malloc with mmap and trimming off, in every tuneloop process.

A training step allocates and frees the same large tensors over and over (activations, gradients, the optimizer's
temporaries). glibc serves each allocation above its mmap threshold (dynamically 128 KiB to 32 MiB) with a fresh
mmap and gives it back on free, and trims the heap's top whenever more than its trim threshold is free: every step
then faults its tensors' pages in again. Measured on this project's 2-core machine (issue 29): 24–28 M page faults
and 40–76 s of kernel time in a 150–175 s run, and 1.33–1.55× the throughput with both turned off. Here they are
turned off with `mallopt` at start-up (the CLI, a TrainingSession, each data worker): freed memory stays in the
process for the next step, so its resident size stays at its peak instead of going up and down.

`TUNELOOP_MALLOC=default` leaves glibc as it is; so does a process where the user set glibc's own
`MALLOC_MMAP_MAX_`/`MALLOC_TRIM_THRESHOLD_` (or `MALLOC_MMAP_THRESHOLD_`), or a C library without mallopt.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
NEVER_TRIM = 2 ** 31 - 1  # the largest int mallopt takes: a heap top this free is never given back
OPT_OUT = "TUNELOOP_MALLOC"
GLIBC_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_state: str | None = None  # what this process's allocator is, in words (set once)


def tune_host_allocator() -> str:
    """Turns glibc's mmap and trimming off once per process; returns what the allocator is, in words."""
    global _state
    if _state is not None:
        return _state
    if os.environ.get(OPT_OUT, "").lower() == "default":
        _state = f"glibc's defaults ({OPT_OUT}=default)"
        return _state
    own = [name for name in GLIBC_SETTINGS if name in os.environ]
    if own:
        _state = f"glibc with the environment's {', '.join(own)}"
        return _state
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        _state = "the C library's own (it has no mallopt)"
        return _state
    if mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1:
        _state = "glibc malloc with mmap and trimming off (freed memory is kept for the next step)"
    else:
        _state = "glibc's defaults (mallopt refused the settings)"
    return _state
