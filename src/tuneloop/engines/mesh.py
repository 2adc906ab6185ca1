"""The device mesh: axolotl's N-D parallel sizes resolved against the world size, and the torch DeviceMesh built from
them. The sizes are `dp_replicate_size`, `dp_shard_size`, `tensor_parallel_size` and `context_parallel_size`.

Resolution follows axolotl's `_get_parallel_config_kwargs` (utils/distributed.py): tensor and context parallel
take their ranks first; of the rest, a data-parallel size that is unset (or 1: axolotl's default, the same as
unset there) is filled from what remains. An engine that shards (FSDP2) fills `dp_shard` first, the replicating
ones (DDP) `dp_replicate`; given `dp_shard_size` alone, the rest are replicas (HSDP). A product that does not make
the world size is refused naming the numbers, at `plan --world-size N` before any process group exists.

torch is imported only where the mesh is built, so `check` and `plan` read the sizes without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuneloop.errors import UserError

AXES = ("dp_replicate", "dp_shard", "tp", "cp")  # the mesh's dimensions as the plan names them (axolotl's order)
# as the DeviceMesh lays them out, outermost first: cp before tp, so that FSDP2's dimension (dp_shard × cp, flattened)
# comes before tensor parallel's, which torch's 2-D composition of the two requires (torchtitan's order)
LAYOUT = ("dp_replicate", "dp_shard", "cp", "tp")
KEY_OF_AXIS = {"dp_replicate": "dp_replicate_size", "dp_shard": "dp_shard_size", "tp": "tensor_parallel_size",
               "cp": "context_parallel_size"}


@dataclass(frozen=True)
class MeshKeys:
    """The sizes as written; None: unset (or 1, which axolotl treats as unset)."""

    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    cp: int | None = None
    written: bool = False  # any of the keys was set (even to 1): the plan then shows the mesh

    def given(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES if getattr(self, axis) is not None}


@dataclass(frozen=True)
class Mesh:
    """The resolved sizes; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def data_ranks(self) -> int:
        """The ranks that read different rows: tensor- and context-parallel ranks of one data coordinate read the
        same rows (they split the model's or the sequence's work on them)."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, process_index: int) -> int:
        """Which rows a process reads. init_device_mesh lays ranks out row-major over LAYOUT, so the cp × tp ranks of
        one data coordinate are consecutive."""
        return process_index // (self.tp * self.cp)

    @property
    def hybrid(self) -> bool:
        """HSDP: replicated across groups, sharded within each."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    def __str__(self) -> str:
        return "mesh " + " × ".join(f"{axis} {size}" for axis, size in zip(AXES, self.shape))


def resolve_mesh(keys: MeshKeys, world_size: int, fills_shard: bool) -> Mesh:
    """The mesh `keys` ask for on `world_size` ranks. `fills_shard`: the engine shards (FSDP2, ZeRO), so an unset
    dp_shard takes the remaining ranks; else (DDP, which cannot shard: engines/keys.py refuses dp_shard_size > 1
    there) dp_replicate does. A UserError names the sizes and the world size."""
    world = max(world_size, 1)
    tp, cp = keys.tp or 1, keys.cp or 1
    if world % (tp * cp):
        raise UserError(_does_not_fit(world, f"tensor_parallel_size {tp} × context_parallel_size {cp} = {tp * cp} "
                                             "does not divide"))
    rest = world // (tp * cp)
    replicate, shard = keys.dp_replicate, keys.dp_shard if fills_shard else 1
    if replicate is None and shard is None:
        replicate, shard = 1, rest
    given = " × ".join(f"{KEY_OF_AXIS[axis]} {size}" for axis, size in keys.given().items())
    if (replicate is None) != (shard is None) and rest % (replicate or shard):  # the other one takes the rest
        raise UserError(_does_not_fit(world, f"{given} does not divide"))
    replicate = replicate if replicate is not None else rest // shard
    shard = shard if shard is not None else rest // replicate
    if replicate * shard != rest:
        raise UserError(_does_not_fit(world, f"{given} = {replicate * shard * tp * cp} does not make"))
    return Mesh(dp_replicate=replicate, dp_shard=shard, tp=tp, cp=cp)


def _does_not_fit(world: int, what: str) -> str:
    return (f"config: {what} the world size {world} (the ranks launched, or `plan --world-size`); make the sizes' "
            "product the world size, or leave one of dp_shard_size/dp_replicate_size unset to take the rest")


def build_device_mesh(mesh: Mesh, device_type: str):
    """torch's DeviceMesh of the resolved sizes, one named dimension per axis (sizes of 1 included: the axes TP
    and CP will use are there, empty, so every layout is the same 4-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(getattr(mesh, axis) for axis in LAYOUT), mesh_dim_names=LAYOUT)


def described(device_mesh) -> str:
    """A built DeviceMesh in the plan's words (what the run really made, to compare with the plan's line)."""
    sizes = dict(zip(device_mesh.mesh_dim_names, device_mesh.mesh.shape))
    return str(Mesh(**{axis: int(sizes.get(axis, 1)) for axis in AXES}))
