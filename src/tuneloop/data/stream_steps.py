"""The steps of a streamed run: each rank's rows read as the loop reaches them (data/stream.py), in step with
the other ranks.

With prepared data every rank can count every rank's target tokens before a step (the sampler is
deterministic), so the loss is normalised without a collective. A stream cannot: a rank knows only its own
rows. So each step, every rank reads and collates its micro-batches first, then one all-reduce of two numbers
(the step's target tokens on this rank, and whether this rank's share of the pass ran out) gives every rank
the step's token count. That is one small collective per step, issued before the step's forwards: on a GPU
its result is read on the host, so the host waits for the previous step's kernels to finish there (the next
step's rows are already read and collated by then); on one process there is no collective at all.

A bad row is met by the one rank whose share holds it: its message joins the same all-reduce (as a flag,
then gathered), so every rank stops at that step with the same error instead of the others waiting at the
next collective.

Passes are synchronised: when any rank's share of a pass runs out before it fills a step, every rank drops
the rows it read for that step and starts the next pass together, so no rank waits at a collective the
others never reach and every step holds the plan's number of rows. A pass that cannot fill one step on
every rank is an error rather than an endless loop.

Each rank's StreamPosition (the pass, its rows read, the tokens read but not yet trained) is saved in its
checkpoint file and restored on resume, so a resumed run reads exactly the rows the interrupted one would
have read next.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from tuneloop import run_files
from tuneloop.data.collate import MicroBatch, collator_for
from tuneloop.data.prepare import ChunkTokenizer, Limits, entry_rules
from tuneloop.data.steps import Step, TrainingSteps
from tuneloop.data.stream import MemoryRows, StreamPosition, TokenStream
from tuneloop.errors import UserError

WHOLE_DOCUMENTS = 1 << 62  # packed streams cut long documents into rows: the tokenizer drops none for length


STREAM_POSITION = "stream_position"  # in a rank's RNG file: where a streamed run's rank is in its stream


def read_stream_position(checkpoint: Path, rank: int, world_size: int) -> StreamPosition:
    """This rank's StreamPosition, as its streamed run saved it beside its RNG state (train/checkpoint.py writes
    it), on as many ranks: the shares are per rank."""
    written_by = json.loads((checkpoint / run_files.STATE).read_text())["plan"]["world_size"]
    if written_by != world_size:
        raise UserError(f"resume: {checkpoint} was written by {written_by} ranks and this run has {world_size}; a "
                        "streamed run's ranks each read their own share of the data, which another number of ranks "
                        f"would split differently. Launch {written_by} ranks, or start a fresh output_dir.")
    saved = checkpoint / run_files.RANK_RNG.format(rank=rank)
    position = torch.load(saved, weights_only=False).get(STREAM_POSITION) if saved.is_file() else None
    if position is None:
        raise UserError(f"resume: {checkpoint} holds no stream position for rank {rank}: it was written by a run "
                        "that prepared its data, or by fewer ranks (a stream's shares are per rank). Resume it "
                        "with the settings and ranks it was written with, or start a fresh output_dir.")
    return StreamPosition.from_json(position)


class StreamedSteps(TrainingSteps):
    """This rank's micro-batches, step by step, for a streamed run."""

    def __init__(self, cfg, plan, tokenizer, accelerator, hooks, position: StreamPosition | None = None,
                 decoder_start_token_id: int | None = None, encoder_decoder: bool = False):
        self.accelerator, self.hooks = accelerator, hooks
        self.micro_batch_size = cfg.micro_batch_size
        self.rows_per_step = cfg.micro_batch_size * plan.gradient_accumulation_steps
        packed = plan.train_batching.mode == "packed"
        entries = cfg.train_entries
        limits = Limits(WHOLE_DOCUMENTS if packed else cfg.sequence_len, cfg.train_on_inputs,
                        encoder_decoder=encoder_decoder)
        tokenize = ChunkTokenizer(tokenizer, entry_rules(cfg, entries, tokenizer), limits)
        # (shuffle_merged_datasets is always true: a stream shuffles each chunk of rows, by seed)
        self.stream = TokenStream(entries, tokenize, cfg.sequence_len, plan.data_rank(accelerator.process_index),
                                  plan.data_ranks, packed, position, shuffle_seed=cfg.seed)
        self.pad_token_id, self.packed, self.padding = tokenizer.pad_token_id, packed, plan.padding
        self.decoder_start_token_id = decoder_start_token_id
        self.rows_trained = 0  # the rows (packed: full rows) this session's steps trained on this rank
        # a resumed stream is inside a pass that already filled a step (saves come after whole steps)
        self.steps_in_pass = 1 if position is not None and (position.rows_read or position.carry_ids) else 0

    @property
    def passes(self) -> int:
        """Passes over the data started so far (the same on every rank)."""
        return self.stream.position.passes

    @property
    def position(self) -> StreamPosition:
        return self.stream.position

    def __iter__(self) -> Iterator[Step]:
        while True:
            batches, targets = self.next_step()
            yield Step(batches, targets, targets)  # (a stream trains the language-model loss: its unit is the token)

    def collate(self, micro) -> MicroBatch:
        return micro  # collated when the step was read, before its tokens were counted

    def epoch_at(self, step: int) -> float:
        """A stream has no length: the pass it is in, counted from 0."""
        return self.passes

    def read_counts(self, gather) -> dict:
        """The passes, and what every rank's stream read and left out this session (a collective)."""
        names, counts = zip(*self.counts().items())
        every_rank = gather(list(counts))
        return {"passes_started": self.passes + 1,
                **{name: sum(every_rank[i::len(names)]) for i, name in enumerate(names)}}

    def next_step(self) -> tuple[list[MicroBatch], int]:
        """This rank's micro-batches of the next step, and the step's target tokens over every rank."""
        while True:
            batches, ran_out, failure = [], False, None
            try:
                with self.hooks.phase("read stream"):
                    rows = []
                    while len(rows) < self.rows_per_step:
                        row = self.stream.next_row()
                        if row is None:
                            break
                        rows.append(row)
                ran_out = len(rows) < self.rows_per_step
                batches = [] if ran_out else self.collated(rows)
            except UserError as error:  # a bad row in this rank's share
                failure = str(error)
            except ValueError as error:  # rows a stream cannot carry (stream.py)
                failure = f"data: {error}"
            targets, out, failed = self.summed([sum(batch.n_targets for batch in batches), int(ran_out),
                                                int(failure is not None)])
            if failed:
                raise UserError(self.first_failure(failure))
            if not out:
                self.steps_in_pass += 1
                self.rows_trained += len(rows)
                return batches, targets
            if self.steps_in_pass == 0:
                raise UserError(f"data: a whole pass over the streamed data does not fill one step of "
                                f"{self.rows_per_step} rows on every one of the {self.accelerator.num_processes} "
                                "ranks; use more data, or lower micro_batch_size or gradient_accumulation_steps")
            self.stream.start_next_pass()  # on every rank at once: the rows read for this step belong to the old one
            self.steps_in_pass = 0

    def first_failure(self, failure: str | None) -> str:
        """The first failing rank's message, on every rank (a collective when there are several)."""
        if self.accelerator.num_processes == 1:
            return failure
        from accelerate.utils import gather_object

        return next(message for message in gather_object([failure]) if message is not None)

    def counts(self) -> dict:
        """What this rank's stream read and left out since this session started (not carried over a resume)."""
        stats = self.stream.stats
        return {"rows_read": stats.rows_read, "rows_trained": self.rows_trained,
                "dropped_too_long": stats.dropped_too_long,
                "dropped_no_trained_tokens": stats.dropped_no_trained_tokens,
                "rows_without_targets": self.stream.rows_without_targets}

    def collated(self, rows: list) -> list[MicroBatch]:
        with self.hooks.phase("collate"):
            batches = []
            for start in range(0, len(rows), self.micro_batch_size):
                store = MemoryRows(rows[start:start + self.micro_batch_size])
                collate = collator_for(store, self.pad_token_id, self.packed, self.padding,
                                       decoder_start_token_id=self.decoder_start_token_id)
                batches.append(collate(store.units))
            return batches

    def summed(self, counts: list[int]) -> list[int]:
        """The counts summed over every rank (one collective; none on one process)."""
        if self.accelerator.num_processes == 1:
            return counts
        local = torch.tensor(counts, dtype=torch.int64, device=self.accelerator.device)
        return [int(value) for value in self.accelerator.reduce(local, reduction="sum").tolist()]
