"""The CPU's caches of matmul kernels, bounded: they otherwise grow the process by ~0.65 GB over a long bf16 run.

On a CPU with native bf16, torch runs each bf16 matmul through oneDNN (by way of ideep), and both keep every
primitive they create in a cache of their own: ideep's (`LRU_CACHE_CAPACITY`) and oneDNN's
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default. A primitive holds its JIT-compiled kernel,
~0.6 MB resident between the two whatever the matmul's size (measured on AMD Zen 4, from 64 × 64 to 2048 × 8192
weights), and each new shape makes one: a micro-batch of a new width (padded rows, preference pairs, seq2seq),
or a new count of trained tokens meeting the output head, makes a few dozen. So the process grew step after step
until both caches were full: the DPO example's resident size rose from 1.68 to 2.21 GB over its 30 steps
(peak RSS 2.28–2.32 GB against the plan's 1.51), with the Python-visible tensors constant; an isolated loop of
bf16 matmuls over new shapes grew 0.63 GB and then stayed there; fp32 matmuls (MKL) keep no such cache.

A packed run's step meets a few dozen shapes, so CAPACITY entries keep every one it reuses; beyond it, a shape
seen again after CAPACITY others is compiled again (~1.5–2 ms). The DPO example, 2 interleaved rounds (Zen 4, 2
threads): at the defaults training took 95.3 and 101.1 s and peaked at 2.28 and 2.30 GB; at 128 entries 98.3 and
93.0 s, 1.92 GB both; the quickstart read the same time and peak at 64, 256 and 1024 entries (its noise, ±8%,
larger than any difference).

Both are read from the environment when torch first needs them, so the `tuneloop` command sets them at its
start, before torch runs a matmul, and every process it starts (ranks, data workers, probes) inherits them; a
session opened from Python sets them when it opens (too late only if this process already ran a bf16 matmul:
then the caches keep their defaults). A value the user set is kept. The plan counts the caches at their bound
on a CPU in bf16 (plan/process_memory.py measures it) and says it on its `host memory` line.
"""

from __future__ import annotations

import os

CAPACITY = 128
SETTINGS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")  # ideep's, oneDNN's
DEFAULT_CAPACITY = 1024  # both libraries' own


def bound_kernel_caches(environ=None) -> None:
    """Sets both caches' capacity in `environ` (this process's environment), unless it already says one."""
    environ = os.environ if environ is None else environ
    for name in SETTINGS:
        environ.setdefault(name, str(CAPACITY))


def capacities(environ=None) -> dict[str, int]:
    """What each cache holds at most in a process started with `environ` (a value that is no number: the default,
    as the libraries read it)."""
    environ = os.environ if environ is None else environ
    found = {}
    for name in SETTINGS:
        try:
            found[name] = int(environ.get(name, DEFAULT_CAPACITY))
        except ValueError:
            found[name] = DEFAULT_CAPACITY
    return found


def in_words(environ=None) -> str:
    sizes = capacities(environ)
    ours = all(sizes[name] == CAPACITY for name in SETTINGS)
    if ours:
        return f"matmul kernel caches of {CAPACITY} entries each (oneDNN's and ideep's; {DEFAULT_CAPACITY} by default)"
    return "matmul kernel caches of " + ", ".join(f"{sizes[name]} ({name})" for name in SETTINGS) + " entries"
