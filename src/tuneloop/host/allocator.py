"""The host allocator, tuned for training: freed memory stays in the process for the next step.

A training step allocates and frees the same large tensors over and over (activations, gradients, the optimizer's
temporaries). glibc serves each allocation above its mmap threshold (dynamically 128 KiB to 32 MiB) with a fresh
mmap and gives it back on free, and trims the heap's top whenever more than its trim threshold is free: every step
then faults its tensors' pages in again. Measured on this project's 2-core machine (issue 29): 24–28 M page faults
and 40–76 s of kernel time in a 150–175 s run.

Turning glibc's mmap and trimming off (`mallopt`) keeps freed memory, but glibc then splits a freed large block for
the small allocations that follow it, so the next large tensor no longer fits the hole and the heap grows: the
quickstart's resident size rose by ~50 MB a step (4.54 → 5.39 GB over 17 steps, 14–28 k page faults in most steps:
one 113 MB embedding gradient's pages each). So every process started by the `tuneloop` command runs mimalloc
instead (the `cmeel-mimalloc` wheel, a dependency on Linux), preloaded: the command executes itself again once,
before it imports torch, with `LD_PRELOAD` naming it, `MIMALLOC_PURGE_DELAY=-1` (freed memory stays committed) and
`MIMALLOC_ALLOW_THP=0` (no transparent huge pages: their first touch can wait on the kernel's compaction). Same
quickstart: the resident size flat at 4.59–4.65 GB from step 3 to 16, under 100 page faults a step. Ranks that
torchrun or `accelerate launch` start as `tuneloop` (or `python -m tuneloop`) do the same; data workers and other
children inherit it.

A process that is already running (a `TrainingSession` opened from Python, a test) cannot change its allocator:
there glibc's mmap and trimming are turned off as above, the better of glibc's two behaviours for speed.

`TUNELOOP_MALLOC=glibc` keeps glibc (tuned); `TUNELOOP_MALLOC=default` leaves glibc as it is; so does a process
where the user set glibc's own `MALLOC_MMAP_MAX_`/`MALLOC_TRIM_THRESHOLD_` (or `MALLOC_MMAP_THRESHOLD_`), or a C
library without mallopt. An `LD_PRELOAD` the user set is never changed (it may hold an allocator of their own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
NEVER_TRIM = 2 ** 31 - 1  # the largest int mallopt takes: a heap top this free is never given back
OPT_OUT = "TUNELOOP_MALLOC"
GLIBC_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
RESTARTED = "TUNELOOP_MALLOC_PRELOADED"  # set by the one re-execution, so that it never happens twice
# mimalloc's own options. PURGE_DELAY -1: never give freed memory back to the system (decommitting it brought the
# page faults back: 11–24 k a step and 1.5× the step time on the quickstart with mimalloc's default delay).
# ALLOW_THP 0: no transparent huge pages for the process (mimalloc asks for them on its arenas, and under the kernel's
# common `defrag: madvise` each first touch of a 2 MB page may wait for the kernel to compact memory for it). On this
# project's 2-core machine (enabled/defrag both `madvise`) the quickstart's first step took 6.2–6.6 s with them and
# 4.0–4.1 s without, its system time 9.8–10.5 s against 4.4–5.5, the steady steps the same (MFU 0.55–0.60 both
# ways, 3 interleaved rounds), peak RSS the same; one tiny LLaMA's first forward 0.47 s against 0.21 (0.15 steady).
# The environment's own value of either is kept.
MIMALLOC_SETTINGS = {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ALLOW_THP": "0"}

_state: str | None = None  # what this process's allocator is, in words (set once)


def mimalloc_library() -> str | None:
    """The path of the mimalloc shared library the `cmeel-mimalloc` wheel installs, if it is installed here."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        for name in ("cmeel.prefix/lib/libmimalloc.so.3", "cmeel.prefix/lib/libmimalloc.so"):
            path = str(distribution("cmeel-mimalloc").locate_file(name))
            if os.path.isfile(path):
                return path
    except (PackageNotFoundError, OSError):
        pass
    return None


def _mimalloc_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "libmimalloc" in maps.read()
    except OSError:
        return False


def _glibc_left_alone(environ) -> str | None:
    """Why glibc is to be left as it is, in words; None when tuneloop may choose."""
    if environ.get(OPT_OUT, "").lower() == "default":
        return f"glibc's defaults ({OPT_OUT}=default)"
    own = [name for name in GLIBC_SETTINGS if name in environ]
    if own:
        return f"glibc with the environment's {', '.join(own)}"
    return None


def preloaded_environment(environ=None) -> dict | None:
    """The environment a new process needs to start with mimalloc (LD_PRELOAD and its settings added), or None where
    it would not get it: not installed, not Linux, the user's own LD_PRELOAD or glibc settings, or `TUNELOOP_MALLOC`
    asking for glibc. (Benchmarks start tuneloop's rows with it, as the command would.)"""
    environ = dict(os.environ if environ is None else environ)
    if (environ.get(OPT_OUT, "").lower() in ("glibc", "default") or _glibc_left_alone(environ)
            or environ.get("LD_PRELOAD")):
        return None
    library = mimalloc_library()
    if library is None:
        return None
    environ["LD_PRELOAD"] = library
    for name, value in MIMALLOC_SETTINGS.items():
        environ.setdefault(name, value)
    return environ


def restart_with_mimalloc() -> None:
    """Executes this process again with mimalloc preloaded, where it can be (see preloaded_environment); returns
    only where it is not. Call it first thing in a command's process, before torch is imported: the process keeps
    its id, arguments, standard streams and environment (so a launcher's child stays its child)."""
    if os.environ.get(RESTARTED) or _mimalloc_loaded():
        return
    environ = preloaded_environment()
    if environ is None or not getattr(sys, "orig_argv", None):
        return
    environ[RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError:
        return  # (an interpreter that cannot be executed again: glibc, tuned below)


def _mimalloc_settings_in_words(environ) -> list[str]:
    purge, huge_pages = environ.get("MIMALLOC_PURGE_DELAY"), environ.get("MIMALLOC_ALLOW_THP")
    words = ["freed memory kept for the next step" if purge == "-1"
             else f"the environment's MIMALLOC_PURGE_DELAY={purge}" if purge is not None
             else "its own purge delay"]
    if huge_pages == "0":
        words.append("no transparent huge pages")
    elif huge_pages is not None:
        words.append(f"the environment's MIMALLOC_ALLOW_THP={huge_pages}")
    return words


def tune_host_allocator() -> str:
    """Says which allocator this process runs; where it is glibc, turns its mmap and trimming off (once per
    process). Returns what the allocator is, in words (the plan's `host memory` line)."""
    global _state
    if _state is not None:
        return _state
    if _mimalloc_loaded():
        _state = f"mimalloc, preloaded ({'; '.join(_mimalloc_settings_in_words(os.environ))})"
        return _state
    _state = _glibc_left_alone(os.environ)
    if _state is not None:
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
