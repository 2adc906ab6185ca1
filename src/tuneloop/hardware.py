"""What the machine has, and what a config needs of it.

Options that change what is trained and need hardware (4/8-bit loading, 8-bit optimizers, fp16, DeepSpeed) are
accepted by the config and the plan, and refused when `train` starts on a machine without it: `check_hardware`.
`hardware_needs` says which without importing torch, for `tuneloop check`. What the run then uses (precision,
attention kernel) is decided in resolved.py, from `native_bf16` and friends.
"""

from __future__ import annotations

import importlib.util

from tuneloop.errors import UserError
from tuneloop.optim import OPTIMIZERS


def quantized_loading(cfg) -> str | None:
    """'4bit' (QLoRA), '8bit' or None."""
    if cfg.load_in_4bit or cfg.adapter == "qlora":
        return "4bit"
    return "8bit" if cfg.load_in_8bit else None


def hardware_needs(cfg, resolved) -> list[str]:
    """What `train` will need of the machine, in words (no torch import)."""
    needs = []
    if quantized_loading(cfg):
        needs.append(f"{quantized_loading(cfg)} quantized loading (`adapter: {cfg.adapter}`"
                     f"{', load_in_4bit' if cfg.load_in_4bit else ', load_in_8bit' if cfg.load_in_8bit else ''}): "
                     "a CUDA GPU and bitsandbytes")
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.needs_cuda:
        needs.append(f"`optimizer: {cfg.optimizer}`: a CUDA GPU" + (f" and {kind.library}" if kind.library else ""))
    if cfg.fp16:
        needs.append("`fp16: true`: a CUDA GPU")
    return needs + resolved.engine.needs()


def check_hardware(cfg, resolved) -> None:
    """Refuses, before anything is loaded, a run this machine cannot do (see hardware_needs)."""
    import torch

    missing = []
    cuda = torch.cuda.is_available()
    if quantized_loading(cfg):
        if not cuda:
            missing.append(f"{quantized_loading(cfg)} quantized loading (QLoRA / load_in_*bit) needs a CUDA GPU")
        elif importlib.util.find_spec("bitsandbytes") is None:
            missing.append("quantized loading needs bitsandbytes: pip install bitsandbytes")
    missing += resolved.engine.missing()
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.needs_cuda and not cuda:
        missing.append(f"`optimizer: {cfg.optimizer}` needs a CUDA GPU; adamw_torch_fused runs everywhere")
    elif kind.library and importlib.util.find_spec(kind.library) is None:
        missing.append(f"`optimizer: {cfg.optimizer}` needs {kind.library}: pip install {kind.library}")
    if missing:
        raise UserError("config: this machine cannot run this config: " + "; ".join(missing))


def quiet_deepspeed_on_cpu() -> None:
    """Where there is no GPU, DeepSpeed is told so before anything imports it: transformers' save_pretrained asks
    Accelerate, which imports DeepSpeed whenever it is installed, and DeepSpeed would then print its "Setting
    accelerator to CPU" warning in every run. (On a GPU it finds CUDA itself.)"""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def native_bf16() -> str | None:
    """Where this machine computes bf16 natively, in words (None: nowhere). Asked of torch, not /proc/cpuinfo."""
    import torch

    if torch.cuda.is_available():
        return f"the GPU ({torch.cuda.get_device_name(0)}) has bf16" if torch.cuda.is_bf16_supported() else None
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "the CPU has AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "the CPU has AVX512-BF16"
    return None
