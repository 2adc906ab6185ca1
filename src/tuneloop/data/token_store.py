"""Prepared rows on disk: written as they come, read back memory-mapped, never held whole in Python.

A store is a folder of flat binary arrays (little-endian, no header):

    input_ids.i32, labels.i32   every row's tokens, one row after the other
    offsets.i64                 where each row starts in them (rows + 1 values, the first 0)
    length.i32, n_targets.i32   one value per row
    label.i32                   one value per row, in stores of labelled rows only (KTO: 1 desirable, 0 not)
    source_length.i32           one value per row, in encoder-decoder stores only: a row is its encoder tokens
                                (this many, labels -100) followed by its decoder's target tokens
    images.json, images.i64     in stores of vision-language rows only: each row's images as JSON text
                                (data/images.py: references and their image tokens), and where each row's starts
    rows.json                   the row and token counts, and the group size (written last: a store without
                                it is incomplete)

Rows may come in groups: a preference pair is two rows (chosen, rejected), one after the other, and the
sampler deals out whole groups (units). `unit_column` gives a per-row column summed per unit.

This is the layout Arrow uses for a list column, without Arrow's record-batch chunks: any row is two slices
of one memory map, so the sampler and packer read `length` and `n_targets` as numpy arrays (8 bytes a row,
whatever the data), and the collator slices tokens without copying the dataset into Python lists. The bytes
depend only on the rows in their order, so a store is identical whichever process count prepared it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_COLUMNS = ("input_ids", "labels")
ROW_COLUMNS = ("length", "n_targets")
LABEL = "label"  # the optional row column of labelled rows
SOURCE = "source_length"  # the optional row column of encoder-decoder rows
FILE_TYPES = {"input_ids": np.int32, "labels": np.int32, "length": np.int32, "n_targets": np.int32,
              "offsets": np.int64, LABEL: np.int32, SOURCE: np.int32}
SUFFIX = {np.int32: ".i32", np.int64: ".i64"}
ROWS_FILE = "rows.json"
IMAGES, IMAGE_OFFSETS = "images.json", "images.i64"  # vision-language stores: each row's images (JSON text)


def column_file(folder: Path, name: str) -> Path:
    return folder / f"{name}{SUFFIX[FILE_TYPES[name]]}"


@dataclass
class TokenChunk:
    """Rows in order, flat: what a worker hands back for one chunk of source rows."""

    input_ids: np.ndarray  # int32, every row's tokens concatenated
    labels: np.ndarray  # int32, aligned with input_ids
    length: np.ndarray  # int32, one per row
    n_targets: np.ndarray  # int32, one per row
    label: np.ndarray | None = None  # int32, one per row, in labelled stores only
    source_length: np.ndarray | None = None  # int32, one per row, in encoder-decoder stores only
    images: list[str] | None = None  # one JSON text per row (data/images.py), in vision-language stores only

    @classmethod
    def empty(cls) -> "TokenChunk":
        nothing = np.zeros(0, dtype=np.int32)
        return cls(nothing, nothing, nothing, nothing)

    def __len__(self) -> int:
        return len(self.length)

    def rows(self, keep: np.ndarray) -> "TokenChunk":
        """The rows where `keep` (a boolean per row) is true."""
        per_token = np.repeat(keep, self.length)
        return TokenChunk(self.input_ids[per_token], self.labels[per_token], self.length[keep], self.n_targets[keep],
                          None if self.label is None else self.label[keep],
                          None if self.source_length is None else self.source_length[keep],
                          None if self.images is None else [text for text, kept in zip(self.images, keep) if kept])


class TokenStoreWriter:
    """Appends chunks to a new store in `folder`; `close()` writes rows.json and returns the row count."""

    def __init__(self, folder: Path, group: int = 1, labelled: bool = False, encoder_decoder: bool = False,
                 images: bool = False):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.group = group  # rows per unit (2: a preference pair); chunks hold whole groups
        self.labelled = labelled
        self.encoder_decoder = encoder_decoder
        self.optional = (*((LABEL,) if labelled else ()), *((SOURCE,) if encoder_decoder else ()))
        self.files = {name: open(column_file(folder, name), "wb") for name in FILE_TYPES
                      if name not in (LABEL, SOURCE) or name in self.optional}
        self.rows = 0
        self.tokens = 0
        np.zeros(1, dtype=np.int64).tofile(self.files["offsets"])
        self.images = images  # rows carry image references (a vision-language model's)
        self.image_bytes = 0
        if images:
            self.files[IMAGES] = open(folder / IMAGES, "wb")
            self.files[IMAGE_OFFSETS] = open(folder / IMAGE_OFFSETS, "wb")
            np.zeros(1, dtype=np.int64).tofile(self.files[IMAGE_OFFSETS])

    def write(self, chunk: TokenChunk) -> None:
        if not len(chunk):
            return
        for name in (*TOKEN_COLUMNS, *ROW_COLUMNS, *self.optional):
            np.ascontiguousarray(getattr(chunk, name), dtype=FILE_TYPES[name]).tofile(self.files[name])
        ends = self.tokens + np.cumsum(chunk.length, dtype=np.int64)
        ends.tofile(self.files["offsets"])
        if self.images:
            encoded = [text.encode() for text in chunk.images]
            self.files[IMAGES].write(b"".join(encoded))
            (self.image_bytes + np.cumsum([len(text) for text in encoded], dtype=np.int64)).tofile(
                self.files[IMAGE_OFFSETS])
            self.image_bytes += sum(len(text) for text in encoded)
        self.rows += len(chunk)
        self.tokens = int(ends[-1])

    def close(self) -> int:
        """Finishes the store; returns its units (rows, or pairs of rows)."""
        for handle in self.files.values():
            handle.close()
        counts = {"rows": self.rows, "tokens": self.tokens, **({"group": self.group} if self.group > 1 else {}),
                  **({"labelled": True} if self.labelled else {}),
                  **({"encoder_decoder": True} if self.encoder_decoder else {}),
                  **({"images": True} if self.images else {})}
        (self.folder / ROWS_FILE).write_text(json.dumps(counts))
        return self.rows // self.group


def _mapped(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:  # an empty file cannot be memory-mapped
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class TokenRows:
    """A store, read-only and memory-mapped. `rows[i]` is a row as a dict of lists and ints (as a `datasets`
    row is); `rows["length"]` a column (numpy for one-value columns, lists for token columns: small sets
    only); `rows.tokens("input_ids", i)` a row's tokens as a numpy view, which is what the collator uses."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        counts = json.loads((self.folder / ROWS_FILE).read_text())
        self.count, token_count = counts["rows"], counts["tokens"]
        self.group = counts.get("group", 1)  # rows per unit: 2 for preference pairs
        self.labelled = counts.get("labelled", False)
        self.encoder_decoder = counts.get("encoder_decoder", False)  # rows are encoder tokens, then targets
        self.optional = (*((LABEL,) if self.labelled else ()), *((SOURCE,) if self.encoder_decoder else ()))
        self.offsets = _mapped(column_file(self.folder, "offsets"), np.int64, self.count + 1)
        if self.count == 0:
            self.offsets = np.zeros(1, dtype=np.int64)
        self.columns = {name: _mapped(column_file(self.folder, name), np.int32, token_count)
                        for name in TOKEN_COLUMNS}
        self.columns.update({name: _mapped(column_file(self.folder, name), np.int32, self.count)
                             for name in (*ROW_COLUMNS, *self.optional)})
        self.has_images = counts.get("images", False)
        if self.has_images:
            self.image_offsets = np.fromfile(self.folder / IMAGE_OFFSETS, dtype=np.int64)

    def images(self, index: int) -> list:
        """A row's images: [reference, image tokens] pairs (data/images.py), read from disk when asked."""
        start, stop = int(self.image_offsets[index]), int(self.image_offsets[index + 1])
        with open(self.folder / IMAGES, "rb") as handle:
            handle.seek(start)
            return json.loads(handle.read(stop - start))

    def __len__(self) -> int:
        return self.count

    @property
    def units(self) -> int:
        """What the sampler deals out: rows, or groups of rows (preference pairs)."""
        return self.count // self.group

    def unit_column(self, name: str) -> np.ndarray:
        """A one-value column (length, n_targets) summed over each unit's rows."""
        column = self.columns[name]
        return column if self.group == 1 else np.asarray(column).reshape(-1, self.group).sum(axis=1)

    def unit_rows(self, unit: int) -> range:
        return range(unit * self.group, (unit + 1) * self.group)

    def tokens(self, name: str, index: int) -> np.ndarray:
        return self.columns[name][self.offsets[index]:self.offsets[index + 1]]

    def read_chunk(self, start: int, stop: int) -> TokenChunk:
        """Rows start..stop as a chunk, read into memory with plain reads (for passes over the whole store in
        blocks: pages of a memory map would stay counted in this process's resident memory)."""
        first, last = int(self.offsets[start]), int(self.offsets[stop])
        return TokenChunk(*(self._read(name, first, last - first) for name in TOKEN_COLUMNS),
                          *(self._read(name, start, stop - start) for name in ROW_COLUMNS),
                          self._read(LABEL, start, stop - start) if self.labelled else None,
                          self._read(SOURCE, start, stop - start) if self.encoder_decoder else None,
                          [json.dumps(self.images(index)) for index in range(start, stop)] if self.has_images else None)

    def _read(self, name: str, start: int, count: int) -> np.ndarray:
        dtype = np.dtype(FILE_TYPES[name])
        with open(column_file(self.folder, name), "rb") as handle:
            return np.fromfile(handle, dtype=dtype, count=count, offset=start * dtype.itemsize)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key in ROW_COLUMNS or key in self.optional:
                return self.columns[key]
            return [self.tokens(key, index).tolist() for index in range(self.count)]
        index = int(key)
        if not -self.count <= index < self.count:
            raise IndexError(f"row {key} of {self.count}")
        index %= self.count
        row = {name: self.tokens(name, index).tolist() for name in TOKEN_COLUMNS}
        row.update({name: int(self.columns[name][index]) for name in ROW_COLUMNS})
        row.update({name: int(self.columns[name][index]) for name in self.optional})
        return row

    def to_datasets(self):
        """The rows as a `datasets.Dataset` (for the Trainer in the benchmarks; it holds them in memory)."""
        import datasets

        return datasets.Dataset.from_dict({name: self[name] if name in TOKEN_COLUMNS else self[name].tolist()
                                           for name in (*TOKEN_COLUMNS, *ROW_COLUMNS)})
