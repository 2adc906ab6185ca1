"""Quantization-aware training (axolotl's `qat:` block: config/qat_block.py), through torchao.

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

from tuneloop.config.qat_block import QATBlock
from tuneloop.errors import UserError
from tuneloop.host.import_noise import quiet_import_noise

def torchao_quantization():
    """torchao's quantization module, or a refusal that says how to install it."""
    try:
        quiet_import_noise()  # (its CUDA-only kernels failing to load on a CPU: host/import_noise.py)
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
