"""The engines that run the model over the ranks: one class each, the loop talks to all of them alike.

- DDP (Accelerate's prepare): a whole copy per rank, gradients averaged in the last micro-batch's backward.
- FSDP2 (torch's `fully_shard`, used directly: Accelerate drops its FSDP plugin on CPU, STACK-NOTES 4): each
  decoder layer is its own shard group, the rest (embeddings, final norm, output head, and the loss, which meets
  the head inside the root's forward) the root group. Non-final micro-batches skip the reduce-scatter
  (`set_requires_gradient_sync(False)`); the gradients of a step are averaged over ranks like DDP's, so the loop's
  token-weighted scaling is the same. Clipping takes the norm of the sharded gradients (a DTensor reduced over
  ranks). Checkpoints are torch.distributed.checkpoint shards: each rank writes its own piece.
- DeepSpeed ZeRO-1/2/3 (`deepspeed.initialize`): tuneloop's optimizer inside DeepSpeed's ZeRO optimizer, in
  DeepSpeed's unmanaged-accumulation mode (the loop calls `step()` once per optimizer step; `backward` never
  divides by the accumulation count), clipping by DeepSpeed (`gradient_clipping` = max_grad_norm). Checkpoints
  are DeepSpeed's own (`save_checkpoint`, every rank writes its partition).

Every engine averages gradients over ranks, which is why the loop scales each micro-batch's summed loss by
world_size / (the step's target tokens).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from tuneloop.errors import UserError
from tuneloop.optim import build_optimizer

SHARDS = "shards"  # the checkpoint's sub-folder of engine shards (FSDP2, DeepSpeed)


class DDPEngine:
    name = "ddp"
    lockstep_eval = False  # no collective inside a forward: ranks may run different numbers of eval batches
    writes_shards = False
    reshards = True  # its checkpoints resume on another number of ranks (with --force-resume)

    def __init__(self, cfg, plan, accelerator):
        self.cfg, self.plan, self.accelerator = cfg, plan, accelerator

    def prepare(self, module):
        """(what the loop runs, the optimizer)."""
        optimizer = build_optimizer(self.cfg, module.model)
        self.module = module
        self.runner, self.optimizer = self.accelerator.prepare(module, optimizer)
        return self.runner, self.optimizer

    @property
    def scheduler_optimizer(self):
        return self.optimizer

    def eval_runner(self):
        return self.module  # unwrapped: DDP's forward would broadcast buffers, a collective

    def accumulating(self, last: bool):
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.runner)

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """The step's gradient norm (before clipping); None where the engine clips inside its own step."""
        return self.accelerator.clip_grad_norm_(self.runner.parameters(), max_norm or float("inf"))

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm_of_last_step(self) -> torch.Tensor:
        raise NotImplementedError  # only for engines whose clip_grad_norm returns None

    def optimizer_state(self) -> dict | None:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def save_shards(self, folder: Path) -> None:
        pass

    def load_shards(self, folder: Path) -> None:
        pass

    def full_state_dict(self) -> dict | None:
        """None: the model on the main process is whole, it saves itself."""
        return None

    def identity(self) -> dict:
        """What a checkpoint's shards need of the engine that resumes them (the marker records it)."""
        return {"name": self.name, "zero_stage": self.cfg.distributed.zero_stage}

    def held_bytes(self) -> dict:
        return held_bytes(self.module.model, self.scheduler_optimizer)


