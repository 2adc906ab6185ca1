"""The training rows of a run behind one interface, prepared whole or read as a stream.

The session, the plan and the loop never ask which: they ask the rows.

- `key`: what a checkpoint records of the data, to refuse a resume on other data (the cache's key, the stream's);
- `count_steps(...)`: what the plan needs, counted with the same sampler the loop runs (StepCounts);
- `steps(...)`: the loop's steps, from a resumed run's step on, each rank's micro-batches with the step's target
  tokens and units on every rank (TrainingSteps: also how to collate a micro-batch, how far through the data a
  step is, this rank's position for its checkpoint, and what a stream read this session).

Prepared rows (PreparedRows) are tokenized once into the store (prepare.py) and dealt out by the deterministic
sampler (batching.py), so every rank counts every rank's tokens before a step. Streamed rows (StreamedRows) are
read as the loop reaches them (stream.py, stream_steps.py), so steps and rows per step are exact and what the data
holds is counted as it comes. `prepare_rows` makes the one or the other: the only place that asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from tuneloop.data.batching import BatchingSpec, epoch_micro_batches
from tuneloop.data.collate import MicroBatch, Padding, collator_for
from tuneloop.data.images import image_inputs_of
from tuneloop.data.steps import Step, TrainingSteps
from tuneloop.kernels.packed_attention import attention_work, padded_attention_work


@dataclass(frozen=True, kw_only=True)
class StepCounts:
    """What the data gives the plan. None where a stream cannot know it before it is read."""

    train_rows: int  # units: rows, or preference pairs
    train_tokens: int
    trainable_tokens: int
    dropped_too_long: int  # what preparation left out (a stream counts it as it reads)
    dropped_no_trained_tokens: int
    dropped_identical_pairs: int
    dropped_too_short: int = 0  # `min_sample_len`
    dropped_duplicates: int = 0  # `dataset_exact_deduplication`
    micro_batches_per_epoch: int | None
    rows_cut_per_epoch: int
    steps_per_epoch: int | None
    total_steps: int
    epochs_to_run: int | None
    total_trainable_tokens: int | None
    total_real_tokens: int | None
    packing_efficiency: float | None
    padding_fraction: float | None
    max_micro_batch_tokens: int
    sequence_lengths: np.ndarray  # every sequence's length (the attention each token does: plan/flops.py)
    batch_rows_per_epoch: int | None = None  # the rows of an epoch's micro-batches, on every rank
    first_epoch_batches: list | None = None  # epoch 0's micro-batches per rank: the loop starts on them
    # an encoder-decoder's real tokens per side over the run, and the share of each side's positions that is padding
    encoder_tokens: int | None = None
    decoder_tokens: int | None = None
    encoder_padding_fraction: float | None = None
    decoder_padding_fraction: float | None = None
    rollout: dict | None = None  # online RL: the generations of the run (online_rl/rows.py)
    # packed runs: each micro-batch's attention work apart and under one mask (packed_attention.attention_work)
    packed_attention_work: list | None = None
    # padded runs: the same for each row's real tokens against the padded rows' mask (padded_attention_work)
    padded_attention_work: list | None = None


# ---- prepared rows -----------------------------------------------------------------------------------------
class PreparedRows:
    """Rows tokenized once into the store, dealt out by the sampler as the plan counted them."""

    def __init__(self, prepared, encoder_decoder: bool):
        self.prepared, self.encoder_decoder = prepared, encoder_decoder
        self.store = prepared.train

    @property
    def key(self) -> str:
        return self.prepared.cache_dir.name

    @property
    def units(self) -> int:
        return self.store.units

    def count_steps(self, spec: BatchingSpec, accumulation: int, padding: Padding, max_steps: int | None,
                    num_epochs: float) -> StepCounts:
        """Every step the run will take, walked on every rank with the loop's own sampler, its tokens counted."""
        from tuneloop.errors import UserError

        store = self.store
        lengths = np.asarray(store.unit_column("length"))
        targets = np.asarray(store.unit_column("n_targets"))
        first_epoch = epoch_micro_batches(lengths, spec, epoch=0)
        micro_per_rank = len(first_epoch[0])
        if micro_per_rank == 0:
            raise UserError(f"plan: {len(lengths)} training rows make fewer micro-batches than the "
                            f"{spec.world_size} ranks; lower micro_batch_size or use more data")
        steps_per_epoch = math.ceil(micro_per_rank / accumulation)
        total_steps = max_steps or steps_for_epochs(steps_per_epoch, num_epochs)
        epochs_to_run = math.ceil(total_steps / steps_per_epoch)
        walk = _TokenWalk(lengths, targets, np.asarray(store["length"]), store.group, padding, spec.mode,
                          np.asarray(store["source_length"]) if self.encoder_decoder else None)
        step = 0
        for epoch in range(epochs_to_run):
            per_rank = first_epoch if epoch == 0 else epoch_micro_batches(lengths, spec, epoch=epoch)
            for start in range(0, micro_per_rank, accumulation):
                step += 1
                if step > total_steps:
                    break
                for batches in per_rank:
                    for micro in batches[start:start + accumulation]:
                        walk.add(micro)

        used_rows = sum(len(micro) for batches in first_epoch for micro in batches)
        if spec.mode == "packed":
            rows_cut = len(lengths) - sum(len(row) for batches in first_epoch for micro in batches for row in micro)
        else:
            rows_cut = len(lengths) - used_rows
        real_epoch0 = sum(int(lengths[row].sum()) for batches in first_epoch for micro in batches for row in micro)
        packing_efficiency = padding_fraction = None
        if spec.mode == "packed":
            packing_efficiency = round(real_epoch0 / (used_rows * spec.sequence_len), 4)
        else:
            padding_fraction = round(1 - walk.real / walk.computed, 4) if walk.computed else 0.0
        sides = {}
        if self.encoder_decoder:
            (encoder, encoder_computed), (decoder, decoder_computed) = walk.sides.values()
            sides = {"encoder_tokens": encoder, "decoder_tokens": decoder,
                     "encoder_padding_fraction": round(1 - encoder / encoder_computed, 4) if encoder_computed else 0.0,
                     "decoder_padding_fraction": round(1 - decoder / decoder_computed, 4) if decoder_computed else 0.0}
        stats = self.prepared.stats
        return StepCounts(
            train_rows=len(lengths), train_tokens=int(lengths.sum()), trainable_tokens=int(targets.sum()),
            dropped_too_long=stats.dropped_too_long, dropped_no_trained_tokens=stats.dropped_no_trained_tokens,
            dropped_identical_pairs=stats.dropped_identical_pairs, dropped_too_short=stats.dropped_too_short,
            dropped_duplicates=stats.dropped_duplicates,
            micro_batches_per_epoch=micro_per_rank, rows_cut_per_epoch=rows_cut, steps_per_epoch=steps_per_epoch,
            total_steps=total_steps, epochs_to_run=epochs_to_run, total_trainable_tokens=walk.targets,
            total_real_tokens=walk.real, packing_efficiency=packing_efficiency, padding_fraction=padding_fraction,
            max_micro_batch_tokens=walk.largest, sequence_lengths=np.asarray(store["length"]),
            batch_rows_per_epoch=used_rows, first_epoch_batches=first_epoch,
            packed_attention_work=walk.attention if spec.mode == "packed" else None,
            padded_attention_work=(walk.attention or None) if spec.mode != "packed" else None, **sides)

    def rows_training_none_of(self, token_ids: set[int]) -> tuple[int, int]:
        """(rows whose trained tokens include none of these, rows): read in blocks, never all at once."""
        store, without = self.store, 0
        wanted = np.asarray(sorted(token_ids), dtype=np.int32)
        for start in range(0, len(store), 50_000):
            stop = min(start + 50_000, len(store))
            block = store.read_chunk(start, stop)
            hits = np.isin(block.labels, wanted).astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(block.length)[:-1]]).astype(np.int64)  # (rows hold ≥ 1 token)
            without += int((np.add.reduceat(hits, starts) == 0).sum()) if len(hits) else stop - start
        return without, len(store)

    def steps(self, plan, tokenizer, accelerator, hooks, *, start_step: int, resume_from=None,
              reference: dict | None = None, decoder_start_token_id: int | None = None,
              unit: str = "tokens", **online) -> TrainingSteps:
        return PreparedSteps(self, plan, tokenizer, plan.data_rank(accelerator.process_index), hooks, start_step,
                             reference or {}, decoder_start_token_id, unit)


