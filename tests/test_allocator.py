"""The host allocator (allocator.py): with mmap and trimming off, memory a process frees stays in it for the next
step; with TUNELOOP_MALLOC=default glibc hands a large block back at once. Observed through the process's own
resident size in a fresh interpreter (the suite's process has its allocator set already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from tuneloop.allocator import tune_host_allocator

def resident_mb():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 2**20

said = tune_host_allocator()
before = resident_mb()
block = bytearray(256 * 2**20)  # touched: zero-filled
held = resident_mb()
del block
after = resident_mb()
print(json.dumps({"said": said, "held": held - before, "kept": after - before}))
"""


def probe(**env) -> dict:
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("MALLOC_", "TUNELOOP_MALLOC"))}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env={**clean, **env},
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_for_the_next_step_unless_glibc_is_left_alone():
    tuned, default = probe(), probe(TUNELOOP_MALLOC="default")
    assert tuned["said"].startswith("glibc malloc with mmap and trimming off")
    assert default["said"] == "glibc's defaults (TUNELOOP_MALLOC=default)"
    assert tuned["held"] > 200 and default["held"] > 200  # the block was resident in both
    assert tuned["kept"] > 200  # freed, but kept: no page faults to make it again
    assert default["kept"] < 50  # glibc's mmap gave it straight back


def test_the_users_own_glibc_settings_are_left_alone():
    said = probe(MALLOC_TRIM_THRESHOLD_="1000000")["said"]
    assert said == "glibc with the environment's MALLOC_TRIM_THRESHOLD_"
