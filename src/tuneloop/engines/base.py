"""What every engine is: its spec and its runtime, with the defaults most engines share. The spec is what the keys ask
for, read without torch (`check` and the plan use it); the runtime is what the loop and the checkpoints talk to.

A spec says how the engine shares the model: what each rank holds 1/N of and what lives in host memory, its
share of the memory estimate (`per_rank`), its description, and what the machine needs for it. The runtime wraps
the model and its optimizer, accumulates, clips, steps and saves its shards. torch is imported inside the
methods that run, so a spec stays light.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tuneloop.engines.mesh import Mesh, MeshKeys, resolve_mesh

SHARDS = "shards"  # the checkpoint's sub-folder of engine shards (FSDP2, DeepSpeed)


@dataclass(frozen=True, kw_only=True)
class WholeBytes:
    """One whole copy of what training holds, in bytes, before an engine divides or moves it (plan/memory.py)."""

    weights: float
    gradients: float
    optimizer: float
    parameters: int
    trainable: int
    weight_bytes: float  # each weight as held (0.5 for 4-bit, 2 for bf16 weights, 4 for fp32)
    layer_parameters: int  # one decoder layer's, and how many layers there are
    layers: int
    # of `weights`, what every rank keeps whole even when the weights are sharded: the scales and code books of
    # 4/8-bit weights, which bitsandbytes keeps on the layer beside the packed values the engine divides
    unsharded_weights: float = 0.0
    # what tensor parallel's activation traffic is counted from (plan/comm.py): the largest micro-batch's tokens
    # and the hidden size
    micro_batch_tokens: int = 0
    hidden_size: int = 0
    # ... and how many of a layer's projections are split row-wise (their outputs summed over the tp ranks in the
    # forward) and column-wise (their inputs' gradients summed in the backward): the model's tp table's
    rowwise_projections: int = 0
    colwise_projections: int = 0
    # and context parallel's exchange: the widths of one token's queries (and attention output) and keys (values)
    attention_width: int = 0
    kv_width: int = 0


@dataclass(frozen=True, kw_only=True)
class RankBytes:
    """What one rank holds on its device, and what it keeps in host memory instead."""

    weights: float
    gradients: float
    optimizer: float
    gathered: float = 0.0  # a sharded model's weights gathered whole while they compute
    host: float = 0.0


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What the sharding keys ask for. The base is one whole copy of the model on each rank."""

    name: ClassVar[str]
    needs_a_group_alone: ClassVar[bool] = False  # a process group even in one process (FSDP2 and DeepSpeed do)
    # what each rank holds 1/N of
    shards_weights: bool = False
    shards_gradients: bool = False
    shards_optimizer: bool = False
    # what lives in host memory instead of the device's
    offload_weights: bool = False
    offload_optimizer: bool = False
    activation_checkpointing: bool = False  # recompute each layer in the backward (FSDP's own key for it)
    mesh_keys: MeshKeys = MeshKeys()  # axolotl's N-D parallel sizes as written (mesh.py)

    def mesh(self, world_size: int) -> Mesh:
        """The device mesh on `world_size` ranks; a UserError where the sizes cannot make it. An engine that
        divides anything over the ranks fills dp_shard with the ranks no size names, DDP dp_replicate."""
        divides = self.shards_weights or self.shards_gradients or self.shards_optimizer
        return resolve_mesh(self.mesh_keys, world_size, fills_shard=divides)

    @property
    def sharded(self) -> bool:
        """Weights live in pieces on the ranks: the model is gathered to be saved whole (FSDP2, ZeRO-3)."""
        return self.shards_weights

    @property
    def zero_stage(self) -> int | None:
        return None

    @property
    def reduces_on_host(self) -> bool:
        """Gradients (and their norm) live on the host: on GPUs the process group needs gloo beside NCCL."""
        return False

    def identity(self) -> dict:
        """What a checkpoint's shards need of the engine that resumes them (the checkpoint's marker records it)."""
        return {"name": self.name, "zero_stage": self.zero_stage}

    def describe(self, world_size: int | None = None) -> str:
        """In words; `world_size` None: over whatever ranks the run is launched on."""
        raise NotImplementedError

    def needs(self) -> list[str]:
        """What the machine needs for this engine, in words (`check`; host/hardware.py refuses it at `train`): context
        parallel's exchange is DeepSpeed's (context_parallel.py), on any engine."""
        if self.mesh_keys.cp:
            return [f"`context_parallel_size: {self.mesh_keys.cp}`: the deepspeed package, whose Ulysses attention it "
                    "runs (pip install 'tuneloop[deepspeed]')"]
        return []

    def missing(self) -> list[str]:
        """What this machine lacks of `needs()`, checked when `train` starts."""
        import importlib.util

        if self.mesh_keys.cp and importlib.util.find_spec("deepspeed") is None:
            return [f"`context_parallel_size: {self.mesh_keys.cp}` runs DeepSpeed's Ulysses attention and needs the "
                    "deepspeed package: pip install 'tuneloop[deepspeed]'"]
        return []

    def held_widths(self, parameter_bytes: float, precision: str) -> tuple[float, float]:
        """(bytes per weight as the engine holds it, bytes of an fp32 master copy the optimizer steps besides)."""
        return parameter_bytes, 0.0

    def per_rank(self, whole: WholeBytes, world_size: int, accumulation: int, precision: str) -> RankBytes:
        """This engine's share of the memory estimate: what one rank holds."""
        return RankBytes(weights=whole.weights, gradients=whole.gradients, optimizer=whole.optimizer)

    def check_plan(self, micro_batch_size: int, accumulation: int, world_size: int, max_grad_norm, precision: str,
                   hidden_size: int | None) -> None:
        """A ValueError where the engine's own settings disagree with the plan (a DeepSpeed file's numbers)."""

    def builds_on_meta(self, rank: int, world_size: int) -> bool:
        """Whether this rank builds the model on the meta device and gets its weights from rank 0 when the engine
        starts (FSDP2's cpu_ram_efficient_loading), instead of loading them itself."""
        return False

    def check_model(self, facts) -> None:
        """A UserError where the engine cannot run this model (plan/model_facts.py), said by the plan before `train`
        meets it."""

    def build(self, cfg, plan, accelerator) -> "Engine":
        raise NotImplementedError