def steps_for_epochs(steps_per_epoch: int, num_epochs: float) -> int:
    """The steps of `num_epochs` epochs; a fraction rounds up (as the Trainer does), on the decimal the user wrote
    (0.3 × 10 is 3 steps, not the 4 that 3.0000000000000004 would round up to)."""
    from fractions import Fraction

    return max(1, math.ceil(Fraction(str(num_epochs)) * steps_per_epoch))


class _TokenWalk:
    """The tokens of the micro-batches walked so far: targets, real ones, computed ones (padding included), the
    largest micro-batch, and an encoder-decoder's per side."""

    def __init__(self, lengths, targets, sequence_lengths, group: int, padding: Padding, mode: str, source_lengths):
        self.lengths, self.targets_per_unit, self.sequence_lengths = lengths, targets, sequence_lengths
        self.group, self.padding, self.mode, self.source_lengths = group, padding, mode, source_lengths
        self.targets = self.real = self.computed = self.largest = 0
        self.sides = {"encoder": [0, 0], "decoder": [0, 0]}  # an encoder-decoder's [real, computed] tokens per side
        self.attention = []  # each micro-batch's packed_attention.attention_work (padded: padded_attention_work)

    def add(self, micro: list) -> None:
        for row in micro:
            self.targets += int(self.targets_per_unit[row].sum())
            self.real += int(self.lengths[row].sum())
        if self.source_lengths is not None:  # encoder and decoder, each padded to its longest row
            encoder = np.concatenate([self.source_lengths[row] for row in micro])
            decoder = np.concatenate([self.lengths[row] for row in micro]) - encoder
            padded = 0
            for side, lengths in (("encoder", encoder), ("decoder", decoder)):
                width = self.padding.width(int(lengths.max()))
                self.sides[side][0] += int(lengths.sum())
                self.sides[side][1] += len(lengths) * width
                padded += len(lengths) * width
            self.computed += padded
            self.largest = max(self.largest, padded)
            return
        group = self.group
        if group > 1 and self.mode != "packed":  # a row per sequence
            real = [int(n) for row in micro for unit in row
                    for n in self.sequence_lengths[unit * group:(unit + 1) * group]]
        else:
            real = [int(self.lengths[row].sum()) for row in micro]
        width, rows = max(real), len(real)
        padded = self.padding.width(width)
        self.computed += rows * padded
        self.largest = max(self.largest, rows * padded)
        if self.mode == "packed":
            self.attention.append(attention_work([self._sequences(row, padded) for row in micro], padded))
        else:
            self.attention.append(padded_attention_work(real, padded))

    def _sequences(self, row: list, width: int) -> list[int]:
        """A packed row's sequence lengths as the collator lays them out: the padding after them is one more."""
        group = self.group
        lengths = [int(n) for unit in row for n in self.sequence_lengths[unit * group:(unit + 1) * group]]
        left = width - sum(lengths)
        return lengths + [left] if left > 0 else lengths


