"""How the ranks share the model: the engine a config asks for, read from axolotl's keys (no torch here).

- `ddp` (no `fsdp`/`deepspeed` key): every rank holds the whole model, gradients are averaged (Accelerate's DDP).
- `fsdp2`: axolotl's `fsdp` / `fsdp_version` / `fsdp_config` keys, run with torch's `fully_shard` (FSDP2):
  weights, gradients and optimizer state divided over the ranks, each decoder layer gathered when it runs.
- `deepspeed`: axolotl's `deepspeed: path/to.json`, ZeRO stage 1/2/3 from that file.

This module reads and checks the keys (the config calls it while validating, the plan reads the sharding degrees
for its memory per rank); train/engines.py builds each engine around the model.
"""

from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHIPPED_DEEPSPEED = Path(__file__).parent / "deepspeed_configs"

# fsdp_config keys of FSDP1 (and loading knobs) that change only speed or host memory under FSDP2: warned about
FSDP_SPEED_ONLY = {
    "sync_module_states": "every rank loads the same weights, so there is nothing to broadcast",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "limit_all_gathers": "an FSDP1 rate limiter; FSDP2 has none",
    "backward_prefetch": "FSDP2 prefetches the next layer itself",
    "forward_prefetch": "FSDP2 prefetches the next layer itself",
    "cpu_ram_efficient_loading": "every rank reads the weights into host memory before sharding them",
    "cpu_offload_pin_memory": "pinning only speeds up host-device copies",
}
FSDP_KEYS = {"version", "activation_checkpointing", "offload_params", "reshard_after_forward", "state_dict_type",
             "final_state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "sharding_strategy",
             "min_num_params", "mixed_precision_policy"} | set(FSDP_SPEED_ONLY)
FSDP_LIST_WORDS = {"full_shard", "shard_grad_op", "offload", "auto_wrap", "no_shard", "hybrid_shard",
                   "hybrid_shard_zero2"}
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")


@dataclass(frozen=True)
class Distributed:
    engine: str = "ddp"  # "ddp", "fsdp2" or "deepspeed"
    # what each rank holds 1/N of (the plan's memory per rank reads these)
    shards_weights: bool = False
    shards_gradients: bool = False
    shards_optimizer: bool = False
    # what lives in host memory instead of the device's
    offload_weights: bool = False
    offload_optimizer: bool = False
    # FSDP2
    reshard_after_forward: bool = True
    layer_classes: tuple[str, ...] = ()  # the modules sharded one by one (default: the model's decoder layers)
    activation_checkpointing: bool = False
    full_weights_in_checkpoints: bool = False  # state_dict_type FULL_STATE_DICT: each checkpoint also has safetensors
    # DeepSpeed
    zero_stage: int | None = None
    deepspeed_file: str | None = None
    deepspeed_config: dict = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        """Weights live in pieces on the ranks: the model is gathered to be saved whole (FSDP2, ZeRO-3)."""
        return self.shards_weights

    def describe(self, world_size: int | None = None) -> str:
        """In words; `world_size` None: over whatever ranks the run is launched on."""
        over = f" over {world_size} rank(s)" if world_size else ""
        among = f"divided by {world_size}" if world_size else "divided over the ranks"
        if self.engine == "ddp":
            return "DDP (a whole copy of the model on each rank)" if (world_size or 2) > 1 else "one process"
        if self.engine == "fsdp2":
            parts = ["weights, gradients and optimizer state " + among]
            if not self.reshard_after_forward:
                parts.append("weights kept gathered from forward to backward (shard_grad_op)")
            if self.offload_weights:
                parts.append("offloaded to host memory")
            return f"FSDP2{over}: " + "; ".join(parts)
        held = {1: "optimizer state", 2: "gradients and optimizer state",
                3: "weights, gradients and optimizer state"}.get(self.zero_stage, "nothing")
        offload = ", optimizer state in host memory" if self.offload_optimizer else ""
        offload += ", weights in host memory" if self.offload_weights else ""
        return f"DeepSpeed ZeRO-{self.zero_stage}{over}: {held} {among}{offload}"


def read_distributed(fsdp: Any, fsdp_version: Any, fsdp_config: dict | None, deepspeed: Any,
                     config_dir: Path | None = None) -> Distributed:
    """The engine the keys ask for. A ValueError names the key and the fix (config.py reports it)."""
    if deepspeed and (fsdp or fsdp_config):
        raise ValueError("`deepspeed` and `fsdp`/`fsdp_config` ask for two engines at once; keep one of them")
    if deepspeed:
        return _deepspeed(deepspeed, config_dir)
    if fsdp or fsdp_config or fsdp_version:
        return _fsdp(fsdp, fsdp_version, fsdp_config or {})
    return Distributed()


# ---- FSDP ------------------------------------------------------------------------------------------------
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


