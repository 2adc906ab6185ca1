"""Turn a micro-batch (rows of sequence indices) into tensors.

Targets are shifted here, per sequence: `targets[t]` is the token the model must predict at
position t, and the last position of every sequence gets -100. So the loss never asks the
last token of one packed sequence to predict the first token of the next.

Packed rows carry `position_ids` that restart at 0 for each sequence and no attention mask:
transformers then builds a block-diagonal causal mask from the position ids (this needs
`use_cache=False`, which model.py sets). Unpacked rows carry an attention mask instead.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def padding_for(cfg) -> Padding:
    multiple = COMPILE_PAD_MULTIPLE if cfg.torch_compile else pad_multiple()
    return Padding(cfg.sequence_len if cfg.pad_to_sequence_len else None, multiple, cfg.sequence_len)


@dataclass
class MicroBatch:
    inputs: dict  # tensors for model(**inputs)
    targets: torch.Tensor  # (rows, width), -100 where no loss
    n_targets: int  # known on the host: no device sync to normalise the loss
    n_real_tokens: int

    def to(self, device) -> "MicroBatch":
        inputs = {name: tensor.to(device, non_blocking=True) for name, tensor in self.inputs.items()}
        return MicroBatch(inputs, self.targets.to(device, non_blocking=True), self.n_targets, self.n_real_tokens)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Collator:
    def __init__(self, rows, pad_token_id: int, packed: bool, padding: Padding | None = None):
        self.rows = rows  # a TokenRows: each sequence's tokens are numpy views of the memory-mapped store
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.padding = padding or Padding(multiple=pad_multiple())

    def __call__(self, rows: list[list[int]]) -> MicroBatch:
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
        if self.packed:
            # padding after the last sequence is its own "sequence" (positions restart at 0),
            # so no real token can attend to it
            for i, ids in enumerate(row_ids):
                positions[i, len(ids):] = torch.arange(width - len(ids))
            return MicroBatch({"input_ids": input_ids, "position_ids": positions}, targets, n_targets, n_real)
        return MicroBatch({"input_ids": input_ids, "attention_mask": attention}, targets, n_targets, n_real)
