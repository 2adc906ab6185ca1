"""FSDP2: axolotl's `fsdp` / `fsdp_version` / `fsdp_config` keys, run with torch's `fully_shard`.

Weights, gradients and optimizer state are divided over the ranks. Each decoder layer is its own shard group,
gathered when it runs; the rest (embeddings, final norm, output head, and the loss, which meets the head inside
the root's forward) is the root group. torch's `fully_shard` is used directly: Accelerate drops its FSDP plugin
on CPU (STACK-NOTES 4). Non-final micro-batches skip the reduce-scatter (`set_requires_gradient_sync(False)`);
the gradients of a step are averaged over ranks like DDP's, so the loop's token-weighted scaling is the same.
Clipping takes the norm of the sharded gradients (a DTensor reduced over ranks). Checkpoints are
torch.distributed.checkpoint shards: each rank writes its own piece, and they reshard to another number of ranks.

With `dp_replicate_size` > 1 (axolotl's N-D keys, mesh.py) it is HSDP: `fully_shard` on the 2-D mesh
(dp_replicate, dp_shard) shards within each group of dp_shard ranks and keeps a replica per group; gradients are
reduce-scattered within a group and all-reduced across groups, so the average is still over every rank.

FSDP1 configs (axolotl's older spelling) run as FSDP2, with a warning; keys that only change speed under FSDP2
are warned about; what FSDP2 here cannot do is refused naming the key.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneloop.engines.base import Engine, EngineSpec, RankBytes, WholeBytes, sharded_share
from tuneloop.engines.context_parallel import context_parallel_words
from tuneloop.engines.ddp import DDPEngine
from tuneloop.errors import UserError

# fsdp_config keys of FSDP1 (and loading knobs) that change only speed or host memory under FSDP2: warned about
FSDP_SPEED_ONLY = {
    "sync_module_states": "every rank loads the same weights, so there is nothing to broadcast",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "limit_all_gathers": "an FSDP1 rate limiter; FSDP2 has none",
    "backward_prefetch": "FSDP2 prefetches the next layer itself",
    "forward_prefetch": "FSDP2 prefetches the next layer itself",
    "cpu_offload_pin_memory": "pinning only speeds up host-device copies",
}
FSDP_KEYS = {"version", "activation_checkpointing", "offload_params", "reshard_after_forward", "state_dict_type",
             "final_state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "sharding_strategy",
             "min_num_params", "mixed_precision_policy", "cpu_ram_efficient_loading"} | set(FSDP_SPEED_ONLY)
FSDP_LIST_WORDS = {"full_shard", "shard_grad_op", "offload", "auto_wrap", "no_shard", "hybrid_shard",
                   "hybrid_shard_zero2"}
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
# accelerate's numbered spelling of sharding_strategy
NUMBERED_STRATEGIES = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "_HYBRID_SHARD_ZERO2"}


@dataclass(frozen=True, kw_only=True)
class FSDP2Spec(EngineSpec):
    name = "fsdp2"
    needs_a_group_alone = True
    reshard_after_forward: bool = True  # False: weights kept gathered from forward to backward (shard_grad_op)
    layer_classes: tuple[str, ...] = ()  # the modules sharded one by one (default: the model's decoder layers)
    full_weights_in_checkpoints: bool = False  # state_dict_type FULL_STATE_DICT: each checkpoint also has safetensors
    # cpu_ram_efficient_loading: rank 0 alone reads the weights; the others build the model on the meta device and
    # receive their shards from it, so no rank but the first ever holds a whole copy in host memory
    loads_on_rank_zero: bool = False

    @property
    def reduces_on_host(self) -> bool:
        return self.offload_weights  # shards, their gradients and the optimizer step on the host

    def describe(self, world_size: int | None = None) -> str:
        over = f" over {world_size} rank(s)" if world_size else ""
        among = f"divided by {world_size}" if world_size else "divided over the ranks"
        mesh = self.mesh(world_size) if world_size else None
        if mesh is not None and mesh.dp_replicate > 1:
            among = f"divided by {mesh.dp_shard * mesh.cp} within each of {mesh.dp_replicate} replicas (HSDP)"
        elif mesh is not None and (mesh.tp > 1 or mesh.cp > 1):
            among = f"divided by {mesh.dp_shard * mesh.cp}"
        parts = ["weights, gradients and optimizer state " + among]
        if mesh is not None and mesh.tp > 1:
            parts.insert(0, f"each layer's projections split over {mesh.tp} tensor-parallel ranks (the embeddings, "
                            "norms and head whole on each), which read the same rows")
        if mesh is not None and mesh.cp > 1:
            parts.insert(0, context_parallel_words(mesh.cp))
        if not self.reshard_after_forward:
            parts.append("weights kept gathered from forward to backward (shard_grad_op)")
        if self.offload_weights:
            parts.append("offloaded to host memory")
        if self.loads_on_rank_zero:
            parts.append("the weights read by rank 0 alone and sent out as shards")
        return f"FSDP2{over}: " + "; ".join(parts)

    def per_rank(self, whole: WholeBytes, world_size: int, accumulation: int, precision: str) -> RankBytes:
        # divided over the ranks of one shard group: under HSDP each replica holds the whole model in its group;
        # tensor parallel first divides the layers' projections over the tp ranks
        mesh = self.mesh(world_size)
        if mesh.tp > 1:
            whole = tensor_parallel_share(whole, mesh.tp)
        # (context-parallel ranks hold shards too: FSDP2 shards over dp_shard × cp)
        share = sharded_share(self, whole, mesh.dp_shard * mesh.cp, precision, self.reshard_after_forward)
        gradients = share.gradients
        if accumulation > 1:
            # FSDP2 skips the reduce-scatter in a step's non-final micro-batches, keeping each gradient whole (fp32)
            # until the last one: bandwidth saved, memory spent
            gradients += whole.trainable * 4
        weights, optimizer, host = share.weights, share.optimizer, 0.0
        if self.offload_weights:  # shards, their gradients and the optimizer step live on the host
            host, weights, gradients = weights + gradients, 0.0, 0.0
        if self.offload_optimizer:
            host, optimizer = host + optimizer, 0.0
        return RankBytes(weights=weights, gradients=gradients, optimizer=optimizer, gathered=share.gathered,
                         host=host)

    def builds_on_meta(self, rank: int, world_size: int) -> bool:
        """cpu_ram_efficient_loading: every rank but the first builds the model without weights. (With 4/8-bit
        weights the key is left off when the config is read: their quantization state is not in a state dict.)"""
        return self.loads_on_rank_zero and world_size > 1 and rank != 0

    def check_model(self, facts) -> None:
        """The layers it shards one by one are classes the model has."""
        wanted = set(self.layer_classes) or set(facts.layer_classes)
        if not wanted & facts.module_classes:
            raise UserError(missing_layers(wanted, facts.module_classes, type(facts.config).__name__))
        if self.mesh_keys.tp:  # (tensor_parallel.py: the model's own table, and sizes the tp ranks divide)
            from tuneloop.engines.tensor_parallel import check_tensor_parallel

            check_tensor_parallel(facts.config, self.mesh_keys.tp)

    def build(self, cfg, plan, accelerator) -> Engine:
        return FSDP2Engine(self, cfg, plan, accelerator)


def missing_layers(wanted: set[str], present: set[str], model: str) -> str:
    named = ", ".join(sorted(wanted)) or "(none: the model names no decoder-layer class)"
    layers = sorted(name for name in present if "Layer" in name)
    return (f"fsdp_config.transformer_layer_cls_to_wrap: no module of class {named} in {model}; its layer classes "
            f"are {', '.join(layers) or 'unknown'}")


def read_fsdp_keys(fsdp: Any, fsdp_version: Any, fsdp_config: dict) -> FSDP2Spec:
    """axolotl's fsdp keys as users write them. A ValueError names the key and the fix."""
    words = _fsdp_words(fsdp)
    options = _fsdp_options(fsdp_config)
    version = fsdp_version if fsdp_version is not None else options.get("version", 1 if fsdp_config else 2)
    if str(version) not in ("1", "2"):
        raise ValueError(f"`fsdp_version: {version}`: FSDP versions are 1 and 2")
    if str(version) == "1":
        warnings.warn("FSDP1 (`fsdp_version` unset or 1) is deprecated in axolotl and torch; tuneloop runs the same "
                      "sharding with FSDP2 (`fully_shard`). Set `fsdp_version: 2` to silence this.", UserWarning,
                      stacklevel=4)
    strategy = options.get("sharding_strategy")
    strategy = (NUMBERED_STRATEGIES.get(strategy, strategy) if isinstance(strategy, int)
                else str(strategy or "").upper())
    if strategy and strategy not in NUMBERED_STRATEGIES.values():
        raise ValueError(f"`fsdp_config.sharding_strategy: {options['sharding_strategy']}`: one of "
                         f"{', '.join(NUMBERED_STRATEGIES.values())}")
    if "hybrid_shard" in words or "hybrid_shard_zero2" in words or strategy.startswith(("HYBRID", "_HYBRID")):
        # (FSDP1's spelling leaves the group size to the launcher's nodes; the mesh keys say it, plan-time checked)
        raise ValueError("`fsdp` hybrid sharding (shard within a node, replicate across nodes): use full_shard and "
                         "say the groups with `dp_shard_size` (ranks per group) and `dp_replicate_size` (groups)")
    if "no_shard" in words or strategy == "NO_SHARD":
        raise ValueError("`fsdp: no_shard` is DDP: remove the `fsdp` keys and launch the same ranks")
    if options.get("auto_wrap_policy") not in (None, "TRANSFORMER_BASED_WRAP"):
        raise ValueError(f"`fsdp_config.auto_wrap_policy: {options['auto_wrap_policy']}`: tuneloop shards by "
                         "transformer layer (TRANSFORMER_BASED_WRAP); size-based wrapping is not there yet")
    if options.get("min_num_params") is not None:
        raise ValueError("`fsdp_config.min_num_params` belongs to SIZE_BASED_WRAP, which tuneloop does not do yet")
    if options.get("mixed_precision_policy") is not None:
        raise ValueError("`fsdp_config.mixed_precision_policy`: tuneloop takes FSDP's mixed precision from `bf16` / "
                         "`fp16` (bf16 compute, fp32 gradient reduction); remove the key")
    for key, why in FSDP_SPEED_ONLY.items():
        if options.get(key) is not None:
            warnings.warn(f"`fsdp_config.{key}` only changes speed or host memory under FSDP2 ({why}); it is "
                          "ignored.", UserWarning, stacklevel=4)
    for key in ("state_dict_type", "final_state_dict_type"):
        if options.get(key) is not None and options[key] not in STATE_DICT_TYPES:
            raise ValueError(f"`fsdp_config.{key}: {options[key]}`: one of {', '.join(STATE_DICT_TYPES)}")
    if options.get("final_state_dict_type") not in (None, "FULL_STATE_DICT"):
        warnings.warn("`fsdp_config.final_state_dict_type`: tuneloop always gathers the final model into a standard "
                      "Hugging Face folder (full weights); the checkpoints keep their shards.", UserWarning,
                      stacklevel=4)
    reshard = options.get("reshard_after_forward")
    if reshard is None:
        reshard = not ("shard_grad_op" in words or strategy == "SHARD_GRAD_OP")
    layers = options.get("transformer_layer_cls_to_wrap")
    layer_classes = tuple(name.strip() for name in (layers.split(",") if isinstance(layers, str) else layers or [])
                          if name.strip())
    offload = bool(options.get("offload_params")) or "offload" in words
    return FSDP2Spec(shards_weights=True, shards_gradients=True, shards_optimizer=True, offload_weights=offload,
                     offload_optimizer=offload, reshard_after_forward=bool(reshard), layer_classes=layer_classes,
                     activation_checkpointing=bool(options.get("activation_checkpointing")),
                     full_weights_in_checkpoints=options.get("state_dict_type") == "FULL_STATE_DICT",
                     loads_on_rank_zero=bool(options.get("cpu_ram_efficient_loading")))


