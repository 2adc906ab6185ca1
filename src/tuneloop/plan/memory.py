"""A memory estimate for the plan: weights, gradients, optimizer state and activations.

It is an estimate from the model's config (built on the meta device: no weights are read)
and the plan's largest micro-batch, meant to catch a run that cannot fit before it starts,
not to predict the allocator's peak to the megabyte. Activations are what LLaMA-formula
layers keep, tensor by tensor (plan/activations.py), or for other models the usual
per-layer count for a transformer with fused attention (about 34 values per token and
hidden unit, no s² attention matrix); plus the logits and their gradient in float32: one chunk of
them with the chunked loss (train/chunked_loss.py), the whole micro-batch's otherwise. How the engine divides
the rest over the ranks is the engine's to say (engines/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tuneloop.engines.base import WholeBytes
from tuneloop.errors import UserError
from tuneloop.host.hardware import quantized_loading
from tuneloop.plan.model_facts import ModelFacts
from tuneloop.optim import OPTIMIZERS
from tuneloop.kernels.output_head import chunk_tokens
from tuneloop.rl_methods import keeps_reference_copy

ACTIVATION_VALUES_PER_TOKEN_HIDDEN = 34
# of those, what tensor parallel leaves whole on every tp rank (the layer norms' and the residual stream's; the
# projections' inputs and dropout masks): the rest, the heads' and the MLP's own, is divided over the tp ranks
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": 10 + 24 / t without
# sequence parallel, which tuneloop does not do)
ACTIVATION_VALUES_WHOLE_UNDER_TP = 10


@dataclass(kw_only=True)
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
    engine: str = "one process"  # how the ranks share the model (the engine's description)
    world_size: int = 1
    gathered_gb: float = 0.0  # a sharded model's weights gathered whole while they compute (root + 2 layers)
    vision_activations_gb: float = 0.0  # of activations_gb, a vision-language model's tower's
    host_gb: float = 0.0  # offloaded to host memory, per rank
    generation_gb: float = 0.0  # online RL: the KV cache of a step's generation (it and the activations never meet)
    # fp32 masters with one micro-batch a step: the gradients the optimizer steps, made after the backward (when the
    # activations are gone); gradients_gb is then what the backward holds (engines/masters.py)
    gradients_after_backward_gb: float = 0.0
    # unrounded weights/optimizer/gradients bytes per rank (the first two compared with the engine's own)
    per_rank_bytes: dict | None = None
    process_gb: float = 0.0  # on a CPU: the process's own libraries, which share the host's memory (process_memory.py)
    kernel_caches_gb: float = 0.0  # on a CPU in 16 bits: its matmul kernel caches, full (host/kernel_caches.py)


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


def estimate_memory(cfg, facts: ModelFacts, tokens_per_micro_batch: int, precision: str, engine,
                    world_size: int = 1, device_gb: float | None = None,
                    generated_positions: int = 0, masters: bool = False,
                    frozen_bf16: bool = False, tensor_parallel: int = 1,
                    vision_activations: float = 0.0, checkpointing: bool | str = False) -> MemoryEstimate:
    """Memory per rank. Weights, gradients and optimizer state are divided by the world size where the engine
    shards them (FSDP2 all three, ZeRO-1 the optimizer, ZeRO-2 also gradients, ZeRO-3 all three) and moved to
    host memory where it offloads them: each engine says its share (engines/: `per_rank`). `device_gb` overrides
    this machine's device (planning a launch elsewhere: `tuneloop plan --device-memory 80`). `generated_positions`:
    online RL's positions in one generation batch (its completions × their longest prompt + completion), whose KV
    cache is held while it generates, when the training activations are not. `masters`: the trained weights only
    matmuls read are held in bf16 for the model and in fp32 for the optimizer; their gradients are fp32 when the
    optimizer steps, but with one micro-batch a step the backward holds them in bf16 and the fp32 ones are made
    after it, in the activations' place (engines/masters.py): the peak is then the larger of the two moments.
    `frozen_bf16`: an adapter's frozen base holds its matmul-only weights in bf16.
    `tensor_parallel`: the tp ranks a layer's heads and MLP are split over (their activations with them).
    `vision_activations`: a vision-language model's tower's, for the largest micro-batch (vision_activation_bytes).
    `checkpointing`: the run's activation checkpointing (resolved.gradient_checkpointing)."""
    params = facts.parameters
    whole = whole_bytes(cfg, facts, precision, engine, masters, frozen_bf16)
    weight_bytes = whole.weight_bytes
    share = engine.per_rank(whole, world_size, cfg.gradient_accumulation_steps, precision)
    gb = 1e9
    device, here_gb = device_memory_gb()
    on_cpu = device_gb is None and device.startswith("cpu")  # (planning for other devices: --device-memory)
    activations = (_activations(cfg, facts, tokens_per_micro_batch, precision, tensor_parallel, on_cpu,
                                checkpointing=checkpointing)
                   + vision_activations)
    if device_gb is not None:
        device = "each device (--device-memory)"
    # (a reference model is loaded as the config loads weights: fp32 beside a model with masters)
    reference = params * (4 if masters else weight_bytes) / gb if keeps_reference_copy(cfg) else 0.0
    generation = kv_cache_bytes(facts.text_config, generated_positions, 2 if cfg.bfloat16 or cfg.float16 else 4)
    gradients = share.gradients  # held beside the activations
    after_backward = 0.0  # held once the activations are gone (fp32 gradients made after a lone micro-batch's)
    if masters and cfg.gradient_accumulation_steps == 1:
        gradients -= facts.matmul_only_trained * 2  # (world size 1 or DDP: the engine divides nothing)
        after_backward = share.gradients
    process = kernel_caches = 0.0
    if on_cpu:
        from tuneloop.plan.process_memory import kernel_caches_bytes, process_memory_bytes

        process = process_memory_bytes()
        if precision in ("bf16", "fp16") or cfg.bfloat16 or cfg.float16:  # (fp32 matmuls go to MKL: no such cache)
            kernel_caches = kernel_caches_bytes()
    total = (process + kernel_caches + share.weights + share.optimizer + max(gradients + max(activations, generation), after_backward)
             + share.gathered) / gb + reference
    device_total = device_gb if device_gb is not None else here_gb
    return MemoryEstimate(
        parameters=params, trainable_parameters=whole.trainable, weights_gb=round(share.weights / gb, 3),
        gradients_gb=round(gradients / gb, 3), optimizer_gb=round(share.optimizer / gb, 3),
        activations_gb=round(activations / gb, 3), total_gb=round(total, 3), device=device,
        device_gb=round(device_total, 2) if device_total else None, reference_gb=round(reference, 3),
        engine=engine.describe(world_size), world_size=world_size, gathered_gb=round(share.gathered / gb, 3),
        host_gb=round(share.host / gb, 3), generation_gb=round(generation / gb, 3),
        vision_activations_gb=round(vision_activations / gb, 3),
        gradients_after_backward_gb=round(after_backward / gb, 3), process_gb=round(process / gb, 3),
        kernel_caches_gb=round(kernel_caches / gb, 3),
        per_rank_bytes={"weights": int(share.weights), "optimizer": int(share.optimizer), "gradients": int(gradients),
                        **({"vision_activations": int(vision_activations)} if vision_activations else {})})


