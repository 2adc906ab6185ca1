"""Which rows go into which micro-batch on which rank, for one epoch — deterministically.

A micro-batch is a list of *rows*; a row is a list of sequence indices. Unpacked, a row
holds one sequence; packed, it holds as many as fit in `sequence_len`. The plan runs these
same functions to count steps exactly, so what the plan promises is what the loop gets.

Across ranks, micro-batches are dealt round-robin, and the epoch is cut to a whole number
per rank (every rank must run the same number of steps); the plan reports what is cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MEGABATCH_MICRO_BATCHES = 64  # group_by_length sorts within windows of this many micro-batches
PACKING_GROUP_SEQUENCES = 100_000  # sequences packed together; bounds the cost of first-fit


@dataclass(frozen=True)
class BatchingSpec:
    mode: str  # "random", "group_by_length" or "packed"
    micro_batch_size: int
    sequence_len: int
    world_size: int
    seed: int


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def _chunk(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def pack_first_fit_decreasing(indices: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of sequence indices, each summing to at most `capacity` tokens (FFD, longest first)."""
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    room = np.empty(len(order), dtype=np.int64)
    bins: list[list[int]] = []
    for index in order:
        length = lengths[index]
        fits = np.flatnonzero(room[:len(bins)] >= length)
        if len(fits):
            slot = fits[0]
            bins[slot].append(int(index))
            room[slot] -= length
        else:
            room[len(bins)] = capacity - length
            bins.append([int(index)])
    return bins


def epoch_rows(lengths: np.ndarray, spec: BatchingSpec, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """All rows of one epoch, in the order they will be batched."""
    n = len(lengths)
    rng = epoch_rng(spec.seed, epoch)
    order = rng.permutation(n) if shuffle else np.arange(n)
    if spec.mode == "packed":
        rows = []
        for start in range(0, n, PACKING_GROUP_SEQUENCES):
            rows.extend(pack_first_fit_decreasing(order[start:start + PACKING_GROUP_SEQUENCES], lengths,
                                                  spec.sequence_len))
        if shuffle:  # FFD puts the fullest rows first; shuffle so steps are alike
            rows = [rows[i] for i in rng.permutation(len(rows))]
        return rows
    if spec.mode == "group_by_length":
        window = spec.micro_batch_size * spec.world_size * MEGABATCH_MICRO_BATCHES
        ordered = []
        for start in range(0, n, window):
            chunk = order[start:start + window]
            ordered.extend(chunk[np.argsort(-lengths[chunk], kind="stable")].tolist())
        micro = _chunk(ordered, spec.micro_batch_size)
        if shuffle:  # keep similar lengths together inside a micro-batch, not across the epoch
            micro = [micro[i] for i in rng.permutation(len(micro))]
        return [[index] for batch in micro for index in batch]
    return [[int(index)] for index in order]


def epoch_micro_batches(lengths: np.ndarray, spec: BatchingSpec, epoch: int,
                        shuffle: bool = True, even: bool = True) -> list[list[list[list[int]]]]:
    """Per rank, the epoch's micro-batches. `even` cuts the tail so every rank gets as many."""
    micro = _chunk(epoch_rows(lengths, spec, epoch, shuffle), spec.micro_batch_size)
    per_rank = [micro[rank::spec.world_size] for rank in range(spec.world_size)]
    if even:
        count = len(micro) // spec.world_size
        per_rank = [batches[:count] for batches in per_rank]
    return per_rank
