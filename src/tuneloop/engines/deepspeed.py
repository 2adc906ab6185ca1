"""DeepSpeed ZeRO-1/2/3: axolotl's `deepspeed: path/to.json` (or a shipped name such as `zero2`), the stage from
that file.

tuneloop's optimizer runs inside DeepSpeed's ZeRO optimizer, in DeepSpeed's unmanaged-accumulation mode: the loop
calls `step()` once per optimizer step and `backward` never divides by the accumulation count (each micro-batch's
summed loss is already divided by the step's target tokens). DeepSpeed clips (`gradient_clipping` =
max_grad_norm). Checkpoints are DeepSpeed's own (`save_checkpoint`: every rank writes its partition, which is
fixed to the ranks that wrote it). Raw DeepSpeed runs on CPU with gloo (STACK-NOTES 5); Accelerate's plugin does
not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneloop.engines.base import (Engine, EngineSpec, RankBytes, WholeBytes, launcher_variable_for_one_process,
                                   sharded_share, undo_when_the_group_is_left)
from tuneloop.errors import UserError

SHIPPED_DEEPSPEED = Path(__file__).parent / "deepspeed_configs"
ZERO_HOLDS = {1: "optimizer state", 2: "gradients and optimizer state", 3: "weights, gradients and optimizer state"}


@dataclass(frozen=True, kw_only=True)
class DeepSpeedSpec(EngineSpec):
    name = "deepspeed"
    needs_a_group_alone = True
    stage: int = 0
    file: str | None = None  # where the config came from ("(inline)" for a mapping in the YAML)
    config: dict = field(default_factory=dict)

    @property
    def zero_stage(self) -> int | None:
        return self.stage

    def describe(self, world_size: int | None = None) -> str:
        over = f" over {world_size} rank(s)" if world_size else ""
        among = f"divided by {world_size}" if world_size else "divided over the ranks"
        offload = ", optimizer state in host memory" if self.offload_optimizer else ""
        offload += ", weights in host memory" if self.offload_weights else ""
        return f"DeepSpeed ZeRO-{self.stage}{over}: {ZERO_HOLDS.get(self.stage, 'nothing')} {among}{offload}"

    def needs(self) -> list[str]:
        return [f"`deepspeed: {self.file}`: the deepspeed package (pip install 'tuneloop[deepspeed]')"]

    def missing(self) -> list[str]:
        if importlib.util.find_spec("deepspeed") is None:
            return ["`deepspeed:` needs the deepspeed package: pip install 'tuneloop[deepspeed]'"]
        return []

    def sixteen_bit_weights(self, precision: str) -> bool:
        """DeepSpeed casts the model to bf16/fp16 (and steps fp32 master copies) when its file enables that
        precision, or leaves it at "auto" and the YAML's precision is that one. Its own bf16 is not the mixed
        precision of DDP and FSDP2: the weights the forward sees are 16-bit, and the masters start from them rounded
        (see the README)."""
        if precision not in ("bf16", "fp16"):
            return False
        return (self.config.get(precision) or {}).get("enabled", "auto") in ("auto", True)

    def held_widths(self, parameter_bytes: float, precision: str) -> tuple[float, float]:
        """ZeRO's optimizer steps an fp32 copy of the weights (flat partitions): at stages 1 and 2 always, at stage 3
        when the model's own weights are 16-bit."""
        if not self.stage:
            return parameter_bytes, 0.0
        sixteen_bit = self.sixteen_bit_weights(precision)
        return (2 if sixteen_bit else parameter_bytes), (4.0 if self.stage < 3 or sixteen_bit else 0.0)

    def per_rank(self, whole: WholeBytes, world_size: int, accumulation: int, precision: str) -> RankBytes:
        share = sharded_share(self, whole, world_size, precision)
        weights, optimizer, host = share.weights, share.optimizer, 0.0
        if self.offload_weights:  # partitioned weights on the host; gradients stay on the device
            host, weights = weights, 0.0
        if self.offload_optimizer:
            host, optimizer = host + optimizer, 0.0
        return RankBytes(weights=weights, gradients=share.gradients, optimizer=optimizer, gathered=share.gathered,
                         host=host)

    def check_plan(self, micro_batch_size: int, accumulation: int, world_size: int, max_grad_norm, precision: str,
                   hidden_size: int | None) -> None:
        filled_config(self, micro_batch_size, accumulation, world_size, max_grad_norm, precision, hidden_size)

    def build(self, cfg, plan, accelerator) -> Engine:
        return DeepSpeedEngine(self, cfg, plan, accelerator)