def whole_bytes(cfg, facts: ModelFacts, precision: str, engine, masters: bool = False,
                frozen_bf16: bool = False) -> WholeBytes:
    """One whole copy of what training holds, before the engine divides it (the memory estimate's and the
    communication's starting point: plan/comm.py)."""
    config = facts.text_config
    params, trainable = facts.parameters, facts.trainable_parameters
    # fp32 weights (autocast computes in bf16) unless loaded in bf16/fp16, as the engine holds them (an MXFP4
    # checkpoint's experts too: they are dequantized into that dtype as they load, quant/mxfp4.py); 4-bit NF4 or
    # 8-bit when quantized; an fp32 master copy where the engine's optimizer steps one (DeepSpeed)
    parameter_bytes, master_bytes = engine.held_widths(2 if cfg.bfloat16 or cfg.float16 else 4, precision)
    trained_bytes = 4 if cfg.adapter else parameter_bytes  # gradients and Adam states follow the trained weights
    quantized = quantized_weights_bytes(cfg, facts)
    held_weights = sum(quantized) if quantized else params * parameter_bytes
    bf16_copies = facts.matmul_only_trained if masters else 0  # held in bf16, with fp32 masters the optimizer steps
    if masters:  # (the other weights stay fp32 and are stepped as they are; the optimizer steps fp32 gradients)
        held_weights, trained_bytes = params * 4 - bf16_copies * 2, 4
    if frozen_bf16:  # (an adapter's frozen base: its matmul-only weights in bf16, no masters: they never change)
        held_weights -= facts.matmul_only_frozen * 2
    if cfg.adapter:
        held_weights += trainable * trained_bytes  # the adapter's own weights, beside the base
    weight_bytes = held_weights / max(params, 1)  # as held on average (the reference copy, the engines' shares)
    # the optimizer's states follow the weights it steps: the masters', where there are masters
    kind, width = OPTIMIZERS[cfg.optimizer], (1 if master_bytes else trained_bytes / 4)
    states = trainable * kind.state_bytes_per_param * width
    if kind.hidden_matrix_state_bytes is not None:  # (Muon keeps less for the matrices it orthogonalises)
        states -= facts.hidden_matrices_trained * (kind.state_bytes_per_param - kind.hidden_matrix_state_bytes) * width
    layers = getattr(config, "num_hidden_layers", 0)
    whole = WholeBytes(weights=held_weights, gradients=trainable * trained_bytes,
                       optimizer=states + trainable * master_bytes + bf16_copies * 4, parameters=params,
                       trainable=trainable,
                       weight_bytes=weight_bytes, layer_parameters=_layer_parameters(config), layers=layers,
                       unsharded_weights=quantized[1] if quantized else 0.0)
    return whole


