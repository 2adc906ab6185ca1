"""What autograd keeps for the backward in a LLaMA-formula decoder layer, as tuneloop runs it: the plan's activations.

The usual per-layer count (34 values per token and hidden unit: Korthikanti et al. 2022) is for a GPT layer as
Megatron runs it: an MLP four times the width, dropout masks, unfused norms. tuneloop's LLaMA-family layers keep
less, and what they keep depends on the dtypes: the quickstart's SmolLM2 keeps 47 bytes per token and hidden unit a
layer under bf16 autocast (34 values would be 68) and 61 in fp32 (34 would be 136), measured with saved-tensor
hooks. So for a model whose every decoder layer has LLaMA's norms and SiLU-gated MLP (the ones kernels/rms_norm.py and
kernels/swiglu.py run), the layer is counted tensor by tensor, per token:

- each norm keeps its input, in the residual stream's dtype: fp32 unless the weights are loaded in bf16/fp16
  (and one rstd per row, left out);
- each projection whose weight is trained, or that carries an adapter, keeps its input in the compute dtype. Under
  autocast each projection keeps its own cast copy (q, k and v: three); without it, projections that read one
  tensor share it (q/k/v, gate/up). An adapter's down-projection (A) keeps its r-wide output for B;
- the attention kernel keeps q, k, v and its output: in fp32 on a CPU (its flash kernel is called per sequence in
  fp32 below packed_attention.BF16_FLASH_FROM tokens; kernels/sequences_apart.py), in the compute dtype on a GPU;
- the SiLU product keeps the gate's and the up projection's outputs (kernels/swiglu.py); the down projection's input is
  the projections' rule above.

Every other model keeps the usual count (plan/memory.py). The per-token widths are read from the model built on
the meta device (model_facts.py), with its adapter and freezing, so only the projections that keep their input
are counted. tests/test_activation_count.py compares this count with what autograd keeps in a real step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the projections of a LLaMA layer that read one tensor, by the name of their group; tensor parallel leaves the
# inputs of the first and third whole on every rank and splits the others (the heads', the MLP's)
PROJECTION_GROUPS = {"q_proj": "attention input", "k_proj": "attention input", "v_proj": "attention input",
                     "o_proj": "attention output", "gate_proj": "mlp input", "up_proj": "mlp input",
                     "down_proj": "mlp product"}
WHOLE_UNDER_TP = ("attention input", "mlp input")


@dataclass(frozen=True)
class DecoderLayers:
    """Per-token widths (values, summed over the layers) of what LLaMA-formula decoder layers keep."""
    layers: int
    hidden: int
    norms: int  # the norms' inputs (two a layer)
    attention: int  # q, k, v and the kernel's output
    gate_and_up: int  # the SiLU product's two inputs
    inputs_each: dict  # group → the kept inputs counted once per projection (autocast: a cast copy each)
    inputs_shared: dict  # group → the kept inputs counted once per group (no casts: one tensor read by all)
    adapter_outputs: int  # the adapters' r-wide outputs of A

    def bytes_per_token(self, *, compute_bytes: int, residual_bytes: int, attention_bytes: int, casts: bool,
                        tensor_parallel: int = 1) -> float:
        """Every layer's kept bytes for one token (on one tp rank: the heads' and the MLP's part divided)."""
        inputs = self.inputs_each if casts else self.inputs_shared
        whole = sum(width for group, width in inputs.items() if group in WHOLE_UNDER_TP)
        split = sum(inputs.values()) - whole + self.adapter_outputs
        whole_bytes = self.norms * residual_bytes + whole * compute_bytes
        split_bytes = self.attention * attention_bytes + (self.gate_and_up + split) * compute_bytes
        return whole_bytes + split_bytes / tensor_parallel


def llama_decoder_layers(model: torch.nn.Module, layers_expected: int) -> DecoderLayers | None:
    """The widths of `model`'s decoder layers (built on meta, with its adapter and freezing), or None where any
    layer is not of the LLaMA formula (another family keeps the usual count)."""
    from tuneloop.kernels import rms_norm, swiglu

    layers = [module for module in model.modules()
              if all(hasattr(module, name) for name in ("self_attn", "mlp", "input_layernorm",
                                                        "post_attention_layernorm"))]
    if not layers or len(layers) != layers_expected:
        return None
    norms = attention = gate_and_up = adapter_outputs = 0
    inputs_each: dict[str, int] = {}
    inputs_shared: dict[str, int] = {}
    hidden = 0
    for layer in layers:
        projections = {name: getattr(layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp,
                                     name, None) for name in PROJECTION_GROUPS}
        if (not swiglu.replaceable(layer.mlp) or not rms_norm.replaceable(layer.input_layernorm)
                or not rms_norm.replaceable(layer.post_attention_layernorm)
                or any(projection is None for projection in projections.values())):
            return None
        base = {name: getattr(projection, "base_layer", projection) for name, projection in projections.items()}
        hidden = base["q_proj"].in_features
        norms += 2 * hidden
        attention += 2 * base["q_proj"].out_features + 2 * base["k_proj"].out_features
        gate_and_up += 2 * base["gate_proj"].out_features
        kept_groups = set()
        for name, projection in projections.items():
            rank = _adapter_rank(projection)
            if rank or any(parameter.requires_grad for parameter in base[name].parameters()):
                group = PROJECTION_GROUPS[name]
                inputs_each[group] = inputs_each.get(group, 0) + base[name].in_features
                if group not in kept_groups:
                    inputs_shared[group] = inputs_shared.get(group, 0) + base[name].in_features
                    kept_groups.add(group)
                adapter_outputs += rank
    return DecoderLayers(len(layers), hidden, norms, attention, gate_and_up, inputs_each, inputs_shared,
                         adapter_outputs)


def _adapter_rank(projection) -> int:
    """A peft LoRA layer's rank (its A's outputs), 0 for a plain projection."""
    down = getattr(projection, "lora_A", None)
    return sum(module.out_features for module in down.values()) if down else 0
