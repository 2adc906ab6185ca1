"""What the config asks of the machine: precision, attention kernel, and the hardware some options need.

Kernels that only change speed fall back when this machine cannot run them (flash-attention without
CUDA and flash-attn runs as SDPA: the same attention), and the plan says so. Options that change what
is trained and need hardware (4/8-bit loading, 8-bit optimizers, fp16) are accepted by the config and
the plan, and refused when `train` starts on a machine without it. `hardware_needs` tells which without
importing torch, for `tuneloop check`.
"""

from __future__ import annotations

import importlib.util

from tuneloop.errors import UserError
from tuneloop.optim import OPTIMIZERS

FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def quantized_loading(cfg) -> str | None:
    """'4bit' (QLoRA), '8bit' or None."""
    if cfg.load_in_4bit or cfg.adapter == "qlora":
        return "4bit"
    return "8bit" if cfg.load_in_8bit else None


def hardware_needs(cfg) -> list[str]:
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
    if cfg.distributed.engine == "deepspeed":
        needs.append(f"`deepspeed: {cfg.deepspeed if isinstance(cfg.deepspeed, str) else '(inline)'}`: the deepspeed "
                     "package (pip install 'tuneloop[deepspeed]')")
    return needs


def check_hardware(cfg) -> None:
    """Refuses, before anything is loaded, a run this machine cannot do (see hardware_needs)."""
    import torch

    missing = []
    cuda = torch.cuda.is_available()
    if quantized_loading(cfg):
        if not cuda:
            missing.append(f"{quantized_loading(cfg)} quantized loading (QLoRA / load_in_*bit) needs a CUDA GPU")
        elif importlib.util.find_spec("bitsandbytes") is None:
            missing.append("quantized loading needs bitsandbytes: pip install bitsandbytes")
    if cfg.distributed.engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        missing.append("`deepspeed:` needs the deepspeed package: pip install 'tuneloop[deepspeed]'")
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.needs_cuda and not cuda:
        missing.append(f"`optimizer: {cfg.optimizer}` needs a CUDA GPU; adamw_torch_fused runs everywhere")
    elif kind.library and importlib.util.find_spec(kind.library) is None:
        missing.append(f"`optimizer: {cfg.optimizer}` needs {kind.library}: pip install {kind.library}")
    if missing:
        raise UserError("config: this machine cannot run this config: " + "; ".join(missing))


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


def precision(cfg) -> tuple[str, str]:
    """Accelerate's mixed_precision string for the config on this machine, and why, in words."""
    import torch

    if cfg.fp16:
        if not torch.cuda.is_available():  # accelerate would accept it and quietly train in fp32
            raise UserError("config: `fp16: true` needs a CUDA GPU, and this machine has none (accelerate would "
                            "silently train in fp32 here). Remove it, or use `bf16: true` where the CPU has bf16.")
        return "fp16", "fp16: true"
    if cfg.bf16 == "auto":
        native = native_bf16()
        # bf16 where the hardware runs it natively: on a Zen 4 CPU a 2048² matmul ran 411 GFLOPS in bf16 against
        # 168 in fp32, and the quickstart trained 1.5x faster
        if native:
            return "bf16", f"bf16: auto, and {native}"
        return "no", "bf16: auto, and there is no native bf16 here"
    return ("bf16", "bf16: true") if cfg.bf16 else ("no", "bf16: false")


def mixed_precision(cfg) -> str:
    return precision(cfg)[0]


def requested_attention(cfg) -> str:
    if cfg.attn_implementation:
        return cfg.attn_implementation
    if cfg.flash_attention:
        return "flash_attention_2"
    if cfg.flex_attention:
        return "flex_attention"
    return "eager" if cfg.eager_attention else "sdpa"  # sdp_attention: true says sdpa too


def attention_implementation(cfg) -> tuple[str, str | None]:
    """The attention implementation the model loads with, and a note when it is not the one asked for.

    Flash-attention kernels (and xformers, hub kernels, flex attention) compute the same attention as SDPA,
    packed rows included (transformers builds the block-diagonal mask from position_ids for SDPA and uses
    the varlen path for flash-attention), so where they cannot run the run uses SDPA and says so."""
    import torch

    asked = requested_attention(cfg)
    cuda = torch.cuda.is_available()
    if asked in ("sdpa", "eager"):
        return asked, None
    if asked in FLASH_PACKAGES:
        if cuda and importlib.util.find_spec(FLASH_PACKAGES[asked]) is not None:
            return asked, None
        reason = "a CUDA GPU" if not cuda else f"the {FLASH_PACKAGES[asked]} package"
    elif asked.startswith("kernels-community/"):
        if cuda and importlib.util.find_spec("kernels") is not None:
            return asked, None
        reason = "a CUDA GPU and the kernels package"
    elif asked == "flex_attention":
        if cuda:
            return asked, None
        reason = "a CUDA GPU (on CPU it compiles slowly)"
    else:  # xformers: transformers has no xformers attention
        reason = "transformers' xformers support, which it does not have"
    return "sdpa", f"attention `{asked}` needs {reason}: using sdpa (the same attention, another kernel)"