class FSDP2Engine(DDPEngine):
    name = "fsdp2"
    lockstep_eval = True  # every forward gathers each layer from all ranks
    writes_shards = True

    def prepare(self, module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from tuneloop.hardware import mixed_precision

        dist, accelerator = self.cfg.distributed, self.accelerator
        device = accelerator.device
        if mixed_precision(self.cfg) == "fp16":
            raise UserError("fsdp: fp16 needs a sharded gradient scaler tuneloop does not have; use `bf16: true`")
        mesh = init_device_mesh(device.type, (accelerator.num_processes,))
        options = {"mesh": mesh, "reshard_after_forward": dist.reshard_after_forward}
        if mixed_precision(self.cfg) == "bf16":  # gathered and computed in bf16, gradients reduced in fp32
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dist.offload_weights and device.type == "cuda":
            options["offload_policy"] = CPUOffloadPolicy()  # shards, gradients and the optimizer step on the host
        elif device.type != "cpu" or not dist.offload_weights:
            module.to(device)
        layers = shard_groups(module.model, dist.layer_classes)
        for layer in layers:
            fully_shard(layer, **options)
        if "mp_policy" in options:  # the root's inputs stay as they are: DPO's precomputed fp32 log-probs ride in them
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        cast_forward_inputs=False)
        fully_shard(module, **options)  # the root: embeddings, head and the loss computed with it
        self.layer_count = len(layers)
        self.module = self.runner = module
        self.optimizer = build_optimizer(self.cfg, module.model)  # over the sharded (DTensor) parameters
        return self.runner, self.optimizer

    def accumulating(self, last: bool):
        self.runner.set_requires_gradient_sync(last)  # reduce-scatter only in the step's last backward
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.runner.parameters(), max_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # the norm of sharded gradients, reduced over ranks
            grad_norm = grad_norm.full_tensor()
        return grad_norm.to(self.accelerator.device)  # (offloaded gradients give a host norm)

    def optimizer_state(self) -> dict | None:
        return None  # in the shards

    def load_optimizer_state(self, state: dict) -> None:
        pass

    def save_shards(self, folder: Path) -> None:
        """Collective: each rank writes its pieces of the weights and the optimizer state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.module.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))

    def load_shards(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.module.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(folder))  # resharded to this run's ranks if their number changed
        set_state_dict(self.module.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def full_state_dict(self) -> dict | None:
        """Collective: the whole model's (or adapter's) weights gathered onto the main process, in host memory."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.module.model, options=options)


class DeepSpeedEngine(DDPEngine):
    name = "deepspeed"
    writes_shards = True
    reshards = False  # its optimizer partitions are fixed to the ranks that wrote them

    @property
    def lockstep_eval(self) -> bool:
        return self.cfg.distributed.zero_stage == 3  # ZeRO-3 gathers each layer from all ranks in every forward

    def prepare(self, module):
        from tuneloop.distributed import filled_deepspeed_config
        from tuneloop.hardware import mixed_precision

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
        except ImportError:
            raise UserError("deepspeed: the config asks for DeepSpeed, which is not installed: "
                            "pip install 'tuneloop[deepspeed]'") from None
        cfg, plan = self.cfg, self.plan
        hidden = getattr(module.model.config, "hidden_size", None)
        try:
            config = filled_deepspeed_config(cfg.distributed, cfg.micro_batch_size, plan.gradient_accumulation_steps,
                                             plan.world_size, cfg.max_grad_norm, mixed_precision(cfg), hidden)
        except ValueError as error:
            raise UserError(f"config: {error}") from None
        optimizer = build_optimizer(cfg, module.model)
        self.base_optimizer = optimizer
        with _local_rank_named(self.accelerator.local_process_index):
            engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        if cfg.distributed.zero_stage == 3:
            register_head_with_root(engine.module)
        self.engine, self.module, self.runner, self.optimizer = engine, engine.module, engine, ds_optimizer
        return self.runner, self.optimizer

    @property
    def scheduler_optimizer(self):
        """DeepSpeed's ZeRO optimizer steps tuneloop's optimizer, whose learning rate the scheduler sets."""
        return self.base_optimizer

    def eval_runner(self):
        return self.engine.module

    def accumulating(self, last: bool):
        return contextlib.nullcontext()  # the engine reduces gradients in step() (ZeRO-2/3: in each backward)

    def backward(self, loss) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # already divided by the step's tokens

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        return None  # DeepSpeed clips inside its step (gradient_clipping = max_grad_norm)

    def optimizer_step(self) -> None:
        self.engine.step()  # clips, steps, and clears the gradients

    def zero_grad(self) -> None:
        pass  # done by the engine's step

    def grad_norm_of_last_step(self) -> torch.Tensor:
        """On the device, like the other engines' norms (the watchdog compares it there, without a sync)."""
        norm = self.engine.get_global_grad_norm()
        device = self.accelerator.device
        # not computed, or an fp16 loss-scale overflow that DeepSpeed skipped (its norm is then inf): neither is a
        # divergence for the watchdog
        if norm is None or not self.engine.was_step_applied():
            return torch.zeros((), device=device)
        return torch.as_tensor(norm, dtype=torch.float32).to(device)

    def optimizer_state(self) -> dict | None:
        return None  # in DeepSpeed's own checkpoint files

    def save_shards(self, folder: Path) -> None:
        """Collective: DeepSpeed's checkpoint (model states and each rank's optimizer partition) in `folder`. A rank
        whose write fails still meets the others at the barrier DeepSpeed ends with, then reports the failure (the
        checkpoint then fails on every rank together instead of hanging)."""
        try:
            self.engine.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)
        except Exception:
            import torch.distributed as dist

            dist.barrier()
            raise

    def load_shards(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name, load_lr_scheduler_states=False)
        if path is None:
            raise UserError(f"checkpoint: DeepSpeed could not load the shards in {folder}")

    def full_state_dict(self) -> dict | None:
        if self.cfg.distributed.zero_stage != 3:
            return None  # ZeRO-1/2 keep whole weights on every rank
        import deepspeed

        # one module's weights gathered at a time (the whole model at once would not fit where ZeRO-3 was needed),
        # copied to host memory on the main process only
        model, main = self.engine.module.model, self.accelerator.is_main_process
        state = {}
        for prefix, module in model.named_modules():
            own = list(module.named_parameters(recurse=False))
            if not own:
                continue
            with deepspeed.zero.GatheredParameters([param for _, param in own], modifier_rank=None):
                if main:
                    for name, param in own:
                        state[f"{prefix}.{name}" if prefix else name] = param.detach().cpu().clone()
        if main:  # persistent buffers, never partitioned
            saved = set(model.state_dict())
            state.update({name: buffer.detach().cpu().clone() for name, buffer in model.named_buffers()
                          if name in saved})
        return state


