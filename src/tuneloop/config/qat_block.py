"""axolotl's `qat:` block as the config reads it (no torch, no torchao: `check` validates it); quant/qat.py trains
with it and use/quantize.py quantizes by it."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator, model_validator

from tuneloop.config.axolotl import FEATURES
from tuneloop.config.datasets import Strict

# axolotl's dtype names (its TorchAOQuantDType) that need a GPU, and why
GPU_ONLY_DTYPES = {
    "nvfp4": "NVFP4/MXFP4 QAT needs a GPU (torchao's NVFP4 and MX formats run on CUDA kernels only)",
    "mxfp4": "NVFP4/MXFP4 QAT needs a GPU (torchao's NVFP4 and MX formats run on CUDA kernels only)",
    "float8_e4m3fn": "FP8 QAT needs a GPU (torchao's float8 quantization runs on CUDA kernels only)",
    "fp8": "FP8 QAT needs a GPU (torchao's float8 quantization runs on CUDA kernels only)",
    "float8": "FP8 QAT needs a GPU (torchao's float8 quantization runs on CUDA kernels only)",
}


class QATBlock(Strict):
    """axolotl's `qat:` block (its QATConfig schema), with its defaults: int8 weights in groups of 32, no activation
    quantization, fake-quantized from the first step."""

    weight_dtype: Literal["int4", "int8"] = "int8"
    activation_dtype: Optional[Literal["int8"]] = None  # None: weight-only
    group_size: int = 32  # weights per scale, along each row (in_features)
    fake_quant_after_n_steps: Optional[int] = None  # None: from the first step
    quantize_embedding: bool = False  # the input embedding's weights too (weight-only)

    @model_validator(mode="before")
    @classmethod
    def _gpu_only(cls, data):
        """One line for the block, however many of its dtypes need a GPU (axolotl's NVFP4 examples set both)."""
        if not isinstance(data, dict):
            return data
        asked = [f"{key}: {data[key]}" for key in ("weight_dtype", "activation_dtype")
                 if isinstance(data.get(key), str) and data[key] in GPU_ONLY_DTYPES]
        if asked:
            why = GPU_ONLY_DTYPES[data["weight_dtype" if asked[0].startswith("weight") else "activation_dtype"]]
            raise ValueError(f"{', '.join(asked)} asks for {FEATURES['quantization'][0]}, which tuneloop does not do "
                             f"yet: {why}; tuneloop's QAT fake-quantizes to int4 or int8")
        return data

    @field_validator("activation_dtype", mode="before")
    @classmethod
    def _activations(cls, value):
        if value == "int4":
            raise ValueError("int4 activations: torchao has no QAT for them (axolotl refuses them too); use int8, "
                             "or leave activation_dtype out for weight-only")
        return value

    @field_validator("group_size")
    @classmethod
    def _group(cls, value):
        if value < 1:
            raise ValueError("must be at least 1 (weights per quantization scale, e.g. 32 or 256)")
        return value

    @field_validator("fake_quant_after_n_steps")
    @classmethod
    def _after(cls, value):
        # (axolotl's callback never turns it on for 0: its step-0 branch turns it off first; refused, not guessed)
        if value is not None and value < 1:
            raise ValueError("must be at least 1 (leave it out to fake-quantize from the first step)")
        return value

    def start_step(self) -> int:
        """The first step (counted from 0) that trains fake-quantized."""
        return self.fake_quant_after_n_steps or 0

    def words(self, total_steps: int | None = None) -> str:
        """The plan's line."""
        activations = "int8 activations (per token)" if self.activation_dtype else "activations as they are"
        start = self.start_step()
        when = "from the first step" if not start else f"from step {start + 1} on (after {start} plain steps)"
        if total_steps is not None and start >= total_steps:
            when = f"never: fake_quant_after_n_steps={start} is not below the run's {total_steps} steps"
        embedding = " and the input embedding" if self.quantize_embedding else ""
        return (f"{self.weight_dtype} weights in groups of {self.group_size}, {activations}; every Linear"
                f"{embedding} fake-quantized {when}; saved plain, `tuneloop quantize` quantizes it")
