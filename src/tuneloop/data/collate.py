"""Turn a micro-batch (rows of sequence indices) into tensors.

Targets are shifted here, per sequence: `targets[t]` is the token the model must predict at
position t, and the last position of every sequence gets -100. So the loss never asks the
last token of one packed sequence to predict the first token of the next.

Packed rows carry `position_ids` that restart at 0 for each sequence and no attention mask:
transformers then builds a block-diagonal causal mask from the position ids (this needs
`use_cache=False`, which model/load.py sets). Unpacked rows carry an attention mask instead.

The sampler deals out units: rows of the store, or groups of them (a preference pair is its chosen and
rejected sequence). Unpacked, each sequence of a unit gets a row of its own; packed, a unit's sequences
share a packed row, each isolated by its positions. With groups, `extra["sequence_index"]` numbers every
sequence of the micro-batch (-1 on padding), chosen at even numbers, so a loss can sum per sequence;
KTO's labelled units add `extra["desirable"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tuneloop.data.labels import IGNORE_INDEX, shifted_targets


def pad_multiple() -> int:
    """Widths rounded up to 8 suit GPU tensor cores; on a CPU the extra columns are only extra work."""
    import torch

    return 8 if torch.cuda.is_available() else 1


# under torch.compile a new width is a new graph: widths rounded up to multiples of this make few shapes recur
COMPILE_PAD_MULTIPLE = 64


@dataclass(frozen=True)
class Padding:
    """How wide a micro-batch is: a fixed width (pad_to_sequence_len), or its longest row rounded up to a
    multiple, never past `limit` (sequence_len) by the rounding alone."""

    fixed: int | None = None
    multiple: int = 1
    limit: int | None = None

    def width(self, longest: int) -> int:
        if self.fixed:
            return self.fixed
        rounded = round_up(longest, self.multiple)
        return max(longest, min(rounded, self.limit)) if self.limit else rounded

    def unfixed(self) -> "Padding":
        """The same rounding without the fixed width (eval batches are as wide as their rows need)."""
        return Padding(None, self.multiple, self.limit)


def padding_for(cfg, compiled: bool, context_ranks: int = 1) -> Padding:
    """`context_ranks`: context parallel splits each row into that many equal slices (engines/context_parallel.py),
    so widths are multiples of it too."""
    import math

    multiple = math.lcm(COMPILE_PAD_MULTIPLE if compiled else pad_multiple(), context_ranks)
    return Padding(cfg.sequence_len if cfg.pad_to_sequence_len else None, multiple, cfg.sequence_len)


@dataclass
class MicroBatch:
    inputs: dict  # tensors for model(**inputs)
    targets: torch.Tensor  # (rows, width), -100 where no loss
    n_targets: int  # known on the host: no device sync to normalise the loss
    n_real_tokens: int
    extra: dict = field(default_factory=dict)  # for the objective: sequence_index, n_sequences, reference

    def to(self, device) -> "MicroBatch":
        def moved(value):
            return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value

        inputs = {name: moved(tensor) for name, tensor in self.inputs.items()}
        return MicroBatch(inputs, moved(self.targets), self.n_targets, self.n_real_tokens,
                          {name: moved(value) for name, value in self.extra.items()})


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def store_rows(units: list[list[int]], store, packed: bool) -> list[list[int]]:
    """A micro-batch of units as rows of store indices: one row per sequence unpacked, the packed row's units'
    sequences together packed."""
    if store.group == 1:
        return units
    if packed:
        return [[index for unit in row for index in store.unit_rows(unit)] for row in units]
    return [[index] for row in units for unit in row for index in store.unit_rows(unit)]


class Collator:
    def __init__(self, rows, pad_token_id: int, packed: bool, padding: Padding | None = None,
                 reference: np.ndarray | None = None):
        self.rows = rows  # a TokenRows: each sequence's tokens are numpy views of the memory-mapped store
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.padding = padding or Padding(multiple=pad_multiple())
        self.reference = reference  # precomputed reference log-probs, one per store row (preference data)

    def __call__(self, units: list[list[int]]) -> MicroBatch:
        rows = store_rows(units, self.rows, self.packed)
        row_ids, row_targets, row_positions = [], [], []
        for row in rows:
            ids = [self.rows.tokens("input_ids", index) for index in row]
            labels = [self.rows.tokens("labels", index) for index in row]
            row_ids.append(np.concatenate(ids) if ids else np.zeros(0, np.int32))
            # each sequence is shifted on its own: no sequence predicts the first token of the next
            row_targets.append(np.concatenate([shifted_targets(label) for label in labels]))
            row_positions.append(np.concatenate([np.arange(len(sequence)) for sequence in ids]))
        width = self.padding.width(max(len(ids) for ids in row_ids))
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, tgt, pos) in enumerate(zip(row_ids, row_targets, row_positions)):
            input_ids[i, :len(ids)] = torch.from_numpy(ids.astype(np.int64))
            targets[i, :len(tgt)] = torch.from_numpy(tgt.astype(np.int64))
            positions[i, :len(pos)] = torch.from_numpy(pos.astype(np.int64))
            attention[i, :len(ids)] = 1
        n_real = sum(len(ids) for ids in row_ids)
        n_targets = int((targets != IGNORE_INDEX).sum())
        extra = self.sequence_numbers(rows, width) if self.rows.group > 1 else {}
        if self.packed:
            # padding after the last sequence is its own "sequence" (positions restart at 0),
            # so no real token can attend to it
            for i, ids in enumerate(row_ids):
                positions[i, len(ids):] = torch.arange(width - len(ids))
            return MicroBatch({"input_ids": input_ids, "position_ids": positions}, targets, n_targets, n_real, extra)
        return MicroBatch({"input_ids": input_ids, "attention_mask": attention}, targets, n_targets, n_real, extra)

    def sequence_numbers(self, rows: list[list[int]], width: int) -> dict:
        """Each position's sequence in the micro-batch (in the order the units' sequences come: chosen, rejected,
        chosen, ...), and the precomputed reference log-probs of those sequences when there are some."""
        index = torch.full((len(rows), width), -1, dtype=torch.long)
        number = 0
        for i, row in enumerate(rows):
            start = 0
            for store_index in row:
                length = int(self.rows.offsets[store_index + 1] - self.rows.offsets[store_index])
                index[i, start:start + length] = number
                start += length
                number += 1
        extra = {"sequence_index": index, "n_sequences": number}
        sequences = [store_index for row in rows for store_index in row]
        if self.reference is not None:
            extra["reference"] = torch.from_numpy(self.reference[sequences].astype(np.float32))
        if self.rows.labelled:  # KTO: each unit's label, in the units' order (a unit's first sequence carries it)
            extra["desirable"] = torch.from_numpy(np.asarray(self.rows["label"])[sequences[0::2]] == 1)
        return extra


class Seq2SeqCollator:
    """An encoder-decoder's micro-batch: each row's encoder tokens padded on the right and masked in attention;
    its targets as the decoder's labels, and the decoder's inputs the targets shifted right behind
    `decoder_start_token_id` (what T5 and BART's `_shift_right` do). Encoder and decoder are each as wide as
    their longest row in the micro-batch (or sequence_len under pad_to_sequence_len). Decoder padding sits
    after every real target of its row, so the causal decoder never attends to it and the loss never sees it
    (-100): no decoder mask is needed."""

    def __init__(self, rows, pad_token_id: int, decoder_start_token_id: int, padding: Padding | None = None):
        self.rows = rows  # a TokenRows of an encoder-decoder store
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id
        self.padding = padding or Padding(multiple=pad_multiple())

    def __call__(self, units: list[list[int]]) -> MicroBatch:
        indices = [index for row in units for index in row]
        sources = self.rows.columns["source_length"]
        encoder, decoder, labels = [], [], []
        for index in indices:
            ids, row_labels = self.rows.tokens("input_ids", index), self.rows.tokens("labels", index)
            split = int(sources[index])
            encoder.append(ids[:split])
            decoder.append(ids[split:])
            labels.append(row_labels[split:])
        encoder_width = self.padding.width(max(len(ids) for ids in encoder))
        decoder_width = self.padding.width(max(len(ids) for ids in decoder))
        input_ids = torch.full((len(indices), encoder_width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(indices), encoder_width), dtype=torch.long)
        decoder_inputs = torch.full((len(indices), decoder_width), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(indices), decoder_width), IGNORE_INDEX, dtype=torch.long)
        for i, (source, target, target_labels) in enumerate(zip(encoder, decoder, labels)):
            input_ids[i, :len(source)] = torch.from_numpy(source.astype(np.int64))
            attention[i, :len(source)] = 1
            decoder_inputs[i, 0] = self.decoder_start_token_id
            decoder_inputs[i, 1:len(target)] = torch.from_numpy(target[:-1].astype(np.int64))
            targets[i, :len(target)] = torch.from_numpy(target_labels.astype(np.int64))
        n_real = sum(len(ids) for ids in encoder) + sum(len(ids) for ids in decoder)
        return MicroBatch({"input_ids": input_ids, "attention_mask": attention, "decoder_input_ids": decoder_inputs},
                          targets, int((targets != IGNORE_INDEX).sum()), n_real)


class ImageCollator:
    """A vision-language model's micro-batch: the causal one (its image tokens already in the rows), plus the
    images of its rows, decoded and processed now (the cache holds references only). An image whose size no
    longer gives the tokens its row was prepared with (the file changed since) is refused."""

    def __init__(self, text: Collator, images):
        self.text, self.images = text, images  # images: data/images.py's ImageInputs

    def __call__(self, units: list[list[int]]) -> MicroBatch:
        from tuneloop.data.images import image_size
        from tuneloop.errors import UserError

        batch = self.text(units)
        references = []  # per row of the batch: its images, in the order its text holds them
        for row in store_rows(units, self.text.rows, self.text.packed):  # (a packed row: its sequences' images)
            references.append([])
            for index in row:
                for reference, count in self.text.rows.images(index):
                    seen = self.images.seen_size(*image_size(reference, f"row {index}"))  # (image_size)
                    if self.images.tokens_for(*seen) != count:
                        raise UserError(f"data: image {reference.partition(':')[2][:200]} changed since the data was "
                                        "prepared (its size gives another number of image tokens); run `tuneloop "
                                        "preprocess CONFIG --force`")
                    references[-1].append(reference)
        batch.inputs.update(self.images.batch_inputs(batch.inputs["input_ids"], references))
        return batch


def collator_for(store, pad_token_id: int, packed: bool, padding: Padding | None = None, reference=None,
                 decoder_start_token_id: int | None = None, images=None):
    """The collator of a store: an encoder-decoder's (its rows say so), a vision-language model's (`images`: its
    ImageInputs), else the causal one."""
    if images is not None and getattr(store, "has_images", False):
        return ImageCollator(Collator(store, pad_token_id, packed, padding=padding, reference=reference), images)
    if store.encoder_decoder:
        start = pad_token_id if decoder_start_token_id is None else decoder_start_token_id
        return Seq2SeqCollator(store, pad_token_id, start, padding)
    return Collator(store, pad_token_id, packed, padding=padding, reference=reference)