def _fsdp_words(fsdp: Any) -> set[str]:
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp or [])
    unknown = [word for word in words if word not in FSDP_LIST_WORDS]
    if unknown:
        raise ValueError(f"`fsdp`: unknown option {unknown[0]!r}; known: {', '.join(sorted(FSDP_LIST_WORDS))}")
    return set(words)


def _fsdp_options(fsdp_config: dict) -> dict:
    """fsdp_config without axolotl's `fsdp_` prefixes; unknown keys refused with the nearest known one."""
    options = {}
    for key, value in fsdp_config.items():
        name = key.removeprefix("fsdp_")
        name = "version" if name == "fsdp_version" else name
        if name not in FSDP_KEYS:
            near = difflib.get_close_matches(name, sorted(FSDP_KEYS), n=1, cutoff=0.5)
            raise ValueError(f"`fsdp_config.{key}` is not an FSDP setting tuneloop knows"
                             + (f"; did you mean `{near[0]}`?" if near else ""))
        options[name] = value
    return options


class FSDP2Engine(DDPEngine):
    lockstep_eval = True  # every forward gathers each layer from all ranks
    writes_shards = True

    @property
    def saves_whole_weights(self) -> bool:
        return self.spec.full_weights_in_checkpoints  # else a checkpoint's weights are in its shards alone

    def prepare(self, module):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from tuneloop.optim import build_optimizer

        spec, accelerator = self.spec, self.accelerator
        device = accelerator.device
        precision = self.plan.resolved.precision.mixed
        if precision == "fp16":
            raise UserError("fsdp: fp16 needs a sharded gradient scaler tuneloop does not have; use `bf16: true`")
        options = {"mesh": self._shard_mesh(init_device_mesh), "reshard_after_forward": spec.reshard_after_forward}
        if precision == "bf16":  # gathered and computed in bf16, gradients reduced in fp32
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        on_meta = any(parameter.is_meta for parameter in module.parameters())  # (loads_on_rank_zero, not rank 0)
        sends = spec.loads_on_rank_zero and accelerator.num_processes > 1
        whole = module.model.state_dict() if sends and not on_meta else None
        if spec.offload_weights and device.type == "cuda":
            options["offload_policy"] = CPUOffloadPolicy()  # shards, gradients and the optimizer step on the host
        elif not on_meta and (device.type != "cpu" or not spec.offload_weights):
            module.to(device)
        layers = shard_groups(module.model, spec.layer_classes)
        if self.tp_mesh is not None:  # the layers' projections split over the tp ranks first, then sharded (2-D)
            from tuneloop.engines.tensor_parallel import parallelize

            self.partial_gradients = parallelize(module.model, self.tp_mesh)
        for layer in layers:
            fully_shard(layer, **options)
        if "mp_policy" in options:  # the root's inputs stay as they are: DPO's precomputed fp32 log-probs ride in them
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        cast_forward_inputs=False)
        fully_shard(module, **options)  # the root: embeddings, head and the loss computed with it
        if whole is not None or on_meta:
            receive_weights_from_rank_zero(module, whole, device)
        self.layer_count = len(layers)
        self.module = self.runner = module
        self.optimizer = build_optimizer(self.cfg, module.model)  # over the sharded (DTensor) parameters
        return self.runner, self.optimizer

    tp_mesh = None  # the tensor-parallel dimension of the mesh, when tensor_parallel_size > 1
    partial_gradients: list = []  # parameters whose gradients each tp rank holds a part of (tensor_parallel.py)

    def _shard_mesh(self, init_device_mesh):
        """The mesh fully_shard runs on: without the N-D keys, all ranks in one dimension (as before they
        existed); with them, the engine's DeviceMesh (mesh.py), whose (dp_replicate, dp_shard) part is 2-D when
        there are replicas (HSDP) and the dp_shard dimension alone otherwise. Its tp dimension, when it has
        ranks, is kept for tensor parallel."""
        from tuneloop.engines.mesh import build_device_mesh, described

        device_type = self.accelerator.device.type
        if not self.spec.mesh_keys.written:
            return init_device_mesh(device_type, (self.accelerator.num_processes,))
        device_mesh = build_device_mesh(self.spec.mesh(self.accelerator.num_processes), device_type)
        self.built_mesh = described(device_mesh)
        self.device_mesh = device_mesh
        if device_mesh["tp"].size() > 1:
            self.tp_mesh = device_mesh["tp"]
        shard = "dp_shard"
        if device_mesh["cp"].size() > 1:  # context-parallel ranks hold shards too (their gradients are parts)
            device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            shard = "dp_shard_cp"
        return device_mesh["dp_replicate", shard] if device_mesh["dp_replicate"].size() > 1 else device_mesh[shard]

    def accumulating(self, last: bool):
        import contextlib

        self.runner.set_requires_gradient_sync(last)  # reduce-scatter only in the step's last backward
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None):
        import torch

        if self.tp_mesh is not None:  # (after the step's last backward: the per-head norms' parts summed first)
            from tuneloop.engines.tensor_parallel import clip_grad_norm_over_meshes, sum_partial_gradients

            sum_partial_gradients(self.partial_gradients, self.tp_mesh.get_group())
            return clip_grad_norm_over_meshes(self.runner.parameters(), max_norm or float("inf"))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.runner.parameters(), max_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # the norm of sharded gradients, reduced over ranks
            grad_norm = grad_norm.full_tensor()
        return grad_norm.to(self.accelerator.device)  # (offloaded gradients give a host norm)

    def optimizer_state(self) -> dict | None:
        return None  # in the shards

    def load_optimizer_state(self, state: dict) -> None:
        pass

    def save_shards(self, folder: Path) -> None:
        """Collective: each rank writes its pieces of the trained weights and of the optimizer state. Frozen weights
        (an adapter's base, 4-bit or not) never change, so they are not written again with every checkpoint: the
        resume loads them from the base as the first start did."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.module.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))

    def load_shards(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = self._state_options()
        model_state, optimizer_state = get_state_dict(self.module.model, self.optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(folder))  # resharded to this run's ranks if their number changed
        set_state_dict(self.module.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)

    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not parameter.requires_grad for parameter in self.module.model.parameters())
        # strict=False: the frozen weights are left out on purpose, and loading must not ask for them
        return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else StateDictOptions()

    def full_state_dict(self) -> dict | None:
        """Collective: the whole model's (or adapter's) weights gathered onto the main process, in host memory."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.module.model, options=options)


