"""Which engine a config asks for, from axolotl's keys as users write them (no torch here: `check` reads it).

- no `fsdp`/`deepspeed` key: DDP (ddp.py), every rank a whole copy; one process is this engine too;
- `fsdp` / `fsdp_version` / `fsdp_config`: FSDP2 (fsdp2.py reads its keys);
- `deepspeed: path/to.json`: DeepSpeed ZeRO, stage 1/2/3 from that file (deepspeed.py reads it);
- `dp_replicate_size` / `dp_shard_size` / `tensor_parallel_size` / `context_parallel_size`: the device mesh the
  engine runs on (mesh.py resolves them against the world size); replicas of FSDP2 shards are HSDP, and
  tensor_parallel_size splits each layer over its ranks (tensor_parallel.py), context_parallel_size each row's
  positions (context_parallel.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from tuneloop.engines.base import EngineSpec
from tuneloop.engines.ddp import DDPSpec
from tuneloop.engines.deepspeed import DeepSpeedSpec, read_deepspeed_keys
from tuneloop.engines.fsdp2 import FSDP2Spec, read_fsdp_keys
from tuneloop.engines.mesh import MeshKeys
from tuneloop.registry import Registry

ENGINES: Registry[type[EngineSpec]] = Registry("engine", "fsdp/deepspeed")
ENGINES.add("ddp", DDPSpec)
ENGINES.add("fsdp2", FSDP2Spec)
ENGINES.add("deepspeed", DeepSpeedSpec)


def read_engine(fsdp: Any, fsdp_version: Any, fsdp_config: dict | None, deepspeed: Any,
                config_dir: Path | None = None, mesh: MeshKeys = MeshKeys()) -> EngineSpec:
    """The engine the keys ask for, on the mesh `mesh` asks for (read_mesh_keys). A ValueError names the key and the
    fix (config/rules.py reports it)."""
    if deepspeed and (fsdp or fsdp_config):
        raise ValueError("`deepspeed` and `fsdp`/`fsdp_config` ask for two engines at once; keep one of them")
    if deepspeed:
        spec = read_deepspeed_keys(deepspeed, config_dir)
    elif fsdp or fsdp_config or fsdp_version:
        spec = read_fsdp_keys(fsdp, fsdp_version, fsdp_config or {})
    else:
        spec = DDPSpec()
    check_mesh_for(spec, mesh)
    return dataclasses.replace(spec, mesh_keys=mesh)


def read_mesh_keys(dp_replicate_size: Any = None, dp_shard_size: Any = None, tensor_parallel_size: Any = None,
                   context_parallel_size: Any = None, sequence_parallel_degree: Any = None) -> MeshKeys:
    """axolotl's N-D parallel sizes as written. A size of 1 is axolotl's default and means the axis is not there
    (its resolution treats it as unset)."""
    written = {"dp_replicate_size": dp_replicate_size, "dp_shard_size": dp_shard_size,
               "tensor_parallel_size": tensor_parallel_size, "context_parallel_size": context_parallel_size,
               "sequence_parallel_degree": sequence_parallel_degree}
    for key, size in written.items():
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"`{key}: {size!r}`: a size is a number of ranks, 1 or more (1: the axis is not used)")
    if context_parallel_size and sequence_parallel_degree and context_parallel_size != sequence_parallel_degree:
        raise ValueError(f"`context_parallel_size: {context_parallel_size}` and `sequence_parallel_degree: "
                         f"{sequence_parallel_degree}` (its older name) disagree; keep context_parallel_size")
    context = context_parallel_size or sequence_parallel_degree

    def axis(size):
        return size if size and size > 1 else None

    return MeshKeys(dp_replicate=axis(dp_replicate_size), dp_shard=axis(dp_shard_size),
                    tp=axis(tensor_parallel_size), cp=axis(context),
                    written=any(size is not None for size in written.values()))


def check_mesh_for(spec: EngineSpec, mesh: MeshKeys) -> None:
    """The sizes the engine can run: sharding and tensor parallel need FSDP2 (as in axolotl), and DeepSpeed's ZeRO
    partitions over every rank, with no replicate/shard split of its own."""
    if mesh.tp and spec.name != "fsdp2":
        raise ValueError(f"`tensor_parallel_size: {mesh.tp}` splits the layers over ranks on FSDP2's device mesh "
                         f"(as axolotl runs it), and this config asks for {spec.name}: add `fsdp_version: 2` and "
                         "`fsdp_config` (without `deepspeed`), or set tensor_parallel_size to 1")
    if mesh.cp and spec.name == "deepspeed":
        raise ValueError(f"`context_parallel_size: {mesh.cp}` with `deepspeed`: tuneloop runs context parallel on "
                         "DDP ranks or FSDP2's device mesh; remove `deepspeed` (FSDP2 with `fsdp_version: 2` shards "
                         "as ZeRO-3 does), or set context_parallel_size to 1")
    if spec.name == "ddp" and mesh.dp_shard:
        raise ValueError(f"`dp_shard_size: {mesh.dp_shard}` shards the model over ranks, which needs FSDP2: add "
                         "`fsdp_version: 2` and `fsdp_config`, as axolotl asks (or remove dp_shard_size for DDP)")
    if spec.name == "deepspeed" and (mesh.dp_shard or mesh.dp_replicate):
        given = " and ".join(f"`{key}: {size}`" for key, size in (("dp_replicate_size", mesh.dp_replicate),
                                                                   ("dp_shard_size", mesh.dp_shard)) if size)
        raise ValueError(f"{given} with `deepspeed`: ZeRO partitions over every rank and has no replicate/shard "
                         "split; remove them, or use FSDP2 (`fsdp_version: 2`) for HSDP")


def engine_of(cfg, quiet: bool = False) -> EngineSpec:
    """The engine a config's keys ask for (`fsdp`, `fsdp_config`, `deepspeed`, the mesh sizes), as written: a
    ValueError names the key and the fix (config/rules.py's `sharding` reports it). The readers warn about keys that
    only change speed; `quiet`: not again (the config's rules said it when the config was read)."""
    fsdp_config = dict(cfg.fsdp_config or {})
    if cfg.fsdp_final_state_dict_type:
        fsdp_config.setdefault("final_state_dict_type", cfg.fsdp_final_state_dict_type)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        mesh = read_mesh_keys(cfg.dp_replicate_size, cfg.dp_shard_size, cfg.tensor_parallel_size,
                              cfg.context_parallel_size, cfg.sequence_parallel_degree)
        return read_engine(cfg.fsdp, cfg.fsdp_version, fsdp_config, cfg.deepspeed, mesh=mesh)


def uncompiled_by(engine: EngineSpec) -> str | None:
    """What keeps torch.compile off, in words: a sharding engine, or context parallel (tuneloop compiles only
    unsharded models without context parallel so far); None: nothing."""
    if engine.name != "ddp":
        return engine.name
    return "context parallel" if engine.mesh_keys.cp else None


def rank_zero_loading_left_off(engine: EngineSpec, rl: str | None, quantized: str | None) -> str | None:
    """Why FSDP2's `cpu_ram_efficient_loading` (rank 0 alone reads the weights and sends the others their shards) is
    left off where every rank needs the weights before the engine starts, in words (config/rules.py warns with
    them); None: it holds, or was not asked for."""
    if engine.name != "fsdp2" or not getattr(engine, "loads_on_rank_zero", False):
        return None
    if quantized:
        return ("`fsdp_config.cpu_ram_efficient_loading` with 4/8-bit weights: every rank loads and quantizes the base "
                "itself (bitsandbytes' quantization state is not something rank 0 can send yet), so it only changes "
                "host memory here and is left off.")
    if rl:
        # the reference model (or its precomputed log-probs) is made from the policy before the engine sends the
        # other ranks their weights: on those ranks there would be none yet
        return (f"`fsdp_config.cpu_ram_efficient_loading` with `rl: {rl}`: every rank loads the weights itself (the "
                "reference model is made from them before rank 0 could send them), so it only changes host memory "
                "here and is left off.")
    return None


def run_engine(cfg, quantized: str | None) -> EngineSpec:
    """The engine the run uses: the keys' (read quietly: `sharding` said what they say), with rank 0's loading left
    off where it cannot hold (rank_zero_loading_left_off). `quantized`: hardware.quantized_loading's answer."""
    engine = engine_of(cfg, quiet=True)
    if rank_zero_loading_left_off(engine, cfg.rl, quantized):
        engine = dataclasses.replace(engine, loads_on_rank_zero=False)
    return engine
