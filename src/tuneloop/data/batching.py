"""Which rows go into which micro-batch on which rank, for one epoch — deterministically.

A micro-batch is a list of *rows*; a row is a list of sequence indices. Unpacked, a row
holds one sequence; packed, it holds as many as fit in `sequence_len`. The plan runs these
same functions to count steps exactly, so what the plan promises is what the loop gets.

Across ranks, micro-batches are dealt round-robin, and the epoch is cut to a whole number
per rank (every rank must run the same number of steps); the plan reports what is cut.
Every epoch has the same number of micro-batches (packing included: see
pack_best_fit_decreasing), which is what lets the plan count one epoch and trust it for all.

axolotl's ordering options: `curriculum_sampling` keeps the data's order (no shuffle: rows, packed rows and
micro-batches as the rows come; packed, it packs next-fit, since best fit takes the longest first);
`sample_packing_sequentially` packs next-fit, each sequence into the current row or, when it does not fit, a new
one, in order. Without curriculum the order it packs is one shuffle drawn for the
whole run (not one per epoch, which would change the number of rows from epoch to epoch and break the plan's
count); the packed rows are then shuffled each epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MEGABATCH_MICRO_BATCHES = 64  # group_by_length sorts within windows of this many micro-batches


@dataclass(frozen=True)
class BatchingSpec:
    mode: str  # "random", "group_by_length", "token_budget" or "packed"
    micro_batch_size: int
    sequence_len: int
    world_size: int
    seed: int
    ordered: bool = False  # curriculum_sampling: the data's order, never shuffled (packed: next-fit)
    sequential: bool = False  # sample_packing_sequentially: next-fit packing in order
    # token_budget: a micro-batch's tokens as padded (rows × its longest row, rounded up to `pad_multiple` as the
    # collator pads it, never past sequence_len) stay within this many; micro_batch_size rows at most
    token_budget: int | None = None
    pad_multiple: int = 1


def budgeted_micro_batches(order: np.ndarray, lengths: np.ndarray, spec: BatchingSpec) -> list[list[list[int]]]:
    """Rows longest first (equal lengths in `order`'s order), cut into micro-batches as they come: a row joins the
    current one while it has fewer than micro_batch_size rows and all of them, padded to its first (longest) row's
    width, stay within the budget. The cuts depend only on the sorted lengths, so every epoch has as many
    micro-batches and the plan's count holds; the shuffle decides which equal-length rows go together."""
    by_length = order[np.argsort(-lengths[order], kind="stable")]
    micro, current, width = [], [], 0
    for index in by_length.tolist():
        if current and (len(current) == spec.micro_batch_size or (len(current) + 1) * width > spec.token_budget):
            micro.append(current)
            current = []
        if not current:
            longest = int(lengths[index])
            width = max(longest, min(-(-longest // spec.pad_multiple) * spec.pad_multiple, spec.sequence_len))
        current.append([int(index)])
    if current:
        micro.append(current)
    return micro


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def _chunk(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def pack_best_fit_decreasing(indices: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of sequence indices, each summing to at most `capacity` tokens: longest first, each into the
    fullest bin it fits (best fit). The bins depend only on the multiset of lengths — equal lengths are
    interchangeable — so every epoch yields the same number of rows and the plan's count is exact;
    the shuffle decides which of the equal-length sequences share a row, and the rows' order."""
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    if len(order) and int(lengths[order[0]]) > capacity:  # preparation drops such rows: reaching here is a bug
        raise ValueError(f"a row of {int(lengths[order[0]])} tokens cannot be packed into rows of {capacity}")
    bins: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # room left -> bins with that room
    count_by_room = np.zeros(capacity + 1, dtype=np.int64)
    for index in order:
        length = int(lengths[index])
        fitting = np.flatnonzero(count_by_room[length:])
        if len(fitting):
            room = length + int(fitting[0])
            slot = by_room[room].pop()
            count_by_room[room] -= 1
        else:
            room, slot = capacity, len(bins)
            bins.append([])
        bins[slot].append(int(index))
        by_room[room - length].append(slot)
        count_by_room[room - length] += 1
    return bins


def pack_next_fit(order: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of sequence indices in `order`: each into the current bin while it fits, else into a new one."""
    bins: list[list[int]] = []
    room = 0
    for index in order:
        length = int(lengths[index])
        if length > capacity:  # preparation drops such rows: reaching here is a bug
            raise ValueError(f"a row of {length} tokens cannot be packed into rows of {capacity}")
        if length > room or not bins:
            bins.append([])
            room = capacity
        bins[-1].append(int(index))
        room -= length
    return bins


def epoch_batches(lengths: np.ndarray, spec: BatchingSpec, epoch: int, shuffle: bool = True) -> list[list[list[int]]]:
    """All micro-batches of one epoch, in order; a micro-batch is a list of rows."""
    n = len(lengths)
    rng = epoch_rng(spec.seed, epoch)
    shuffle = shuffle and not spec.ordered
    if (spec.sequential or spec.ordered) and spec.mode == "packed":  # best fit sorts longest first: not the order
        order = epoch_rng(spec.seed, 0).permutation(n) if shuffle else np.arange(n)  # one order for the run
        rows = pack_next_fit(order, lengths, spec.sequence_len)
        if shuffle:
            rows = [rows[i] for i in rng.permutation(len(rows))]
        return _chunk(rows, spec.micro_batch_size)
    order = rng.permutation(n) if shuffle else np.arange(n)
    if spec.mode == "packed":
        rows = pack_best_fit_decreasing(order, lengths, spec.sequence_len)
        if shuffle:  # packing puts the fullest rows first; shuffle so steps are alike
            rows = [rows[i] for i in rng.permutation(len(rows))]
        return _chunk(rows, spec.micro_batch_size)
    if spec.mode == "token_budget":
        micro = budgeted_micro_batches(order, lengths, spec)
        if shuffle:  # (long rows' micro-batches are not all at the start of the epoch)
            micro = [micro[i] for i in rng.permutation(len(micro))]
        return micro
    if spec.mode == "group_by_length":
        window = spec.micro_batch_size * spec.world_size * MEGABATCH_MICRO_BATCHES
        micro = []
        for start in range(0, n, window):
            chunk = order[start:start + window]
            by_length = chunk[np.argsort(-lengths[chunk], kind="stable")].tolist()
            micro.extend(_chunk([[index] for index in by_length], spec.micro_batch_size))
        if shuffle:  # similar lengths stay together inside a micro-batch, not across the epoch
            micro = [micro[i] for i in rng.permutation(len(micro))]
        return micro
    return _chunk([[int(index)] for index in order], spec.micro_batch_size)


def epoch_micro_batches(lengths: np.ndarray, spec: BatchingSpec, epoch: int,
                        shuffle: bool = True, even: bool = True) -> list[list[list[list[int]]]]:
    """Per rank, the epoch's micro-batches. `even` cuts the tail so every rank gets as many."""
    micro = epoch_batches(lengths, spec, epoch, shuffle)
    per_rank = [micro[rank::spec.world_size] for rank in range(spec.world_size)]
    if even:
        count = len(micro) // spec.world_size
        per_rank = [batches[:count] for batches in per_rank]
    return per_rank
