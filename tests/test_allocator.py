"""The host allocator (host/allocator.py): a process the command line starts executes itself again once under mimalloc
(preloaded, freed memory kept), with its arguments and environment; where it cannot (a process already running,
TUNELOOP_MALLOC=glibc, the user's own LD_PRELOAD) glibc runs with mmap and trimming off, so memory a process frees
stays in it for the next step; with TUNELOOP_MALLOC=default glibc hands a large block back at once. Observed through
the process's own resident size and mappings in a fresh interpreter (the suite's process has its allocator set
already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tuneloop.host.allocator import mimalloc_library

PROBE = """
import json, sys
from tuneloop.host.allocator import tune_host_allocator

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


RESTARTING = """
import json, os, sys
from tuneloop.host.allocator import restart_with_mimalloc, tune_host_allocator

print("started", flush=True)  # printed twice where the process executes itself again
restart_with_mimalloc()
with open("/proc/self/maps") as maps:
    loaded = "libmimalloc" in maps.read()
with open("/proc/self/status") as status:  # (the kernel's THP_enabled line: 0 once mimalloc turned them off)
    huge_pages = [line.split()[1] for line in status if line.startswith("THP_enabled:")]
print(json.dumps({"said": tune_host_allocator(), "loaded": loaded, "argv": sys.argv[1:],
                  "kept": os.environ.get("KEEP_ME"), "pid": os.getpid(),
                  "huge_pages": huge_pages[0] if huge_pages else None}))
"""


def probe(code: str = PROBE, *arguments: str, **env) -> dict:
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("MALLOC_", "MIMALLOC_", "TUNELOOP_MALLOC")) and key != "LD_PRELOAD"}
    result = subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True,
                            env={**clean, **env}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_for_the_next_step_unless_glibc_is_left_alone():
    tuned, default = probe(), probe(TUNELOOP_MALLOC="default")  # (a process that was not restarted: glibc)
    assert tuned["said"].startswith("glibc malloc with mmap and trimming off")
    assert default["said"] == "glibc's defaults (TUNELOOP_MALLOC=default)"
    assert tuned["held"] > 200 and default["held"] > 200  # the block was resident in both
    assert tuned["kept"] > 200  # freed, but kept: no page faults to make it again
    assert default["kept"] < 50  # glibc's mmap gave it straight back


def test_the_users_own_glibc_settings_are_left_alone():
    said = probe(MALLOC_TRIM_THRESHOLD_="1000000")["said"]
    assert said == "glibc with the environment's MALLOC_TRIM_THRESHOLD_"
    assert probe(RESTARTING, MALLOC_TRIM_THRESHOLD_="1000000")["said"].startswith("glibc with the environment's")


@pytest.mark.skipif(mimalloc_library() is None, reason="the cmeel-mimalloc wheel (a dependency on Linux)")
def test_a_command_executes_itself_again_under_mimalloc_once_keeping_its_arguments_and_environment():
    restarted = probe(RESTARTING, "train", "x.yml", KEEP_ME="yes")
    assert restarted["loaded"] and restarted["said"] == ("mimalloc, preloaded (freed memory kept for the next step; "
                                                         "no transparent huge pages)")
    assert restarted["argv"] == ["train", "x.yml"] and restarted["kept"] == "yes"
    if restarted["huge_pages"] is not None:  # (a kernel that reports it: Linux 6.x)
        assert restarted["huge_pages"] == "0"  # mimalloc turned them off for the process
        # the user's own value of a mimalloc option is theirs
        theirs = probe(RESTARTING, MIMALLOC_ALLOW_THP="1")
        assert theirs["loaded"] and theirs["huge_pages"] == "1"
        assert theirs["said"] == ("mimalloc, preloaded (freed memory kept for the next step; the environment's "
                                  "MIMALLOC_ALLOW_THP=1)")
    glibc = probe(RESTARTING, TUNELOOP_MALLOC="glibc")
    assert not glibc["loaded"] and glibc["said"].startswith("glibc malloc with mmap and trimming off")
    # the user's own preload is theirs: never replaced (here an empty one, so glibc runs, tuned)
    theirs = probe(RESTARTING, LD_PRELOAD=" ")
    assert not theirs["loaded"] and theirs["said"].startswith("glibc malloc with mmap and trimming off")
