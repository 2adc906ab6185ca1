"""The CPU's matmul kernel caches, bounded (host/kernel_caches.py) and counted by the plan (plan/process_memory.py).

Each new shape of a bf16 matmul on a CPU leaves a compiled kernel in ideep's cache and in oneDNN's, 1024 entries
each by default: a run whose shapes vary (padded rows, preference pairs, the trained tokens meeting the head) grew
by that much. Observed through fresh interpreters' resident size: the libraries read the capacities when torch
first needs them, and the suite's own process has run matmuls already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tuneloop.host.hardware import native_bf16
from tuneloop.host.kernel_caches import CAPACITY, SETTINGS, bound_kernel_caches

needs_bf16 = pytest.mark.skipif(native_bf16() is None, reason="bf16 matmuls run through oneDNN where the CPU has "
                                "native bf16; elsewhere torch emulates them without these caches")

NEW_SHAPES = 6 * CAPACITY  # more than tuneloop's capacity, fewer than the libraries' own 1024

GROWTH = f"""
import json, re, torch
resident = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
weight = torch.randn(64, 64, dtype=torch.bfloat16)
torch.randn(8, 64, dtype=torch.bfloat16) @ weight  # (the kernels' libraries load here, before the count)
before = resident()
for rows in range(65, 65 + {NEW_SHAPES}):
    torch.randn(rows, 64, dtype=torch.bfloat16) @ weight
print(json.dumps({{"grew": resident() - before}}))
"""


def growth_over_new_shapes(environ: dict) -> int:
    """In a fresh interpreter under the allocator tuneloop's processes run (mimalloc where installed:
    host/allocator.py)."""
    from tuneloop.host.allocator import preloaded_environment

    environ = preloaded_environment(environ) or environ
    result = subprocess.run([sys.executable, "-c", GROWTH], capture_output=True, text=True, timeout=300,
                            env={**environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["grew"]


@pytest.mark.slow  # (a process of its own)
@needs_bf16
def test_bounded_caches_stop_new_bf16_shapes_from_growing_the_process():
    """768 new shapes: at the libraries' defaults every one stays (~0.6 MB each on Zen 4: 442 MB); at tuneloop's
    capacity only the last 128 do (77 MB). Bounding oneDNN's cache alone kept 268 MB, ideep's alone all of it: each
    fails this."""
    defaults = {key: value for key, value in os.environ.items() if key not in SETTINGS}
    bounded = dict(defaults)
    bound_kernel_caches(bounded)
    at_defaults, at_ours = growth_over_new_shapes(defaults), growth_over_new_shapes(bounded)
    assert at_ours < at_defaults / 3, (at_ours, at_defaults)


def test_a_capacity_the_user_set_is_kept():
    environ = {"LRU_CACHE_CAPACITY": "2048"}
    bound_kernel_caches(environ)
    assert environ == {"LRU_CACHE_CAPACITY": "2048", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CAPACITY)}


@pytest.mark.slow  # (a process of its own)
@needs_bf16
def test_a_bf16_cpu_plan_counts_the_full_caches_and_an_fp32_one_does_not(tmp_path, tiny_model_dir, monkeypatch):
    """Counted where the run's matmuls are 16-bit on this CPU (fp32 ones go to MKL, which keeps no such cache), measured
    once in a fresh interpreter at this process's capacities and cached; not counted when planning for another
    device."""
    from tuneloop.config import config_from_dict
    from tuneloop.model.kinds import MODEL_KINDS
    from tuneloop.plan.model_facts import model_facts
    from tuneloop.plan import process_memory
    from tuneloop.plan.memory import estimate_memory
    from tuneloop.resolved import resolve_config

    monkeypatch.setenv(process_memory.CACHE_ENV, str(tmp_path / "process_memory.json"))
    for name in SETTINGS:
        monkeypatch.setenv(name, str(CAPACITY))
    cfg = config_from_dict({"base_model": str(tiny_model_dir), "datasets": [{"path": "x"}], "bf16": True})
    facts, engine = model_facts(cfg, MODEL_KINDS["causal"]), resolve_config(cfg).engine
    bf16 = estimate_memory(cfg, facts, tokens_per_micro_batch=512, precision="bf16", engine=engine)
    figure = process_memory.kernel_caches_bytes()
    assert bf16.kernel_caches_gb == round(figure / 1e9, 3) > 0
    monkeypatch.setattr(process_memory, "_measured", lambda probe: pytest.fail("measured twice"))
    assert process_memory.kernel_caches_bytes() == figure

    fp32_cfg = config_from_dict({"base_model": str(tiny_model_dir), "datasets": [{"path": "x"}], "bf16": False})
    fp32 = estimate_memory(fp32_cfg, facts, tokens_per_micro_batch=512, precision="no", engine=engine)
    elsewhere = estimate_memory(cfg, facts, tokens_per_micro_batch=512, precision="bf16", engine=engine, device_gb=80)
    assert fp32.kernel_caches_gb == 0 and elsewhere.kernel_caches_gb == 0
