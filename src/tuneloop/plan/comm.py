"""Communication per rank per optimizer step: the bytes each rank sends over the network in one optimizer step. It
receives as many (every collective counted here is symmetric); the bytes follow from the engine, the device mesh and the
widths the engine really moves. Counted as ring algorithms move them (NCCL's and gloo's for large messages):

    all-reduce of S bytes over n ranks      2 (n - 1) / n × S   (a reduce-scatter, then an all-gather)
    all-gather of S bytes (whole) over n    (n - 1) / n × S
    reduce-scatter of S bytes over n        (n - 1) / n × S

What each engine moves (read from its code here, and DeepSpeed's 0.19.8 sources for ZeRO):

- DDP: the gradients all-reduced once per step (non-final micro-batches skip the sync), in the gradients' dtype:
  fp32 under autocast and with fp32 masters (masters.py), the weights' width when they are loaded 16-bit.
- FSDP2 (fsdp2.py) over dp_shard ranks: each micro-batch all-gathers the weights in the forward, in bf16 under
  bf16 (MixedPrecisionPolicy param_dtype), and again in the backward when reshard_after_forward: the root group
  (embeddings, head) too, since fsdp2.py passes reshard_after_forward=True to the root as well (torch keeps the
  root gathered only when the argument is left to it). The gradients are reduce-scattered once per step, in fp32
  (reduce_dtype, or the fp32 weights' own): non-final micro-batches skip it (set_requires_gradient_sync).
  gloo (CPU) has no ring reduce-scatter: it all-reduces and keeps the shard, 2 (n - 1) / n × S (measured:
  tests/test_comm_volume.py); NCCL's is (n - 1) / n × S.
- HSDP: as FSDP2 within a group of dp_shard ranks, plus the all-reduce of each rank's gradient shard across the
  dp_replicate groups, once per step.
- DeepSpeed ZeRO-1/2: the gradients all-reduced in DeepSpeed's communication_data_type (the file's, else the
  16-bit dtype it trains in, else fp32: `use_multi_rank_bucket_allreduce` is on by default; off, each slice is
  reduced to its owner, half the bytes), once per step at ZeRO-1, each micro-batch at ZeRO-2 (its backward hooks
  reduce as gradients are made); then the updated 16-bit (or fp32) weights all-gathered from their owners.
  ZeRO-0: the all-reduce alone. ZeRO-3: each micro-batch all-gathers the weights in the forward and again in the
  backward and reduce-scatters the gradients; nothing after the step (the weights stay partitioned).

Not counted: the first broadcast of the weights, the loss's and the norm's scalars, DDP's buffer broadcasts (a
rotary table's few hundred bytes), the padding of odd-sized shards, ZeRO-3's small weights that stay gathered
(below stage3_param_persistence_threshold): each under a percent for a real model.

Tensor and context parallelism add their own traffic per layer (`model_parallel_transfers`): TP all-reduces
hidden states (once per split projection), and FSDP2 under TP gathers and reduces one tp rank's share of the layers;
CP (Ulysses) exchanges q, k, v and the attention output with all-to-alls. Under CP the gradient
collectives run over data × cp ranks (DDP averages over every rank; FSDP2 shards over dp_shard × cp).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tuneloop.engines.base import EngineSpec, WholeBytes
from tuneloop.engines.mesh import Mesh

WIDTH_NAMES = {4: "fp32", 2: "bf16", 1: "8-bit", 0.5: "4-bit"}
DEEPSPEED_DTYPES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Transfer:
    """One collective of the step, as the plan names it, and the bytes each rank sends for it in a step."""

    what: str
    bytes: float


@dataclass(frozen=True)
class Communication:
    transfers: tuple[Transfer, ...]

    @property
    def total(self) -> float:
        return sum(transfer.bytes for transfer in self.transfers)

    def words(self) -> str:
        """The plan's line: the total and what makes it."""
        if not self.transfers:
            return "none (one data rank: nothing to reduce)"
        parts = "; ".join(f"{transfer.what} {_size(transfer.bytes)}" for transfer in self.transfers)
        return f"{_size(self.total)} sent by each rank (as much received): {parts}"

    def to_json(self) -> dict:
        return {"bytes_per_rank_per_step": round(self.total),
                "transfers": [{"what": transfer.what, "bytes": round(transfer.bytes)} for transfer in self.transfers]}