# ---- the keys ----------------------------------------------------------------------------------------------
def shipped_names() -> list[str]:
    return sorted(path.stem for path in SHIPPED_DEEPSPEED.glob("*.json"))


def config_file(value: str, config_dir: Path | None) -> Path:
    """`deepspeed:` as given; else relative to the config file; else a config shipped with tuneloop (`zero2`,
    `zero2.json` or axolotl's `deepspeed_configs/zero2.json`)."""
    given = Path(value).expanduser()
    candidates = [given]
    if config_dir is not None and not given.is_absolute():
        candidates.append(config_dir / given)
    name = given.name if given.suffix == ".json" else f"{given.name}.json"
    candidates.append(SHIPPED_DEEPSPEED / name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ValueError(f"`deepspeed: {value}`: no such file (looked as given"
                     + (f", beside the config in {config_dir}" if config_dir else "")
                     + f" and among tuneloop's own: {', '.join(shipped_names())})")


def read_deepspeed_keys(value: Any, config_dir: Path | None = None) -> DeepSpeedSpec:
    """`deepspeed:` as users write it: a path (beside the config, or a shipped name), or the config inline."""
    if isinstance(value, dict):
        source, config = "(inline)", value
    else:
        path = config_file(str(value), config_dir)
        source = str(path)
        try:
            config = json.loads(path.read_text(encoding="utf-8-sig"))  # (a Windows editor's byte-order mark: nothing)
        except (OSError, ValueError) as error:
            raise ValueError(f"`deepspeed: {value}`: {path} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"`deepspeed: {value}`: the file must hold a JSON object")
    for block in ("optimizer", "scheduler"):
        if block in config:
            raise ValueError(f"`deepspeed: {value}` has a `{block}` block; tuneloop builds the {block} from the "
                             f"YAML (`optimizer:` / `lr_scheduler:`) so the plan holds: remove the block")
    if (config.get("compile") or {}).get("deepcompile"):
        raise ValueError(f"`deepspeed: {value}` turns on DeepCompile (compile.deepcompile), which asks for DeepSpeed's "
                         "deepcompile, which tuneloop does not do yet: remove it")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"`deepspeed: {value}`: zero_optimization.stage is {stage!r}; ZeRO stages are 0 to 3")
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    # DeepSpeed offloads weights only at stage 3 (partitioned ones)
    offload_weights = stage == 3 and (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    return DeepSpeedSpec(shards_weights=stage >= 3, shards_gradients=stage >= 2, shards_optimizer=stage >= 1,
                         offload_weights=offload_weights, offload_optimizer=offload_optimizer, stage=stage,
                         file=source, config=config)


def filled_config(spec: DeepSpeedSpec, micro_batch_size: int, accumulation: int, world_size: int,
                  max_grad_norm: float | None, precision: str, hidden_size: int | None) -> dict:
    """The DeepSpeed config with its "auto" values taken from the plan, as the engine gets it. A set value that
    disagrees with the plan is refused (a ValueError): the plan is the run.

    tuneloop owns accumulation (token-weighted: each micro-batch's summed loss is divided by the step's target
    tokens before backward) and calls the engine's step once per optimizer step, so DeepSpeed runs in its
    unmanaged-accumulation mode and never divides the loss by the accumulation count itself."""
    config = json.loads(json.dumps(spec.config))  # a deep copy
    wanted = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": accumulation,
              "train_batch_size": micro_batch_size * accumulation * world_size,
              "gradient_clipping": float(max_grad_norm or 0.0)}
    yaml_names = {"train_micro_batch_size_per_gpu": "micro_batch_size",
                  "gradient_accumulation_steps": "gradient_accumulation_steps",
                  "train_batch_size": "micro_batch_size × gradient_accumulation_steps × world size",
                  "gradient_clipping": "max_grad_norm"}
    for key, value in wanted.items():
        given = config.get(key, "auto")
        if given != "auto" and float(given) != float(value):
            raise ValueError(f"`deepspeed: {spec.file}` sets {key} to {given}, but the plan has {value} "
                             f"(from {yaml_names[key]}); set it to \"auto\" or make the YAML agree")
        config[key] = value
    for name in ("bf16", "fp16"):
        block = config.setdefault(name, {})
        enabled = block.get("enabled", "auto")
        if enabled == "auto":
            block["enabled"] = precision == name
        elif enabled and precision != name:
            raise ValueError(f"`deepspeed: {spec.file}` sets {name}.enabled to {enabled}, but the YAML's "
                             f"precision is {precision}; set it to \"auto\" or make `bf16`/`fp16` agree")
        # enabled: false with `bf16: true` keeps fp32 weights in DeepSpeed; tuneloop's autocast computes in bf16
    zero = config.setdefault("zero_optimization", {"stage": 0})
    sizes = {"reduce_bucket_size": (hidden_size or 1024) ** 2,
             "stage3_prefetch_bucket_size": int(0.9 * (hidden_size or 1024) ** 2),
             "stage3_param_persistence_threshold": 10 * (hidden_size or 1024)}
    for key, value in sizes.items():  # the Trainer's fill-ins for these "auto"s
        if zero.get(key) == "auto":
            zero[key] = value
    if zero.get("stage", 0) < 2 and zero.get("overlap_comm"):
        # DeepSpeed overlaps the reduction with backward only where gradients are partitioned (stage 2/3) in the
        # accumulation mode tuneloop runs it in; below that it is a speed setting it refuses, so it is switched off
        warnings.warn(f"`deepspeed: {spec.file}`: zero_optimization.overlap_comm needs ZeRO stage 2 or 3 here; it "
                      "only changes speed, so it is turned off.", UserWarning, stacklevel=2)
        zero["overlap_comm"] = False
    compile_block = config.pop("compile", None)
    if compile_block:
        # axolotl's zero*_torch_compile.json: torch.compile under DeepSpeed, which only changes speed (DeepCompile,
        # which changes how ZeRO partitions, is refused where the file is read)
        warnings.warn(f"`deepspeed: {spec.file}` asks DeepSpeed to torch.compile the model (its `compile` block); "
                      "tuneloop compiles only models under its own DDP engine so far, so this runs uncompiled: the "
                      "same training, at eager speed.", UserWarning, stacklevel=2)
    config["managed_gradient_accumulation"] = False
    config["zero_allow_untested_optimizer"] = True  # the optimizer is tuneloop's (optim.py)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config["steps_per_print"] = 10 ** 12  # tuneloop logs the steps
    return config


# ---- the runtime ------------------------------------------------------------------------------------------
class DeepSpeedEngine(Engine):
    writes_shards = True
    reshards = False  # its optimizer partitions are fixed to the ranks that wrote them

    @property
    def lockstep_eval(self) -> bool:
        return self.spec.stage == 3  # ZeRO-3 gathers each layer from all ranks in every forward

    def prepare(self, module):
        import torch

        from tuneloop.optim import build_optimizer

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
            config = filled_config(self.spec, cfg.micro_batch_size, plan.gradient_accumulation_steps,
                                   plan.world_size, cfg.max_grad_norm, plan.resolved.precision.mixed, hidden)
        except ValueError as error:
            raise UserError(f"config: {error}") from None
        optimizer = build_optimizer(cfg, module.model)
        self.base_optimizer = optimizer
        if "WORLD_SIZE" not in os.environ:  # one process, in a group of one (engines/base.py)
            launcher_variable_for_one_process("LOCAL_RANK", "0")
        undo_when_the_group_is_left(forget_deepspeed_groups)
        undo_when_the_group_is_left(restore_functional_linear)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        if self.spec.stage == 3:
            # ZeRO-3 gathers a module's weights when its forward runs; the chunked loss uses the output head's
            # weight inside the root's forward without calling the head, so the root declares it its own
            for parameter in engine.module.weights_used_outside_their_module():
                deepspeed.zero.register_external_parameter(engine.module, parameter)
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

    def clip_grad_norm(self, max_norm: float | None):
        return None  # DeepSpeed clips inside its step (gradient_clipping = max_grad_norm)

    def optimizer_step(self) -> None:
        self.engine.step()  # clips, steps, and clears the gradients

    def zero_grad(self) -> None:
        pass  # done by the engine's step

    def grad_norm_of_last_step(self):
        """On the device, like the other engines' norms (the watchdog compares it there, without a sync)."""
        import torch

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
        try:  # frozen weights (an adapter's base) never change: the resume loads them from the base, as the start did
            self.engine.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False,
                                        exclude_frozen_parameters=self._has_frozen_weights())
        except Exception:
            import torch.distributed as dist

            dist.barrier()
            raise

    def load_shards(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder.parent), tag=folder.name, load_lr_scheduler_states=False,
                                              load_module_strict=not self._has_frozen_weights())
        if path is None:
            raise UserError(f"checkpoint: DeepSpeed could not load the shards in {folder}")

    def _has_frozen_weights(self) -> bool:
        return any(not parameter.requires_grad for parameter in self.engine.module.parameters())

    def full_state_dict(self) -> dict | None:
        """The weights to save, gathered onto the main process in host memory (collective). Where DeepSpeed holds
        the model in 16-bit, they are its fp32 masters, so every engine saves what it trained in fp32; else, ZeRO-1/2
        keep whole weights on every rank (None: the model saves itself) and ZeRO-3 gathers them."""
        if self.spec.sixteen_bit_weights(self.plan.resolved.precision.mixed):
            return self._fp32_masters()
        if self.spec.stage != 3:
            return None
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


    def _fp32_masters(self) -> dict:
        """Every parameter's fp32 master, assembled from the ranks' partitions one at a time (each a collective),
        and the persistent buffers, onto the main process."""
        from deepspeed.utils import safe_get_full_fp32_param

        model, main = self.engine.module.model, self.accelerator.is_main_process
        state = {}
        for name, param in model.named_parameters():
            if not param.requires_grad:  # frozen weights have no master (gathered by every rank: a collective)
                whole = _gathered(param)
                if main:  # in fp32 like the rest: the values DeepSpeed computed with (its cast rounded them)
                    state[name] = whole.float().cpu().clone()
                continue
            value = safe_get_full_fp32_param(param)
            if main:
                state[name] = value.detach().cpu().clone()
        if main:
            saved = set(model.state_dict())
            state.update({name: buffer.detach().cpu().clone() for name, buffer in model.named_buffers()
                          if name in saved})
        return state


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the process groups of its first engine in module globals; once the run's group is gone they
    name a destroyed group, and the next run in the process would fail in them ("Group ... is not registered")."""
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mesh_device", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()


def restore_functional_linear() -> None:
    """ZeRO-3 replaces `torch.nn.functional.linear` with its own for good (DeepSpeed: "this will persist unless
    manually reset"): a later run in this process (a test, a notebook) would send every Linear through it, and a
    torchao-quantized weight fails there. torch's own is put back."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def _gathered(param):
    """A parameter whole (a ZeRO-3 partition gathered; others are whole already)."""
    if not hasattr(param, "ds_id"):
        return param.detach()
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().clone()