def _fsdp(fsdp: Any, fsdp_version: Any, fsdp_config: dict) -> Distributed:
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
    # accelerate's numbered spelling: 1 FULL_SHARD, 2 SHARD_GRAD_OP, 3 NO_SHARD, 4 HYBRID_SHARD, 5 _HYBRID_SHARD_ZERO2
    numbered = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "_HYBRID_SHARD_ZERO2"}
    strategy = numbered.get(strategy, strategy) if isinstance(strategy, int) else str(strategy or "").upper()
    if strategy and strategy not in numbered.values():
        raise ValueError(f"`fsdp_config.sharding_strategy: {options['sharding_strategy']}`: one of "
                         f"{', '.join(numbered.values())}")
    if "hybrid_shard" in words or "hybrid_shard_zero2" in words or strategy.startswith(("HYBRID", "_HYBRID")):
        raise ValueError("`fsdp` hybrid sharding (shard within a node, replicate across nodes) needs a 2-D device "
                         "mesh, which is tensor/context/expert parallelism tuneloop does not do yet; use full_shard")
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
    return Distributed(engine="fsdp2", shards_weights=True, shards_gradients=True, shards_optimizer=True,
                       offload_weights=bool(options.get("offload_params")) or "offload" in words,
                       offload_optimizer=bool(options.get("offload_params")) or "offload" in words,
                       reshard_after_forward=bool(reshard), layer_classes=layer_classes,
                       activation_checkpointing=bool(options.get("activation_checkpointing")),
                       full_weights_in_checkpoints=options.get("state_dict_type") == "FULL_STATE_DICT")


# ---- DeepSpeed ---------------------------------------------------------------------------------------------
def shipped_deepspeed_names() -> list[str]:
    return sorted(path.stem for path in SHIPPED_DEEPSPEED.glob("*.json"))


def deepspeed_file(value: str, config_dir: Path | None) -> Path:
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
                     + f" and among tuneloop's own: {', '.join(shipped_deepspeed_names())})")


def _deepspeed(value: Any, config_dir: Path | None) -> Distributed:
    if isinstance(value, dict):
        source, config = "(inline)", value
    else:
        path = deepspeed_file(str(value), config_dir)
        source = str(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"`deepspeed: {value}`: {path} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"`deepspeed: {value}`: the file must hold a JSON object")
    for block in ("optimizer", "scheduler"):
        if block in config:
            raise ValueError(f"`deepspeed: {value}` has a `{block}` block; tuneloop builds the {block} from the "
                             f"YAML (`optimizer:` / `lr_scheduler:`) so the plan holds: remove the block")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"`deepspeed: {value}`: zero_optimization.stage is {stage!r}; ZeRO stages are 0 to 3")
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    # DeepSpeed offloads weights only at stage 3 (partitioned ones)
    offload_weights = stage == 3 and (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    return Distributed(engine="deepspeed", shards_weights=stage >= 3, shards_gradients=stage >= 2,
                       shards_optimizer=stage >= 1, offload_weights=offload_weights,
                       offload_optimizer=offload_optimizer, zero_stage=stage, deepspeed_file=source,
                       deepspeed_config=config)


def deepspeed_16bit_weights(dist: Distributed, precision: str) -> bool:
    """DeepSpeed casts the model to bf16/fp16 (and steps fp32 master copies) when its file enables that precision,
    or leaves it at "auto" and the YAML's precision is that one. Its own bf16 is not the mixed precision of DDP and
    FSDP2: the weights the forward sees are 16-bit, and the masters start from them rounded (see the README)."""
    if dist.engine != "deepspeed" or precision not in ("bf16", "fp16"):
        return False
    return (dist.deepspeed_config.get(precision) or {}).get("enabled", "auto") in ("auto", True)


def filled_deepspeed_config(dist: Distributed, micro_batch_size: int, accumulation: int, world_size: int,
                            max_grad_norm: float | None, precision: str, hidden_size: int | None) -> dict:
    """The DeepSpeed config with its "auto" values taken from the plan, as the engine gets it. A set value that
    disagrees with the plan is refused: the plan is the run.

    tuneloop owns accumulation (token-weighted: each micro-batch's summed loss is divided by the step's target
    tokens before backward) and calls the engine's step once per optimizer step, so DeepSpeed runs in its
    unmanaged-accumulation mode and never divides the loss by the accumulation count itself."""
    config = json.loads(json.dumps(dist.deepspeed_config))  # a deep copy
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
            raise ValueError(f"`deepspeed: {dist.deepspeed_file}` sets {key} to {given}, but the plan has {value} "
                             f"(from {yaml_names[key]}); set it to \"auto\" or make the YAML agree")
        config[key] = value
    for name in ("bf16", "fp16"):
        block = config.setdefault(name, {})
        enabled = block.get("enabled", "auto")
        if enabled == "auto":
            block["enabled"] = precision == name
        elif enabled and precision != name:
            raise ValueError(f"`deepspeed: {dist.deepspeed_file}` sets {name}.enabled to {enabled}, but the YAML's "
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
        warnings.warn(f"`deepspeed: {dist.deepspeed_file}`: zero_optimization.overlap_comm needs ZeRO stage 2 or 3 "
                      "here; it only changes speed, so it is turned off.", UserWarning, stacklevel=2)
        zero["overlap_comm"] = False
    config["managed_gradient_accumulation"] = False
    config["zero_allow_untested_optimizer"] = True  # the optimizer is tuneloop's (optim.py)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config["steps_per_print"] = 10 ** 12  # tuneloop logs the steps
    return config