def kv_cache_bytes(config, positions: int, value_bytes: int) -> float:
    """Keys and values of every layer at `positions` positions (grouped-query heads counted as they are stored)."""
    if not positions:
        return 0.0
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(heads, 1)
    return float(positions * layers * 2 * kv_heads * head_dim * value_bytes)


def quantized_weights_bytes(cfg, facts: ModelFacts) -> tuple[float, float] | None:
    """The base's bytes when bitsandbytes loads it quantized (None otherwise), as its tensors hold them, in two parts:
    (the packed weights and the unquantized layers, which a sharding engine divides; the scales and code books,
    which every rank keeps whole with its layers). NF4/FP4 packs two weights a byte with one absmax per 64-weight
    block (a byte, and an fp32 per 256 blocks, with double quantization; an fp32 without); int8 a byte a weight and
    an fp32 scale per row. The layers it does not quantize (the output head, embeddings, norms, and a MoE model's
    3-D experts unless `quantize_moe_experts`) are fp32: peft's preparation upcasts them. Each 4-bit tensor keeps
    its 16-value code book (and the 256-value one of its absmax, quantized twice)."""
    kind = quantized_loading(cfg)
    if not kind:
        return None
    weights, rows, layers = facts.quantizable
    if cfg.quantize_moe_experts and kind == "4bit":  # the expert weights too, each tensor with its own code book
        weights, layers = weights + facts.experts[0], layers + facts.experts[1]
    if kind == "8bit":
        packed, scales = weights * 1, rows * 4
    else:
        double = bool((cfg.bnb_config_kwargs or {}).get("bnb_4bit_use_double_quant", True))
        packed = weights * 0.5
        scales = weights * (1 / 64 + 4 / (64 * 256) if double else 4 / 64) + layers * 4 * (16 + 256 * double)
    # peft's preparation for k-bit training casts every unquantized fp16/bf16 parameter to fp32
    return packed + (facts.parameters - weights) * 4, scales


def _activations(cfg, facts: ModelFacts, tokens_per_micro_batch: int, precision: str,
                 tensor_parallel: int = 1, on_cpu: bool = False, *, checkpointing: bool | str = False) -> float:
    """The decoder layers' (LLaMA-formula layers counted as plan/activations.py says; others by the usual count:
    ACTIVATION_VALUES_PER_TOKEN_HIDDEN values per token and hidden unit a layer, the heads' and MLP's part divided
    over the tp ranks), plus the logits and their gradient in fp32: one chunk's with the chunked loss, the whole
    micro-batch's otherwise (the head is whole on every tp rank). Under gradient checkpointing each layer keeps its
    input and one layer at a time keeps the rest, while it is recomputed."""
    config = facts.text_config
    weights_half = bool(cfg.bfloat16 or cfg.float16)  # loaded in bf16/fp16: no autocast casts, a half residual
    act_bytes = 2 if precision in ("bf16", "fp16") or weights_half else 4
    residual_bytes = 2 if weights_half else 4
    hidden = getattr(config, "hidden_size", 0)
    layers = getattr(config, "num_hidden_layers", 0)
    vocab = getattr(config, "vocab_size", 0)
    counted = facts.decoder_layers
    if counted is not None:
        every_layer = tokens_per_micro_batch * counted.bytes_per_token(
            compute_bytes=act_bytes, residual_bytes=residual_bytes, attention_bytes=4 if on_cpu else act_bytes,
            casts=precision in ("bf16", "fp16") and not weights_half, tensor_parallel=tensor_parallel)
        layer_inputs = tokens_per_micro_batch * counted.hidden * residual_bytes * counted.layers
        activations = (layer_inputs + every_layer / max(counted.layers, 1) if checkpointing else every_layer)
    else:
        per_layer = tokens_per_micro_batch * hidden * act_bytes
        values = ACTIVATION_VALUES_WHOLE_UNDER_TP + (
            ACTIVATION_VALUES_PER_TOKEN_HIDDEN - ACTIVATION_VALUES_WHOLE_UNDER_TP) / tensor_parallel
        if checkpointing:  # layer inputs kept (whole on every tp rank), one layer recomputed at a time
            activations = per_layer * (layers + values)
        else:
            activations = per_layer * layers * values
    if facts.chunked_loss:  # one chunk's fp32 logits and their gradient, and the head's gradient buffer
        activations += min(tokens_per_micro_batch, chunk_tokens(vocab)) * vocab * 4 * 2 + vocab * hidden * 4
    else:  # the whole micro-batch's logits in fp32 and their gradient
        activations += tokens_per_micro_batch * vocab * 4 * 2
    return activations