def all_reduce(size: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * size if ranks > 1 else 0.0


def all_gather(size: float, ranks: int) -> float:
    return (ranks - 1) / ranks * size if ranks > 1 else 0.0


reduce_scatter = all_gather  # the same bytes, the other way round


def communication_per_step(engine: EngineSpec, whole: WholeBytes, world_size: int, accumulation: int,
                           precision: str, masters: bool = False, backend: str = "nccl") -> Communication:
    """What each rank sends in one optimizer step of `accumulation` micro-batches (module docstring); `backend`:
    the process group's, "nccl" (GPUs) or "gloo" (CPUs), which reduce-scatter differently."""
    mesh = engine.mesh(world_size)
    if engine.name == "fsdp2":
        transfers = _fsdp2(engine, whole, mesh, accumulation, precision, backend)
    elif engine.name == "deepspeed":
        transfers = _zero(engine, whole, mesh, accumulation, precision)
    else:
        transfers = _ddp(whole, mesh, masters)
    transfers += model_parallel_transfers(whole, mesh, accumulation, precision)
    return Communication(tuple(transfer for transfer in transfers if transfer.bytes > 0))


def model_parallel_transfers(whole: WholeBytes, mesh: Mesh, accumulation: int, precision: str) -> list[Transfer]:
    """Tensor and context parallelism's activation collectives per layer; nothing while the mesh has no tp or cp
    axis. (Activation checkpointing's recomputed forward is not counted.)"""
    width = 2 if precision in ("bf16", "fp16") else 4
    transfers = []
    if mesh.tp > 1:
        # each row-wise projection (LLaMA's o_proj, down_proj) sums its output over the tp ranks in the forward,
        # and each column-wise one (q, k, v, gate, up) its input's gradient in the backward, one all-reduce of a
        # micro-batch's hidden states each: torch's ColwiseParallel makes its own input replicated, so q, k and v
        # reduce apart (7 a LLaMA layer; measured on the wire: tests/test_comm_volume.py)
        hidden_states = whole.micro_batch_tokens * whole.hidden_size * width
        reduces = whole.rowwise_projections + whole.colwise_projections
        per_step = reduces * whole.layers * accumulation * all_reduce(hidden_states, mesh.tp)
        transfers.append(Transfer(f"tensor-parallel all-reduces of {WIDTH_NAMES.get(width, 'fp32')} hidden states "
                                  f"({reduces} a layer, at the largest micro-batch)", per_step))
    if mesh.cp > 1:
        # Ulysses (context_parallel.py): per layer, all-to-alls of q, k, v (this rank's slice of every head to
        # every position of its heads) and of the output back, and the same four in the backward; an all-to-all
        # of S bytes sends (n - 1) / n × S
        exchanged = whole.micro_batch_tokens / mesh.cp * (2 * whole.attention_width + 2 * whole.kv_width) * width
        per_step = 2 * whole.layers * accumulation * all_gather(exchanged, mesh.cp)
        transfers.append(Transfer(f"context-parallel all-to-alls of {WIDTH_NAMES.get(width, 'fp32')} q, k, v and "
                                  "attention outputs", per_step))
    return transfers


def _ddp(whole: WholeBytes, mesh: Mesh, masters: bool) -> list[Transfer]:
    ranks = mesh.dp_replicate * mesh.dp_shard * mesh.cp  # (context-parallel ranks average their parts too)
    width = 4 if masters else _width(whole.gradients, whole.trainable)
    return [Transfer(f"all-reduce of {WIDTH_NAMES.get(width, f'{width:g}-byte')} gradients",
                     all_reduce(whole.trainable * width, ranks))]


def _fsdp2(engine, whole: WholeBytes, mesh: Mesh, accumulation: int, precision: str,
           backend: str) -> list[Transfer]:
    shard, replicas = mesh.dp_shard * mesh.cp, mesh.dp_replicate  # (FSDP2 shards over dp_shard × cp)
    if mesh.tp > 1:  # each tp rank's data ranks gather and reduce its share of the layers, and the whole rest
        from tuneloop.engines.tensor_parallel import split_share

        share = split_share(whole, mesh.tp)
        whole = replace(whole, weights=whole.weights * share, gradients=whole.gradients * share,
                        parameters=round(whole.parameters * share), trainable=round(whole.trainable * share))
    gathered_width = 2 if precision in ("bf16", "fp16") and not whole.unsharded_weights else None
    gathered = (whole.parameters * gathered_width if gathered_width
                else whole.weights - whole.unsharded_weights)
    times = 2 if engine.reshard_after_forward else 1  # (the root too: see the module's docstring)
    gather_name = WIDTH_NAMES.get(gathered_width or _width(gathered, whole.parameters), "held")
    reduce_width = 4 if precision in ("bf16", "fp16") else _width(whole.gradients, whole.trainable)
    gradients = whole.trainable * reduce_width
    passes = "forward and backward" if engine.reshard_after_forward else "forward"
    transfers = [
        Transfer(f"all-gather of {gather_name} weights in each micro-batch's {passes}",
                 accumulation * all_gather(gathered * times, shard)),
        Transfer(f"reduce-scatter of {WIDTH_NAMES.get(reduce_width, 'the')} gradients"
                 + (" (gloo: as an all-reduce)" if backend == "gloo" and shard > 1 else ""),
                 (all_reduce if backend == "gloo" else reduce_scatter)(gradients, shard)),
    ]
    if replicas > 1:
        transfers.append(Transfer(f"all-reduce of the gradient shards across {replicas} replicas",
                                  all_reduce(gradients / shard, replicas)))
    return transfers


def _zero(engine, whole: WholeBytes, mesh: Mesh, accumulation: int, precision: str) -> list[Transfer]:
    ranks = mesh.dp_replicate * mesh.dp_shard
    sixteen = engine.sixteen_bit_weights(precision)
    configured = str(engine.config.get("communication_data_type") or "").lower()
    reduce_width = DEEPSPEED_DTYPES.get(configured) or (2 if sixteen else 4)
    weight_width = 2 if sixteen else _width(whole.weights, whole.parameters)
    gradients = whole.trainable * reduce_width
    name = WIDTH_NAMES.get(reduce_width, "the")
    weight_name = WIDTH_NAMES.get(weight_width, "held")
    if engine.stage == 3:
        return [Transfer(f"all-gather of {weight_name} weights in each micro-batch's forward and backward",
                         accumulation * all_gather(2 * whole.parameters * weight_width, ranks)),
                Transfer(f"reduce-scatter of {name} gradients in each micro-batch",
                         accumulation * reduce_scatter(gradients, ranks))]
    per_step = accumulation if engine.stage == 2 else 1
    zero = engine.config.get("zero_optimization") or {}
    if engine.stage and not zero.get("use_multi_rank_bucket_allreduce", True):
        reduced = Transfer(f"reduce of {name} gradients to their owners", per_step * reduce_scatter(gradients, ranks))
    else:
        reduced = Transfer(f"all-reduce of {name} gradients" + (" in each micro-batch" if per_step > 1 else ""),
                           per_step * all_reduce(gradients, ranks))
    if not engine.stage:
        return [reduced]
    return [reduced, Transfer(f"all-gather of the updated {weight_name} weights",
                              all_gather(whole.trainable * weight_width, ranks))]


def _width(total: float, count: int) -> float:
    width = total / max(count, 1)
    return min(WIDTH_NAMES, key=lambda known: abs(known - width)) if width else 4


def _size(count: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"
