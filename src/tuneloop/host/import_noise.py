"""Log lines other libraries print on import that say nothing a user can act on: dropped, each by its exact words.

transformers imports torchao whenever it is installed (its torchao quantizer, at `transformers.modeling_utils`), so
every command that loads a model printed, before the plan, on a machine without CUDA:

    Failed to load .../torchao/_C_cutlass_90a.abi3.so: Could not load this library: ...
    W... torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass and is now natively supported ...

— torchao's CUDA-only kernels failing to load where there is no CUDA to run them, and torch telling torchao's
authors to stop a registration it no longer needs. The quickstart (whose install has torchao, for `qat:`) opened
with four such lines, once per rank in a distributed run; every LoRA command, on a CPU with AVX512-BF16, with one
more from bitsandbytes (which peft imports).

Filters, not levels: every other warning of these loggers still shows (a torchao extension that fails on a machine
with CUDA is worth seeing: it is dropped only where CUDA is absent).
"""

from __future__ import annotations

import logging

_installed = False


def _cuda_absent() -> bool:
    import torch  # (imported by the time torchao logs: torchao imports it first)

    return not torch.cuda.is_available()


def _torchao_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return message.startswith("Failed to load ") and ".so" in message and _cuda_absent()


def _pytree_enum_deprecation(record: logging.LogRecord) -> bool:
    # addressed to the library that registered the Enum (torchao), which a user of tuneloop cannot change
    return "is an Enum subclass and is now natively supported by torch.compile" in record.getMessage()


def _bitsandbytes_hub_kernel(record: logging.LogRecord) -> bool:
    # bitsandbytes on a CPU with AVX512-BF16 looks for a 4-bit matmul kernel to download from the Hugging Face hub
    # through the `kernels` package, and falls back to its own where that is not installed: nothing to act on (and
    # tuneloop downloads nothing from a hub while it runs). peft imports bitsandbytes for every LoRA command.
    message = record.getMessage()
    return message.startswith("Failed to load CPU gemm_4bit_forward") and "No module named 'kernels'" in message


NOISE = {"torchao": _torchao_noise, "torch.utils._pytree": _pytree_enum_deprecation,
         "bitsandbytes.backends.cpu.ops": _bitsandbytes_hub_kernel}


class _DropNoise(logging.Filter):
    def __init__(self, is_noise):
        super().__init__()
        self.is_noise = is_noise

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.is_noise(record)


def quiet_import_noise() -> None:
    """Install the filters (once a process; before the libraries are imported, or they have already spoken)."""
    global _installed
    if _installed:
        return
    for logger_name, is_noise in NOISE.items():
        logging.getLogger(logger_name).addFilter(_DropNoise(is_noise))
    _installed = True