class PreparedSteps(TrainingSteps):
    """The plan's steps over the store, from `start_step` on (a resume starts at the exact micro-batch after its
    checkpoint, without reading or collating what was seen)."""

    def __init__(self, rows: PreparedRows, plan, tokenizer, rank: int, hooks, start_step: int, reference: dict,
                 decoder_start_token_id: int | None, unit: str):
        self.plan, self.rank, self.hooks, self.start_step = plan, rank, hooks, start_step
        store = rows.store
        self.lengths = np.asarray(store.unit_column("length"))  # per unit (a row, or a preference pair)
        self.targets_per_unit = np.asarray(store.unit_column("n_targets"))
        # what a step's loss is averaged over, per unit: its target tokens, or 1 (a pair)
        self.units_per_unit = self.targets_per_unit if unit == "tokens" else np.ones(len(self.lengths), np.int64)
        self.collator = collator_for(store, tokenizer.pad_token_id, plan.train_batching.mode == "packed",
                                     plan.padding, reference.get("train"), decoder_start_token_id,
                                     images=image_inputs_of(tokenizer))

    def __iter__(self) -> Iterator[Step]:
        plan, accum = self.plan, self.plan.gradient_accumulation_steps
        resumed_in = self.start_step // plan.steps_per_epoch
        for epoch in range(resumed_in, plan.epochs_to_run):
            with self.hooks.phase("sampler"):  # epoch 0's were made by the plan (a million rows pack in seconds)
                per_rank = (plan.first_epoch_batches if epoch == 0 and plan.first_epoch_batches is not None
                            else epoch_micro_batches(self.lengths, plan.train_batching, epoch))
            done = self.start_step - epoch * plan.steps_per_epoch if epoch == resumed_in else 0
            for start in range(done * accum, plan.micro_batches_per_epoch, accum):
                step_rows = [row for batches in per_rank for micro in batches[start:start + accum] for row in micro]
                yield Step(per_rank[self.rank][start:start + accum],
                           sum(int(self.targets_per_unit[row].sum()) for row in step_rows),
                           sum(int(self.units_per_unit[row].sum()) for row in step_rows))

    def collate(self, micro) -> MicroBatch:
        return self.collator(micro)

    def epoch_at(self, step: int) -> float:
        return round(step / self.plan.steps_per_epoch, 4)


