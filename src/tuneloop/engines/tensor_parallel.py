"""Tensor parallel (`tensor_parallel_size`): each decoder layer's projections split over the tp ranks of the device
mesh. The split is torch's own `parallelize_module` (DTensor), under FSDP2 on the data-parallel part of the mesh.

Which projection is split how is the model's own table: transformers' `base_model_tp_plan` in the config
(q/k/v and gate/up column-wise: each rank computes its own heads and its own slice of the MLP; o/down row-wise:
the partial outputs summed over the tp ranks, so the residual stream is whole on every rank). The embeddings,
norms and the output head stay whole on every tp rank (FSDP2 still shards them over the data ranks): the chunked
loss then runs as on one process, over whole logits rows, and no vocabulary-parallel cross-entropy is needed —
the head's weights are the part TP leaves whole, so for a large vocabulary the memory saving is the layers'.

The tp ranks of one data coordinate read the same rows (mesh.Mesh.data_rank). Every parameter that stays whole
gets the same gradient on each of them (the column-wise layers' backward sums their input's gradient over the
ranks), except the per-head norms some families have (Qwen3's and Gemma 3's q_norm/k_norm, "replicated with
gradient all-reduce" in transformers' table): each rank sees only its own heads, so their gradients are summed
over the tp ranks after the step's last backward (`sum_partial_gradients`).

The families tuneloop splits are those whose table holds only these three kinds of entry (LLaMA, Qwen2/2.5/3,
Mistral, Gemma 1/2/3, Phi-3 and others with the same table); a model without one, or with kinds it does not
handle (packed/fused projections, experts), is refused naming them.
"""

from __future__ import annotations

from tuneloop.errors import UserError

SPLIT_KINDS = {"colwise", "rowwise"}
SUMMED_KIND = "replicated_with_grad_allreduce"
HANDLED = SPLIT_KINDS | {SUMMED_KIND}


def layer_table(config) -> dict[str, str]:
    """transformers' tensor-parallel table of the model's decoder (module pattern -> kind), or {}."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def check_tensor_parallel(config, tp: int) -> None:
    """A UserError where `tensor_parallel_size: tp` cannot split this model: no table, kinds tuneloop does not
    handle, or head / MLP sizes the tp ranks do not divide. Read from the config alone (`plan --world-size`)."""
    name = getattr(config, "model_type", type(config).__name__)
    table = layer_table(config)
    if not table:
        raise UserError(f"config: `tensor_parallel_size: {tp}`: the {name} model has no tensor-parallel table in "
                        "transformers (base_model_tp_plan); tuneloop splits LLaMA, Qwen2/3, Mistral, Gemma and the "
                        "families that share their table: set tensor_parallel_size to 1 and shard with dp_shard_size")
    unhandled = sorted({kind for kind in table.values() if kind not in HANDLED})
    if unhandled:
        raise UserError(f"config: `tensor_parallel_size: {tp}`: the {name} model's table asks for "
                        f"{', '.join(unhandled)} splits, which tuneloop does not do (it splits column-wise and "
                        "row-wise projections); set tensor_parallel_size to 1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "intermediate_size": getattr(text, "intermediate_size", None)}
    for key, size in sizes.items():
        if isinstance(size, int) and size % tp:
            raise UserError(f"config: `tensor_parallel_size: {tp}` does not divide the model's {key} ({size}): "
                            "each tp rank computes a whole share of them; pick a size that divides "
                            f"{', '.join(f'{k} {v}' for k, v in sizes.items() if isinstance(v, int))}")


def split_share(facts, tp: int) -> float:
    """The share of the model's parameters one tp rank holds: the decoder layers' projections are divided by
    `tp`, the rest (embeddings, head, norms) is whole on every rank. (Norms are a tiny part of a layer: counted
    as divided.)"""
    if tp <= 1 or not facts.parameters:
        return 1.0
    split = facts.layer_parameters * facts.layers / facts.parameters
    return (1 - split) + split / tp


def parallelize(model, tp_mesh) -> list:
    """Splits the decoder layers' projections over `tp_mesh` (in place); returns the parameters whose gradients
    are partial per tp rank and must be summed over it (the per-head norms)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = model.config
    base = model.base_model if hasattr(model, "base_model") else model
    table = layer_table(config)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {pattern: styles[kind]() for pattern, kind in table.items() if kind in SPLIT_KINDS}
    language_model = getattr(base, "language_model", base)  # (a vision-language model's decoder)
    parallelize_module(language_model, tp_mesh, plan)
    summed = [pattern for pattern, kind in table.items() if kind == SUMMED_KIND]
    return [parameter for name, module in language_model.named_modules() if _matches(name, summed)
            for parameter in module.parameters(recurse=False) if parameter.requires_grad]


def _matches(name: str, patterns: list[str]) -> bool:
    from fnmatch import fnmatchcase

    atoms = name.split(".")
    return any(len(pattern.split(".")) == len(atoms)
               and all(fnmatchcase(atom, part) for atom, part in zip(atoms, pattern.split(".")))
               for pattern in patterns)


def sum_partial_gradients(parameters: list, tp_group) -> None:
    """Collective over the tp ranks, after the step's last backward: the per-head norms' gradients summed (each
    rank's holds its own heads' part). FSDP2 has already averaged them over the data ranks; a sum is linear, so
    the order does not matter."""
    import torch.distributed as dist

    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=tp_group)


def clip_grad_norm_over_meshes(parameters, max_norm: float):
    """The gradients' total norm, and clipping, when they are DTensors on different meshes (FSDP2's on the data
    ranks, tensor parallel's on data × tp): torch's clip_grad_norm_ stacks the norms, which DTensor refuses
    across meshes. Norms are taken per mesh (torch's own), made whole, then combined."""
    import torch
    from torch.nn.utils import get_total_norm

    grads_by_mesh: dict = {}
    for parameter in parameters:
        if parameter.grad is not None:
            mesh = getattr(parameter.grad, "device_mesh", None)
            grads_by_mesh.setdefault(id(mesh) if mesh is not None else None, []).append(parameter.grad)
    norms = []
    for grads in grads_by_mesh.values():
        norm = get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([norm.to(norms[0].device) for norm in norms]))
    if max_norm != float("inf"):
        # torch's clip_grad_norm_'s coefficient, as a number: a DTensor gradient is not multiplied by a tensor
        coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for grads in grads_by_mesh.values():
            for grad in grads:
                grad.mul_(coefficient)
    return total