def sharded_share(spec: EngineSpec, whole: WholeBytes, world_size: int, precision: str,
                  reshard_after_forward: bool = True) -> RankBytes:
    """A sharding engine's division: what it shards is 1/N per rank, and the weights it shards are gathered whole
    while they compute (the root group with the embeddings and head, and the running and the prefetched layer;
    the whole model when it stays gathered from forward to backward)."""
    ranks = max(world_size, 1)
    divided = whole.weights - whole.unsharded_weights
    weights = (divided / ranks if spec.shards_weights else divided) + whole.unsharded_weights
    gradients = whole.gradients / (ranks if spec.shards_gradients else 1)
    optimizer = whole.optimizer / (ranks if spec.shards_optimizer else 1)
    gathered = 0.0
    if spec.shards_weights:
        outside_layers = max(whole.parameters - whole.layer_parameters * whole.layers, 0)
        compute_bytes = 2 if precision in ("bf16", "fp16") else whole.weight_bytes
        gathered = (outside_layers + 2 * whole.layer_parameters) * compute_bytes
        if not reshard_after_forward:
            gathered = whole.parameters * compute_bytes
    return RankBytes(weights=weights, gradients=gradients, optimizer=optimizer, gathered=gathered)


class Engine:
    """What the loop and the checkpoints talk to. Subclasses: DDP, FSDP2, DeepSpeed (one module each)."""

    lockstep_eval = False  # a collective inside every forward: ranks must run as many eval batches as each other
    writes_shards = False  # a checkpoint holds the engine's own shards (each rank writes its piece)
    reshards = True  # its checkpoints resume on another number of ranks (with --force-resume)
    built_mesh: str | None = None  # the DeviceMesh the engine built, in the plan's words (mesh.described)
    device_mesh = None  # that DeviceMesh (an engine that runs on one: FSDP2 under the N-D keys)

    def __init__(self, spec: EngineSpec, cfg, plan, accelerator):
        self.spec, self.cfg, self.plan, self.accelerator = spec, cfg, plan, accelerator
        self.name = spec.name

    def prepare(self, module):
        """(what the loop runs, the optimizer)."""
        raise NotImplementedError

    @property
    def saves_whole_weights(self) -> bool:
        """A checkpoint holds the whole model (or adapter) as safetensors, besides any shards."""
        return not self.spec.sharded

    @property
    def scheduler_optimizer(self):
        return self.optimizer

    def eval_runner(self):
        return self.module

    def accumulating(self, last: bool):
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None):
        """The step's gradient norm (before clipping); None where the engine clips inside its own step."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm_of_last_step(self):
        raise NotImplementedError  # only for engines whose clip_grad_norm returns None

    def optimizer_state(self) -> dict | None:
        """The optimizer's state for the checkpoint's training state; None: it is in the shards."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def save_shards(self, folder: Path) -> None:
        pass

    def load_shards(self, folder: Path) -> None:
        pass

    def training_ended(self) -> None:
        """After the last step: the model as a caller should hold it (fp32 masters back in place of bf16 copies)."""

    def full_state_dict(self) -> dict | None:
        """None: the model on the main process is whole, it saves itself."""
        return None

    def identity(self) -> dict:
        return self.spec.identity()

    def context_group(self):
        """This rank's context-parallel process group (context_parallel.py): of the engine's DeviceMesh, or of one
        built for it (DDP has none of its own; every rank builds it, at the same point)."""
        from tuneloop.engines.mesh import build_device_mesh, described

        if self.device_mesh is None:
            self.device_mesh = build_device_mesh(self.spec.mesh(self.accelerator.num_processes),
                                                 self.accelerator.device.type)
            self.built_mesh = described(self.device_mesh)
        return self.device_mesh["cp"].get_group()

    def held_bytes(self) -> dict:
        return held_bytes(self.module.model, self.scheduler_optimizer)