# ---- streamed rows -----------------------------------------------------------------------------------------
class StreamedRows:
    """Rows read and tokenized as the loop reaches them, each rank its own share (stream_steps.py)."""

    def __init__(self, cfg, prepared, tokenizer, encoder_decoder: bool, packed: bool):
        from tuneloop.data.load import check_local_entry, is_hub_dataset

        self.cfg, self.prepared, self.tokenizer = cfg, prepared, tokenizer
        self.encoder_decoder, self.packed = encoder_decoder, packed
        for entry in cfg.train_entries:  # what the loop would meet at its first step, said before it
            if not is_hub_dataset(entry):
                check_local_entry(entry)

    @property
    def key(self) -> str:
        from tuneloop.data.prepare import stream_key

        return stream_key(self.cfg, self.tokenizer, self.encoder_decoder, self.packed)

    @property
    def units(self) -> None:
        return None  # not known before the stream is read

    def rows_training_none_of(self, token_ids: set[int]) -> None:
        return None  # not known before the stream is read

    def count_steps(self, spec: BatchingSpec, accumulation: int, padding: Padding, max_steps: int | None,
                    num_epochs: float) -> StepCounts:
        """`max_steps` steps of micro_batch_size × accumulation rows on every rank. Packed, every row is exactly
        sequence_len tokens, so the real tokens are exact too; targets, rows and passes are counted as read."""
        rows = spec.micro_batch_size * accumulation * spec.world_size
        sides = 2 if self.encoder_decoder else 1
        return StepCounts(
            train_rows=0, train_tokens=0, trainable_tokens=0, dropped_too_long=0, dropped_no_trained_tokens=0,
            dropped_identical_pairs=0, micro_batches_per_epoch=None, rows_cut_per_epoch=0,
            # (a stream's epochs are unknown: a longer run resumes as a longer run, with its schedule stretched)
            steps_per_epoch=None, total_steps=max_steps, epochs_to_run=None, total_trainable_tokens=None,
            total_real_tokens=max_steps * rows * spec.sequence_len if self.packed else None,
            packing_efficiency=1.0 if self.packed else None, padding_fraction=None,
            max_micro_batch_tokens=spec.micro_batch_size * spec.sequence_len * sides,
            # per row (a stream's rows are full rows of sequence_len: attention over whole rows is the upper bound)
            sequence_lengths=np.full(1, spec.sequence_len))

    def steps(self, plan, tokenizer, accelerator, hooks, *, start_step: int, resume_from=None,
              reference: dict | None = None, decoder_start_token_id: int | None = None,
              unit: str = "tokens", **online) -> TrainingSteps:
        from tuneloop.data.stream_steps import StreamedSteps, read_stream_position

        position = (read_stream_position(resume_from, accelerator.process_index, plan.world_size)
                    if resume_from is not None else None)
        return StreamedSteps(self.cfg, plan, tokenizer, accelerator, hooks, position, decoder_start_token_id,
                             self.encoder_decoder)


def prepare_rows(cfg, resolved, tokenizer, force: bool = False, hooks=None):
    """The run's training rows (and its eval set), prepared and cached once, or a stream to read as the run goes
    (its eval set is prepared whole); `hooks` hear of a cache being built."""
    from tuneloop.data.prepare import prepare, prepare_streamed_eval

    report = hooks.preparing if hooks is not None else None
    notice = hooks.notice if hooks is not None else None
    if resolved.streamed:
        prepared = prepare_streamed_eval(cfg, tokenizer, force=force, report=report, notice=notice,
                                         encoder_decoder=resolved.encoder_decoder)
        return StreamedRows(cfg, prepared, tokenizer, resolved.encoder_decoder, resolved.batching == "packed")
    prepared = prepare(cfg, tokenizer, force=force, report=report, notice=notice,
                       encoder_decoder=resolved.encoder_decoder)
    return PreparedRows(prepared, resolved.encoder_decoder)
