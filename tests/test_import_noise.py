"""The lines torchao prints when transformers imports it on a CPU machine (its CUDA kernels failing to load, torch's
deprecation addressed to torchao), and bitsandbytes' search for a hub kernel when peft imports it, are dropped; the
libraries' other warnings still show."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torchao")

IMPORT_AS_A_COMMAND_DOES = """
import logging, sys
if sys.argv[1] == "quiet":
    from tuneloop.host.import_noise import quiet_import_noise
    quiet_import_noise()
import transformers.modeling_utils  # imports torchao, as every command that loads a model does
import peft  # imports bitsandbytes, as every LoRA command does
logging.getLogger("torchao").warning("Failed to load a torchao kernel a CPU machine still needs... (a warning kept)")
logging.getLogger("torch.utils._pytree").warning("another pytree warning (kept)")
"""


def _stderr(mode: str) -> str:
    result = subprocess.run([sys.executable, "-c", IMPORT_AS_A_COMMAND_DOES, mode], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow  # (a process of its own)
def test_torchaos_import_noise_is_dropped_and_other_warnings_kept():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torchao's kernel-loading failures are kept where there is CUDA")
    noisy = _stderr("as installed")
    # (bitsandbytes' line comes on a CPU with AVX512-BF16 only)
    noise = [words for words in ("is an Enum subclass", ".so: ", "Failed to load CPU gemm_4bit_forward")
             if words in noisy]
    if not noise:
        pytest.skip(f"these libraries import quietly by themselves: nothing to drop ({noisy[-500:]!r})")
    quiet = _stderr("quiet")
    assert not [words for words in noise if words in quiet], quiet
    assert "(a warning kept)" in quiet and "another pytree warning (kept)" in quiet, quiet
