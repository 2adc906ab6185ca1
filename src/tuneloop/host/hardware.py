"""What the machine has, and what a config needs of it.

Options that change what is trained and need hardware or a library (4/8-bit loading, 8-bit optimizers, fp16,
DeepSpeed) are accepted by the config and the plan, and refused when `train` starts on a machine without it:
`check_hardware`. bitsandbytes is asked itself whether it quantizes (or steps its optimizers) on the run's device:
since 0.49 it has a CPU backend, so QLoRA runs without a GPU.
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
                     "bitsandbytes (on a GPU, or its CPU backend)")
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.needs_cuda:
        needs.append(f"`optimizer: {cfg.optimizer}`: a CUDA GPU" + (f" and {kind.library}" if kind.library else ""))
    elif kind.library:
        needs.append(f"`optimizer: {cfg.optimizer}`: {kind.library}")
    if cfg.fp16:
        needs.append("`fp16: true`: a CUDA GPU")
    return needs + resolved.engine.needs()


def check_hardware(cfg, resolved) -> None:
    """Refuses, before anything is loaded, a run this machine cannot do (see hardware_needs)."""
    import torch

    missing = []
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if quantized_loading(cfg):
        refusal = bitsandbytes_refusal(quantized_loading(cfg), device,
                                       (cfg.bnb_config_kwargs or {}).get("bnb_4bit_quant_type", "nf4"))
        if refusal:
            missing.append(f"{quantized_loading(cfg)} quantized loading (QLoRA / load_in_*bit) {refusal}")
    missing += resolved.engine.missing()
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.needs_cuda and not cuda:
        missing.append(f"`optimizer: {cfg.optimizer}` needs a CUDA GPU; adamw_torch_fused runs everywhere")
    elif kind.library and importlib.util.find_spec(kind.library) is None:
        missing.append(f"`optimizer: {cfg.optimizer}` needs {kind.library}: pip install {kind.library}")
    elif kind.library:
        refusal = optimizer_refusal(cfg, kind, device)
        if refusal:
            missing.append(f"`optimizer: {cfg.optimizer}` {refusal}")
    if missing:
        raise UserError("config: this machine cannot run this config: " + "; ".join(missing))


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def bitsandbytes_refusal(kind: str, device: str, quant_type: str = "nf4") -> str | None:
    """None when bitsandbytes quantizes a tensor the way `kind` loads weights on `device`, else why not, in its
    own words: asked of bitsandbytes (a tiny quantization), not inferred from torch.cuda."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs bitsandbytes: pip install bitsandbytes"
    import torch

    try:
        import bitsandbytes.functional as bnb_functional

        probe = torch.ones(64, 64, device=device)
        if kind == "4bit":
            bnb_functional.quantize_4bit(probe, quant_type=quant_type)
        else:
            bnb_functional.int8_vectorwise_quant(probe.half())
    except Exception as error:  # bitsandbytes' own refusal: no backend for this device, a missing library, ...
        return f"is not possible here: bitsandbytes cannot quantize on the {device} ({_first_line(error)})"
    return None


def optimizer_refusal(cfg, kind, device: str) -> str | None:
    """None when the library's optimizer builds and steps a tiny parameter on `device`, else its reason."""
    import torch

    parameter = torch.nn.Parameter(torch.ones(256, 256, device=device))
    parameter.grad = torch.ones_like(parameter)
    try:
        kind.build([{"params": [parameter]}], cfg).step()
    except Exception as error:
        return f"cannot step on the {device}: {kind.library} says {_first_line(error)}"
    return None


def quiet_deepspeed_on_cpu() -> None:
    """Where there is no GPU, DeepSpeed is told so before anything imports it: transformers' save_pretrained asks
    Accelerate, which imports DeepSpeed whenever it is installed, and DeepSpeed would then print its "Setting
    accelerator to CPU" warning in every run. (On a GPU it finds CUDA itself.)"""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def mixed_precision(fp16, bf16, native: str | None) -> tuple[str, str]:
    """Accelerate's mixed precision for the `fp16`/`bf16` keys on a machine whose native bf16 is `native` (in words,
    as native_bf16 says it; None: none): ("bf16", "fp16" or "no", why in words). Pure: the caller asks the machine,
    and refuses fp16 without CUDA (resolved.precision)."""
    if fp16:
        return "fp16", "fp16: true"
    if bf16 == "auto":
        # bf16 where the hardware runs it natively: on a Zen 4 CPU a 2048² matmul ran 411 GFLOPS in bf16 against
        # 168 in fp32, and the quickstart trained 1.5x faster
        if native:
            return "bf16", f"bf16: auto, and {native}"
        return "no", "bf16: auto, and there is no native bf16 here"
    return ("bf16", "bf16: true") if bf16 else ("no", "bf16: false")


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


def peak_host_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