def vision_activation_bytes(vision, positions: int, precision: str, checkpointing: bool) -> float:
    """What a vision tower keeps for the backward over a micro-batch of `positions` tower positions. A layer keeps
    its activations where the loss's gradient reaches it through a trained weight (at or before it, and not past
    LLaVA's `vision_feature_layer`): about 9 + 1.5 × (its MLP's weights / width²) values per position and width
    unit, so 15 at an MLP of twice the width and 21 at four times (saved-tensor hooks on CLIP towers measured 14.7
    and 21.1, SigLIP's 18.1); under gradient checkpointing, its input only, and one layer's whole while it is
    recomputed. A frozen tower (`freeze_mm_modules`, an adapter on the language model) keeps nothing: its forward
    runs without a graph. (The projector's few values per image token are left out.)"""
    if not positions or vision is None or vision.why_not:
        return 0.0
    width = vision.width
    first_layer = sum(weights for stage, layer, weights, _ in vision.matmuls if stage == "layer" and layer == 0)
    per_position = 9 + 1.5 * max(first_layer - 4 * width * width, 0) / (width * width)
    keeping = [layer for layer in range(min(vision.layers, vision.gradient_layers))
               if any(trained for stage, index, _, trained in vision.matmuls
                      if stage == "patch" or stage == "layer" and index <= layer)]
    if not keeping:
        return 0.0
    values = len(keeping) + per_position if checkpointing else len(keeping) * per_position
    return positions * width * values * (2 if precision in ("bf16", "fp16") else 4)


def memory_warning(estimate: MemoryEstimate) -> str | None:
    """Said in the plan when the estimate exceeds the device."""
    if not (estimate.device_gb and estimate.total_gb > estimate.device_gb):
        return None
    ranks = f" per rank over {estimate.world_size} ranks" if estimate.world_size > 1 else ""
    return (f"estimated memory {estimate.total_gb:.1f} GB{ranks} (weights {estimate.weights_gb:.1f}, gradients "
            f"{estimate.gradients_gb:.1f}, optimizer {estimate.optimizer_gb:.1f}, activations "
            f"{estimate.activations_gb:.1f}) is above the {estimate.device_gb:.0f} GB of {estimate.device}: "
            "lower micro_batch_size or sequence_len, or use gradient_checkpointing, an adapter, or more ranks with "
            "a sharding engine (fsdp, deepspeed zero3).")


MEMORY_REFUSAL_FACTOR = 1.5  # above this multiple of the device's memory, the run would die in the allocator


def check_memory_fits(plan, ranks_sharing_memory: int = 1) -> None:
    """Refuse to start a run whose estimate is far above the device's memory (on a CPU, the ranks of one host
    share its RAM). The estimate is rough, hence the margin; `--ignore-memory-estimate` starts anyway."""
    memory = plan.memory
    if not memory or not memory["device_gb"]:
        return
    needed = memory["total_gb"] * ranks_sharing_memory
    if needed > MEMORY_REFUSAL_FACTOR * memory["device_gb"]:
        ranks = f" for {ranks_sharing_memory} ranks on this host" if ranks_sharing_memory > 1 else ""
        raise UserError(f"plan: the run needs about {needed:.1f} GB{ranks} (weights {memory['weights_gb']:.1f}, "
                        f"activations {memory['activations_gb']:.1f}, ...), more than {MEMORY_REFUSAL_FACTOR}× the "
                        f"{memory['device_gb']:.0f} GB of {memory['device']}. Lower micro_batch_size or "
                        "sequence_len, or use gradient_checkpointing or an adapter; `tuneloop train "
                        "--ignore-memory-estimate` starts anyway.")


def _layer_parameters(config) -> int:
    """One decoder layer's parameters, from the config (attention with grouped keys/values, a gated MLP)."""
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", 0) or 4 * hidden
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return attention + 3 * hidden * intermediate + 2 * hidden