def local_bytes(tensor) -> int:
    """What this rank holds of a tensor: an FSDP2 DTensor's local shard, a ZeRO-3 parameter's partition."""
    scales = quantization_state_bytes(tensor)  # kept whole on the parameter by every rank (ZeRO-3's)
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    elif hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    return tensor.numel() * tensor.element_size() + scales


def quantization_state_bytes(tensor) -> int:
    """The scales a bitsandbytes weight keeps beside its packed values: a 4-bit weight's absmax (and, quantized
    twice, the absmax of those and its code book), an 8-bit weight's per-row scales."""
    import torch

    state = getattr(tensor, "quant_state", None)
    parts = []
    while state is not None:
        parts += [state.absmax, state.code]
        state = getattr(state, "state2", None)
    scales = getattr(tensor, "SCB", None)
    parts.append(scales)
    return sum(part.numel() * part.element_size() for part in parts if torch.is_tensor(part))


def held_bytes(model, optimizer) -> dict:
    """This rank's weights and optimizer state in bytes, counted on the tensors themselves (the plan's memory per
    rank is compared with it). The optimizer's share includes the fp32 master weights it steps when they are not
    the model's own (DeepSpeed keeps flat fp32 partitions)."""
    import torch

    weights = sum(local_bytes(param) for param in {id(p): p for p in model.parameters()}.values())
    # an 8-bit layer's row scales move from its weight to the layer's state at its first forward
    weights += sum(quantization_state_bytes(module.state) for module in model.modules()
                   if type(getattr(module, "state", None)).__name__ == "MatmulLtState")
    # a 4-bit weight sharded by FSDP2 is a new (DTensor) parameter: its scales stay with the layer, whole
    weights += sum(quantization_state_bytes(module) for module in model.modules()
                   if getattr(module, "quant_state", None) is not None
                   and getattr(getattr(module, "weight", None), "quant_state", None) is None)
    model_params = {id(p) for p in model.parameters()}
    state = sum(local_bytes(value) for per_param in optimizer.state.values() for value in per_param.values()
                if torch.is_tensor(value))
    masters = sum(local_bytes(param) for group in optimizer.param_groups for param in group["params"]
                  if id(param) not in model_params)
    return {"weights": int(weights), "optimizer": int(state + masters)}