@contextlib.contextmanager
def _local_rank_named(local_rank: int):
    """DeepSpeed reads LOCAL_RANK from the environment, which launchers set; a single `tuneloop train` has none, so
    it is named for the engine's start only (left set, it would tell later runs in this process they were launched)."""
    if "LOCAL_RANK" in os.environ:
        yield
        return
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        yield
    finally:
        del os.environ["LOCAL_RANK"]


def local_bytes(tensor) -> int:
    """What this rank holds of a tensor: an FSDP2 DTensor's local shard, a ZeRO-3 parameter's partition."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    elif hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    return tensor.numel() * tensor.element_size()


def held_bytes(model, optimizer) -> dict:
    """This rank's weights and optimizer state in bytes, counted on the tensors themselves (the plan's memory per
    rank is compared with it). The optimizer's share includes the fp32 master weights it steps when they are not
    the model's own (DeepSpeed keeps flat fp32 partitions)."""
    weights = sum(local_bytes(param) for param in {id(p): p for p in model.parameters()}.values())
    model_params = {id(p) for p in model.parameters()}
    state = sum(local_bytes(value) for per_param in optimizer.state.values() for value in per_param.values()
                if torch.is_tensor(value))
    masters = sum(local_bytes(param) for group in optimizer.param_groups for param in group["params"]
                  if id(param) not in model_params)
    return {"weights": int(weights), "optimizer": int(state + masters)}


def shard_groups(model, class_names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The modules sharded one by one: those of the named classes (fsdp_config.transformer_layer_cls_to_wrap), by
    default the model's own decoder-layer classes (transformers' `_no_split_modules`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    wanted = set(class_names) or set(getattr(base, "_no_split_modules", None) or [])
    found = [module for module in model.modules() if type(module).__name__ in wanted]
    if not found:
        named = ", ".join(sorted(wanted)) or "(none: the model names no decoder-layer class)"
        present = sorted({type(module).__name__ for module in base.modules() if "Layer" in type(module).__name__})
        raise UserError(f"fsdp_config.transformer_layer_cls_to_wrap: no module of class {named} in "
                        f"{type(base).__name__}; its layer classes are {', '.join(present) or 'unknown'}")
    return found


def register_head_with_root(module) -> None:
    """ZeRO-3 gathers a module's weights when its forward runs. The chunked loss uses the output head's weight
    inside the root's forward without calling the head, so the root declares it its own (DeepSpeed's way)."""
    import deepspeed

    from tuneloop.train.output_head import output_head

    head = output_head(module.model)
    if head is not None:
        deepspeed.zero.register_external_parameter(module, head[1])


ENGINES = {"ddp": DDPEngine, "fsdp2": FSDP2Engine, "deepspeed": DeepSpeedEngine}


def engine_for(cfg, plan, accelerator):
    if cfg.distributed.engine != "ddp":
        one_rank_group(accelerator)
    return ENGINES[cfg.distributed.engine](cfg, plan, accelerator)


def one_rank_group(accelerator) -> None:
    """FSDP2 and DeepSpeed need a process group even on one device (a one-GPU run offloading to the host, or a smoke
    run before renting more): a launcher makes one; a plain `tuneloop train` gets a group of one here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = "cuda:nccl,cpu:gloo" if accelerator.device.type == "cuda" else "gloo"  # (offloaded norms are on the host)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