def tensor_parallel_share(whole: WholeBytes, tp: int) -> WholeBytes:
    """What one tp rank holds before FSDP2 shards it (tensor_parallel.split_share)."""
    from dataclasses import replace

    from tuneloop.engines.tensor_parallel import split_share

    share = split_share(whole, tp)
    return replace(whole, weights=whole.weights * share, gradients=whole.gradients * share,
                   optimizer=whole.optimizer * share, layer_parameters=whole.layer_parameters // tp,
                   parameters=int(whole.parameters * share))


def receive_weights_from_rank_zero(module, whole: dict | None, device) -> None:
    """Collective, after sharding: rank 0 (`whole`: its full state dict, read before sharding) sends each rank its
    shards; the others, built on the meta device, get storage first. The buffers a state dict leaves out (a rotary
    embedding's inv_freq, computed at construction) are sent whole: on the meta device they were never computed."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if whole is None:
        module.to_empty(device=device)
    set_model_state_dict(module.model, whole or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    saved = set(module.model.state_dict())
    for name, buffer in module.model.named_buffers():
        if name not in saved:
            dist.broadcast(buffer, src=0)


def shard_groups(model, class_names: tuple[str, ...]) -> list:
    """The modules sharded one by one: those of the named classes (fsdp_config.transformer_layer_cls_to_wrap), by
    default the model's own decoder-layer classes (transformers' `_no_split_modules`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    wanted = set(class_names) or set(getattr(base, "_no_split_modules", None) or [])
    found = [module for module in model.modules() if type(module).__name__ in wanted]
    if not found:
        raise UserError(missing_layers(wanted, {type(module).__name__ for module in base.modules()},
                                       type(base).__name__))
    return found
