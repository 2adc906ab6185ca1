"""What a user's shell shows of a run, read off ONE fresh `tuneloop train` process (module-scoped): a LoRA run of a
tiny LLaMA with `bf16: auto`, started as `python -m tuneloop`, so the command re-executes itself under mimalloc (host/allocator.py), bounds
the CPU's matmul kernel caches and quiets its libraries' import noise before torch runs anything. Each test reads one
thing of that output; what needs a process of its own (a reader that goes away, a hub that is down, a peak of
resident memory) stays in its own module."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import base_config, tiny_rows, write_config, write_jsonl

from tuneloop.host.hardware import native_bf16

pytestmark = pytest.mark.slow  # (a process of its own)
from tuneloop.host.kernel_caches import CAPACITY, SETTINGS


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> subprocess.CompletedProcess:
    folder = tmp_path_factory.mktemp("what_a_run_prints")
    data = write_jsonl(folder / "data.jsonl", tiny_rows(16))
    config = write_config(folder / "run.yml", **base_config(folder, tiny_model_dir, data, bf16="auto", adapter="lora",
                                                            lora_target_linear=True, max_steps=1))
    environ = {key: value for key, value in os.environ.items() if key not in SETTINGS}  # (the command sets them)
    result = subprocess.run([sys.executable, "-m", "tuneloop", "train", str(config)], capture_output=True, text=True,
                            env=environ, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_no_run_prints_deepspeeds_cpu_accelerator_line(run):
    """transformers' save_pretrained makes Accelerate import DeepSpeed (installed for the sharded tests), which
    printed "Setting accelerator to CPU" in every run: told there is no GPU, it says nothing."""
    assert "Setting accelerator to CPU" not in run.stdout + run.stderr


def test_the_command_runs_itself_under_mimalloc_and_its_plan_says_so(run):
    from tuneloop.host.allocator import mimalloc_library

    if mimalloc_library() is None:
        pytest.skip("no mimalloc library on this platform: glibc, tuned (allocator.py)")
    assert "host memory          mimalloc, preloaded" in run.stdout, run.stdout[-3000:]


@pytest.mark.skipif(native_bf16() is None, reason="bf16 matmuls run through oneDNN where the CPU has native bf16; "
                    "elsewhere torch emulates them without these caches")
def test_the_command_bounds_the_kernel_caches_and_its_plan_says_so(run):
    """The command sets the capacities before torch runs a matmul (its processes inherit them); the plan's host
    memory line and memory estimate say it."""
    assert f"matmul kernel caches of {CAPACITY} entries each" in run.stdout, run.stdout[-3000:]
    assert "matmul kernel caches 0." in run.stdout, run.stdout[-3000:]


def test_the_libraries_import_noise_is_not_in_the_commands_output(run):
    """torchao's CUDA kernels failing to load, torch's Enum deprecation addressed to torchao, bitsandbytes' search for
    a hub kernel (peft imports it in a LoRA run): none reach the user (test_import_noise.py shows they are there
    without the filter, and that other warnings are kept)."""
    for noise in ("is an Enum subclass", ".so: ", "Failed to load CPU gemm_4bit_forward"):
        assert noise not in run.stderr, run.stderr[-3000:]
