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

from tuneloop.distributed import deepspeed_16bit_weights
from tuneloop.hardware import quantized_loading
from tuneloop.model import ModelFacts
from tuneloop.optim import OPTIMIZERS
from tuneloop.train.chunked_loss import chunk_tokens

ACTIVATION_VALUES_PER_TOKEN_HIDDEN = 34


@dataclass
class MemoryEstimate:
    """Per rank: what one device holds (total_gb), and what each rank keeps in host memory when offloading."""
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
    engine: str = "one process"  # how the ranks share the model (distributed.py's description)
    world_size: int = 1
    gathered_gb: float = 0.0  # a sharded model's weights gathered whole while they compute (root + 2 layers)
    host_gb: float = 0.0  # offloaded to host memory, per rank
    per_rank_bytes: dict | None = None  # unrounded weights/optimizer bytes per rank (compared with the engine's own)


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


def estimate_memory(cfg, facts: ModelFacts, tokens_per_micro_batch: int, precision: str, world_size: int = 1,
                    device_gb: float | None = None) -> MemoryEstimate:
    """Memory per rank. Weights, gradients and optimizer state are divided by the world size where the engine
    shards them (distributed.py: FSDP2 all three, ZeRO-1 the optimizer, ZeRO-2 also gradients, ZeRO-3 all three),
    and moved to host memory where it offloads them. `device_gb` overrides this machine's device (planning a launch
    elsewhere: `tuneloop plan --device-memory 80`)."""
    dist = cfg.distributed
    config = facts.config
    params, trainable = facts.parameters, facts.trainable_parameters
    # fp32 weights (autocast computes in bf16) unless loaded in bf16/fp16; 4-bit NF4 or 8-bit when quantized
    parameter_bytes = 2 if cfg.bfloat16 or cfg.float16 else 4
    # DeepSpeed's ZeRO optimizer steps an fp32 copy of the weights (flat partitions): at stages 1 and 2 always (counted
    # there: 12 bytes per parameter over N ranks with Adam), at stage 3 when the model's own weights are 16-bit
    master_bytes = 0
    if dist.engine == "deepspeed" and dist.zero_stage:
        sixteen_bit = deepspeed_16bit_weights(dist, precision)
        master_bytes = 4 if dist.zero_stage < 3 or sixteen_bit else 0
        parameter_bytes = 2 if sixteen_bit else parameter_bytes
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
    weights = params * weight_bytes
    grads = trainable * trained_bytes
    # the optimizer's states follow the weights it steps: DeepSpeed's are its fp32 masters
    state_bytes = OPTIMIZERS[cfg.optimizer].state_bytes_per_param * (1 if master_bytes else trained_bytes / 4)
    optimizer = trainable * (state_bytes + master_bytes)
    ranks = max(world_size, 1)
    weights /= ranks if dist.shards_weights else 1
    grads /= ranks if dist.shards_gradients else 1
    optimizer /= ranks if dist.shards_optimizer else 1
    if dist.engine == "fsdp2" and cfg.gradient_accumulation_steps > 1:
        # FSDP2 skips the reduce-scatter in a step's non-final micro-batches, keeping each gradient whole (fp32)
        # until the last one: bandwidth saved, memory spent
        grads += trainable * 4
    gathered = 0.0
    if dist.shards_weights:  # the root group (embeddings, head) and the running and prefetched layer, whole
        outside_layers = max(params - _layer_parameters(config) * layers, 0)
        compute_bytes = 2 if precision in ("bf16", "fp16") else weight_bytes
        gathered = (outside_layers + 2 * _layer_parameters(config)) * compute_bytes
        if not dist.reshard_after_forward:  # kept gathered from forward to backward
            gathered = params * compute_bytes
    host = 0.0
    if dist.offload_weights:
        host += weights + (grads if dist.engine == "fsdp2" else 0)
        weights, grads = 0.0, (0.0 if dist.engine == "fsdp2" else grads)
    if dist.offload_optimizer:
        host += optimizer
        optimizer = 0.0
    gb = 1e9
    device, here_gb = device_memory_gb()
    if device_gb is not None:
        device = "each device (--device-memory)"
    from tuneloop.rl_methods import keeps_reference_copy

    reference = params * weight_bytes / gb if keeps_reference_copy(cfg) else 0.0
    total = (weights + grads + optimizer + activations + gathered) / gb + reference
    return MemoryEstimate(params, trainable, round(weights / gb, 3), round(grads / gb, 3), round(optimizer / gb, 3),
                          round(activations / gb, 3), round(total, 3), device,
                          round(device_gb if device_gb is not None else here_gb, 2) if (device_gb or here_gb) else None,
                          round(reference, 3), dist.describe(world_size), world_size, round(gathered / gb, 3),
                          round(host / gb, 3), {"weights": int(weights), "optimizer": int(optimizer)})


def _layer_parameters(config) -> int:
    """One decoder layer's parameters, from the config (attention with grouped keys/values, a gated MLP)."""
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", 0) or 4 * hidden
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return attention + 3 * hidden * intermediate + 2 * hidden
