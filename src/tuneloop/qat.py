"""Quantization-aware training (axolotl's `qat:` block), through torchao.

The model's Linear layers (and its input embedding, with `quantize_embedding`) are swapped for torchao's fake-quantized
ones: every forward rounds the weights (and the Linear inputs, with int8 activations) to the integer grid they will be
quantized to, and computes with those values in floating point, so training learns weights that survive the real
quantization `tuneloop quantize` applies after (use/quantize.py).

The fake quantization is derived by torchao from the very post-training config `tuneloop quantize` applies
(`QATConfig(base_config)`), so a fake-quantized forward equals the quantized model's (tests/test_qat.py). On a CPU
those configs are torchao's `intx` ones (int4/int8 weights in groups, symmetric; int8 activations per token,
asymmetric): axolotl's int4 weight-only choice, `Int4WeightOnlyConfig`, runs on CUDA kernels only.

When it is on: axolotl's QATCallback turns it off at the first step and on when a step begins with
`fake_quant_after_n_steps` steps done. Here the state follows from the step alone (`FakeQuantization.follow`), so a
resumed run is in the state the uninterrupted one was: steps 0 … N-1 (counted from 0) train on the plain weights,
step N and every later one fake-quantized; an eval after step s sees what step s trained with.

The saved model is plain: the fake-quantized layers hold the same parameters under the same names, and they are
swapped back before the final save (as axolotl converts them), so output_dir holds an ordinary model folder in the
run's dtype. torchao is imported only when a config has a `qat:` block.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator, model_validator

from tuneloop.config.datasets import Strict
from tuneloop.errors import UserError
from tuneloop.import_noise import quiet_import_noise

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
            from tuneloop.config.axolotl import FEATURES

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


def torchao_quantization():
    """torchao's quantization module, or a refusal that says how to install it."""
    try:
        quiet_import_noise()  # (its CUDA-only kernels failing to load on a CPU: import_noise.py)
        import torchao.quantization as quantization
        import torchao.quantization.qat  # noqa: F401
    except ImportError as error:
        raise UserError(f"config: `qat` needs torchao, which is not installed ({error}): pip install "
                        "'tuneloop[qat]'") from None
    return quantization


def ptq_configs(settings: QATBlock):
    """(the Linear layers' torchao post-training config, the embedding's or None): what `tuneloop quantize` applies,
    and what the fake quantization is derived from."""
    import torch

    quantization = torchao_quantization()
    from torchao.quantization.granularity import PerGroup

    dtype = getattr(torch, settings.weight_dtype)
    groups = PerGroup(settings.group_size)
    weight_only = quantization.IntxWeightOnlyConfig(weight_dtype=dtype, granularity=groups)
    if settings.activation_dtype == "int8":
        linear = quantization.Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=groups)
    else:
        linear = weight_only
    # (an embedding is looked up, not multiplied: its weights alone, as in axolotl)
    return linear, weight_only if settings.quantize_embedding else None


def is_embedding(module, _name: str = "") -> bool:
    import torch

    return isinstance(module, torch.nn.Embedding)


def ungrouped_layers(settings: QATBlock, model) -> list[str]:
    """The layers whose rows do not split into `group_size` groups (torchao refuses them), `name (in_features)`."""
    import torch

    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            width = module.in_features
        elif settings.quantize_embedding and isinstance(module, torch.nn.Embedding):
            width = module.embedding_dim
        else:
            continue
        if width % settings.group_size:
            found.append(f"{name} ({width})")
    return found


def check_fits(settings: QATBlock, model) -> None:
    """Refused before training (the plan meets it on the meta model): a group size the layers' widths do not take."""
    ungrouped = ungrouped_layers(settings, model)
    if ungrouped:
        raise UserError(f"config: `qat.group_size: {settings.group_size}` does not divide the input width of "
                        f"{len(ungrouped)} layers ({', '.join(ungrouped[:3])}{', …' if len(ungrouped) > 3 else ''}): "
                        "choose a group size that divides them (a power of two such as 32)")


class FakeQuantization:
    """The run's fake-quantized layers, switched on from `start_step` on. Built on the model before the engine
    wraps or compiles it; the layers keep the model's parameters (the same tensors, the same names)."""

    def __init__(self, model, settings: QATBlock, step: int):
        check_fits(settings, model)
        quantization = torchao_quantization()
        from torchao.quantization.qat import QATConfig

        linear, embedding = ptq_configs(settings)
        quantization.quantize_(model, QATConfig(linear, step="prepare"))
        if embedding is not None:
            quantization.quantize_(model, QATConfig(embedding, step="prepare"), filter_fn=is_embedding)
        self.model, self.start = model, settings.start_step()
        self.quantizers = [quantizer for module in model.modules()
                           for quantizer in (getattr(module, "activation_fake_quantizer", None),
                                             getattr(module, "weight_fake_quantizer", None))
                           if quantizer is not None]
        self.enabled = None
        self.follow(step)

    def follow(self, step: int) -> None:
        """The state for the step that starts with `step` steps done (and the evals after it)."""
        enabled = step >= self.start
        if enabled != self.enabled:
            for quantizer in self.quantizers:
                quantizer.enabled = enabled
            self.enabled = enabled

    def remove(self) -> None:
        """The plain layers back, holding the trained parameters: what is saved is an ordinary model."""
        quantization = torchao_quantization()
        from torchao.quantization.qat import QATConfig

        quantization.quantize_(self.model, QATConfig(step="convert"))
        quantization.quantize_(self.model, QATConfig(step="convert"), filter_fn=is_embedding)
        self.quantizers = []


class NoFakeQuantization:
    """A run without `qat:`: nothing to switch."""

    def follow(self, step: int) -> None:
        pass

    def remove(self) -> None:
        pass


def fake_quantization_of(cfg, model, step: int):
    """The run's fake quantization, set for the step it starts from (a resumed run's)."""
    if cfg.qat is None:
        return NoFakeQuantization()
    return FakeQuantization(model, cfg.qat, step)
