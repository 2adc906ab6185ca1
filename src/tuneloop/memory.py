"""A memory estimate for the plan: weights, gradients, optimizer state and activations.

It is an estimate from the model's config (built on the meta device: no weights are read)
and the plan's largest micro-batch, meant to catch a run that cannot fit before it starts,
not to predict the allocator's peak to the megabyte. Activations follow the usual
per-layer count for a transformer with fused attention (about 34 values per token and
hidden unit, no s² attention matrix), plus the logits and their gradient in float32: one chunk of
them with the chunked loss (train/chunked_loss.py), the whole micro-batch's otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tuneloop.hardware import quantized_loading
from tuneloop.model import ModelFacts
from tuneloop.optim import OPTIMIZERS
from tuneloop.train.chunked_loss import chunk_tokens

ACTIVATION_VALUES_PER_TOKEN_HIDDEN = 34


@dataclass
class MemoryEstimate:
    parameters: int
    trainable_parameters: int
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float
    total_gb: float
    device: str
    device_gb: float | None
    reference_gb: float = 0.0  # preference training's frozen reference copy (full fine-tuning, computed live)


def device_memory_gb() -> tuple[str, float | None]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 1e9
    except ImportError:
        pass
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return "cpu (system memory)", int(line.split()[1]) * 1024 / 1e9
    return "cpu", None


def estimate_memory(cfg, facts: ModelFacts, tokens_per_micro_batch: int, precision: str) -> MemoryEstimate:
    config = facts.config
    params, trainable = facts.parameters, facts.trainable_parameters
    # fp32 weights (autocast computes in bf16) unless loaded in bf16/fp16; 4-bit NF4 or 8-bit when quantized
    parameter_bytes = 2 if cfg.bfloat16 or cfg.float16 else 4
    weight_bytes = {"4bit": 0.5, "8bit": 1}.get(quantized_loading(cfg), parameter_bytes)
    trained_bytes = 4 if cfg.adapter else parameter_bytes  # gradients and Adam states follow the trained weights
    act_bytes = 2 if precision in ("bf16", "fp16") else 4
    hidden = getattr(config, "hidden_size", 0)
    layers = getattr(config, "num_hidden_layers", 0)
    vocab = getattr(config, "vocab_size", 0)
    per_layer = tokens_per_micro_batch * hidden * act_bytes
    if cfg.gradient_checkpointing:  # layer inputs kept, one layer recomputed at a time
        activations = per_layer * (layers + ACTIVATION_VALUES_PER_TOKEN_HIDDEN)
    else:
        activations = per_layer * layers * ACTIVATION_VALUES_PER_TOKEN_HIDDEN
    if facts.chunked_loss:  # one chunk's fp32 logits and their gradient, and the head's gradient buffer
        activations += min(tokens_per_micro_batch, chunk_tokens(vocab)) * vocab * 4 * 2 + vocab * hidden * 4
    else:  # the whole micro-batch's logits in fp32 and their gradient
        activations += tokens_per_micro_batch * vocab * 4 * 2
    gb = 1e9
    weights, grads = params * weight_bytes / gb, trainable * trained_bytes / gb
    optimizer = trainable * OPTIMIZERS[cfg.optimizer].state_bytes_per_param * trained_bytes / 4 / gb
    device, device_gb = device_memory_gb()
    from tuneloop.rl_methods import keeps_reference_copy

    reference = weights if keeps_reference_copy(cfg) else 0.0
    total = weights + grads + optimizer + activations / gb + reference
    return MemoryEstimate(params, trainable, round(weights, 3), round(grads, 3), round(optimizer, 3),
                          round(activations / gb, 3), round(total, 3), device,
                          round(device_gb, 1) if device_gb else None, round(reference, 3))

