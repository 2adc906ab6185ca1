"""A run's steps as the loop reads them, whatever the rows come from (source.py): one step at a time, this
rank's micro-batches with the step's target tokens and units on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from tuneloop.data.collate import MicroBatch


@dataclass(frozen=True)
class Step:
    window: list  # this rank's micro-batches: store rows, or already collated (a stream's)
    targets: int  # the step's target tokens on every rank
    units: int  # what its loss is averaged over on every rank: its target tokens, or its pairs (KTO: rows)


class TrainingSteps:
    """What the loop reads of its data, step by step (see the module's text)."""

    def __iter__(self) -> Iterator[Step]:
        raise NotImplementedError

    def collate(self, micro) -> MicroBatch:
        raise NotImplementedError

    def epoch_at(self, step: int) -> float:
        raise NotImplementedError

    @property
    def position(self):
        """This rank's place in the data, for its checkpoint; None where the step number says it all."""
        return None

    def after_step(self, step: int) -> None:
        """Every rank, after the loop's optimizer step `step` (online RL checks what that step's forward found)."""

    def line_numbers(self) -> dict:
        """Numbers of the data's own for the next train line, over the steps since the last one (online RL: where
        the time went, generation or training, and the vLLM log-prob gap); {} for prepared data."""
        return {}

    def read_counts(self, gather) -> dict | None:
        """What this session read of the data, over every rank (`gather(counts)`: a collective); None: the plan
        said it all before training."""
        return None