def join_process_group(spec: EngineSpec, timeout=None) -> None:
    """The process group an engine needs, made once, before anything else makes one.

    Launched (torchrun, accelerate launch), Accelerate makes the group of the ranks, except where the engine reduces
    on host tensors on GPUs (FSDP2 offloading): the group then needs gloo for the CPU beside NCCL, and is made here
    first (Accelerate then uses it). One process with an engine that needs a group even alone (FSDP2, DeepSpeed: a
    one-GPU run that offloads, a smoke run before renting more) gets a group of one here."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" in os.environ:
        rejoining = _LAUNCHED_SESSIONS[0] > 0
        _LAUNCHED_SESSIONS[0] += 1
        if (spec.reduces_on_host and cuda) or rejoining:
            kwargs = {"timeout": timeout} if timeout else {}
            if rejoining:
                kwargs.update(_fresh_keys_in_the_launchers_store(_LAUNCHED_SESSIONS[0], timeout))
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = ("cuda:nccl,cpu:gloo" if spec.reduces_on_host else "nccl") if cuda else "gloo"
            dist.init_process_group(backend=backend, **kwargs)
        return
    if not spec.needs_a_group_alone:
        return
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"  # (offloaded norms are on the host)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            **({"timeout": timeout} if timeout else {}))


# launched sessions this process has opened: a launch that runs several (a sweep of configs, the suite's runs that
# share one launch) joins a new group for each, since the last one's end_training closed its group
_LAUNCHED_SESSIONS = [0]


def _fresh_keys_in_the_launchers_store(session: int, timeout) -> dict:
    """The launcher's store (torchrun's, accelerate's) under a prefix of this session's own. A group made again on
    the same store would start from the same keys as the closed one (torch numbers groups afresh once the default
    group is destroyed), and gloo would then connect to the closed group's addresses ("Connection refused")."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, rank, world_size = next(dist.rendezvous("env://", rank, world_size,
                                                   timeout=timeout or timedelta(minutes=30)))
    return {"store": dist.PrefixStore(f"tuneloop_session_{session}/", store), "rank": rank,
            "world_size": world_size}


_UNDONE_WITH_THE_GROUP: list = []  # what a run set up beside its process group, undone when it leaves the group


def launcher_variable_for_one_process(name: str, value: str) -> None:
    """A variable a launcher would have set (DeepSpeed reads LOCAL_RANK in every ZeRO-3 forward), set for a single
    process's run until its group of one is left. Set after Accelerate started: it must not think it was launched."""
    if name not in os.environ:
        os.environ[name] = value
        _UNDONE_WITH_THE_GROUP.append(lambda: os.environ.pop(name, None))


def undo_when_the_group_is_left(undo) -> None:
    """`undo()` when the run leaves its process group (an engine's process-wide state that would outlive it)."""
    _UNDONE_WITH_THE_GROUP.append(undo)


def leave_the_group() -> None:
    """The run's process group closed (a single process's group of one, made by join_process_group; a launched
    group, which Accelerate's end_training closed already) and what was set up beside it undone, so the next run in
    this process (a test, a notebook, the next config of a sweep in one launch) starts without them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    while _UNDONE_WITH_THE_GROUP:
        _UNDONE_WITH_THE_GROUP.pop()()


def forget_accelerate_state() -> None:
    """Accelerate keeps one process-wide state (device, precision) and refuses an Accelerator with another
    precision in the same process. A single-process run forgets it when it ends, as accelerate's own test
    cases do between tests, so the next run in this process (a test, a benchmark, a notebook) starts clean; a
    launched rank forgets it before its next run (its group was closed: see TrainingSession.__enter__)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
