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
