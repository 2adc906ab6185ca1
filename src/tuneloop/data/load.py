"""Read a dataset entry's rows: local files (json, jsonl, parquet, csv, arrow, text, also compressed: gz, bz2, xz,
zst), or a hub dataset.

A compressed file is read as Hugging Face `datasets` reads it, by its last suffix (`train.jsonl.gz`): gzip, bzip2
and xz through Python's standard library, zstd through the `zstandard` package (as in `datasets`).

Each row comes back with where it was read from (`file:line` for JSON lines, `file row N`
otherwise), so that a later error about a missing field can point at the exact row. `split`
may take a slice of the rows (`train[:1%]`, `train[10%:]`, `train[:500]`), as in `datasets`.
A `path` that is no local file or folder is read with `datasets.load_dataset` (axolotl's `name`,
`data_files`, `split` and `revision` passed on): that needs the network, or the hub cache.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import importlib
import io
import itertools
import json
import lzma
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tuneloop.errors import UserError

# `entry` below is a dataset entry of the config (DatasetConfig); data/ sits under the config (prepare.py says why).

SUFFIX_TO_TYPE = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
                  ".arrow": "arrow", ".txt": "text"}

# a data file's last suffix -> its compression (the suffix before it says the format: train.jsonl.gz is JSON lines)
COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}


def format_suffix(file: Path) -> str:
    """The suffix that says a data file's format: `.jsonl` of both train.jsonl and train.jsonl.gz."""
    if file.suffix in COMPRESSIONS and len(file.suffixes) > 1:
        return file.suffixes[-2]
    return file.suffix


def compression_of(file: Path) -> str | None:
    return COMPRESSIONS.get(file.suffix)


@dataclass(frozen=True)
class SourceRow:
    values: dict
    where: str  # e.g. "data/train.jsonl:17"


SPLIT = re.compile(r"\s*([\w.-]+)\s*(?:\[\s*(\d+%?)?\s*:\s*(\d+%?)?\s*\])?\s*")


def parse_split(text: str) -> tuple[str, str | None, str | None]:
    """`train[10%:20%]` -> ("train", "10%", "20%"); ValueError naming the accepted forms."""
    match = SPLIT.fullmatch(text)
    if match is None:
        raise ValueError(f"got {text!r}; use a split name, optionally sliced: train, train[:1%], train[10%:], "
                         "train[:500], train[100:200]")
    return match.group(1), match.group(2), match.group(3)


# `datasets` builder names: `path: json` with local `data_files` reads those files (as in axolotl)
BUILDERS = {"json": "json", "csv": "csv", "parquet": "parquet", "arrow": "arrow", "text": "text"}


def is_hub_dataset(entry) -> bool:
    """A `path` that names no local file or folder and looks like a hub id (`name` or `owner/name`)."""
    path = entry.path
    if path in BUILDERS and entry.data_files:
        return False
    return (not Path(path).expanduser().exists() and not path.startswith(("/", ".", "~"))
            and format_suffix(Path(path)) not in SUFFIX_TO_TYPE and path.count("/") <= 1)


def data_files_of(entry) -> list[Path]:
    """The local files an entry reads, in a stable order (none for a hub dataset)."""
    if is_hub_dataset(entry):
        return []
    base = Path(entry.path).expanduser()
    if entry.data_files:
        names = [entry.data_files] if isinstance(entry.data_files, str) else entry.data_files
        # as in axolotl, data_files may be relative to a folder given as `path`
        files = [base / name if base.is_dir() and not Path(name).is_absolute() and not Path(name).exists()
                 else Path(name).expanduser() for name in names]
    elif base.is_dir():
        files = sorted(p for p in base.rglob("*") if format_suffix(p) in SUFFIX_TO_TYPE and p.is_file())
        if not files:
            raise UserError(f"data: folder {base} holds no .json/.jsonl/.parquet/.csv/.arrow/.txt files (nor any "
                            f"compressed: {'/'.join(COMPRESSIONS)})")
        _check_no_file_twice(files)
    else:
        files = [base]
    for file in files:
        if not file.is_file():
            raise UserError(f"data: no such file {file} (from datasets path {entry.path!r}); "
                            "tuneloop reads local files: give a path to a file or folder")
    return files


def _check_no_file_twice(files: list[Path]) -> None:
    """A folder holding a file and its compressed copy (train.jsonl and train.jsonl.gz) would train each row twice."""
    names = {file.with_suffix("") if compression_of(file) else file for file in files}
    if len(names) < len(files):
        twice = next(file for file in files if compression_of(file) and file.with_suffix("") in files)
        raise UserError(f"data: {twice} is a compressed copy of {twice.with_suffix('')} in the same folder, and both "
                        "would be read (each row twice); keep one, or name the file with `data_files`")


def check_compression(file: Path) -> None:
    """A compression this Python cannot read is said before a row is read: zstd needs `zstandard`."""
    if compression_of(file) != "zstd":
        return
    try:
        importlib.import_module("zstandard")  # (the package Hugging Face `datasets` reads zstd with)
    except ImportError:
        raise UserError(f"data: {file} is compressed with zstd, which Python reads with the `zstandard` package "
                        f"(as Hugging Face `datasets` does), not installed here: `pip install zstandard`, or "
                        f"decompress it (`zstd -d {file}`)") from None


def _file_type(entry, file: Path) -> str:
    check_compression(file)
    if entry.ds_type:
        return "json" if entry.ds_type == "jsonl" else entry.ds_type
    if entry.path in BUILDERS:
        return BUILDERS[entry.path]
    if format_suffix(file) in SUFFIX_TO_TYPE:
        return SUFFIX_TO_TYPE[format_suffix(file)]
    raise UserError(f"data: cannot tell the format of {file}; set `ds_type` (json, parquet, csv, arrow, text)")


@dataclass(frozen=True)
class RawRow:
    """A row as read, before it is checked: a JSON line's text (parsed where the row is rendered, which may be
    another process) or a row a table reader already made."""

    value: str | dict
    where: str


class ReadProgress:
    """Bytes of the data files read so far, against their total: what a progress bar shows."""

    def __init__(self, total_bytes: int, report=None):
        self.total_bytes, self.done_bytes, self.report = max(total_bytes, 1), 0, report

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes

    @property
    def fraction(self) -> float:
        return min(1.0, self.done_bytes / self.total_bytes)


@contextlib.contextmanager
def _opened(file: Path):
    """(the file's bytes, decompressed where it is compressed; the handle on the file itself, whose position
    counts the bytes read from disk, for the progress)."""
    with open(file, "rb") as raw:
        kind = compression_of(file)
        if kind is None:
            yield raw, raw
        elif kind == "zstd":
            import zstandard  # (check_compression said its absence)

            with zstandard.ZstdDecompressor().stream_reader(raw) as reader, io.BufferedReader(reader) as handle:
                yield handle, raw
        else:
            opener = {"gzip": lambda fileobj: gzip.GzipFile(fileobj=fileobj, mode="rb"), "bzip2": bz2.BZ2File,
                      "xz": lzma.LZMAFile}[kind]
            with opener(raw) as handle:
                yield handle, raw


def _json_rows(file: Path, progress: ReadProgress | None = None) -> Iterator[RawRow]:
    """Line by line (a JSON-lines file of any size streams); a file that is one JSON array is read whole."""
    try:
        yield from _json_rows_of(file, progress)
    except (OSError, EOFError, lzma.LZMAError, getattr(sys.modules.get("zstandard"), "ZstdError", OSError)) as error:
        if compression_of(file) is None:  # (a read error of a plain file is no decompression's)
            raise
        first = (str(error).splitlines() or [""])[0]
        raise UserError(f"data: {file} does not decompress as {compression_of(file)} (its suffix says it is): "
                        f"{type(error).__name__}: {first}; check the file, or name it by what it holds") from None


def _json_rows_of(file: Path, progress: ReadProgress | None) -> Iterator[RawRow]:
    """(A UTF-8 byte-order mark at the start, which Windows editors write, is read as nothing.)"""
    with _opened(file) as (handle, _):
        is_array = handle.read(4096).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")
    with _opened(file) as (handle, raw):
        if is_array:
            yield from _json_array_rows(file, handle.read().removeprefix(codecs.BOM_UTF8))
            if progress:
                progress.advance(file.stat().st_size)
            return
        compressed, done = raw is not handle, 0
        for number, line_bytes in enumerate(handle, start=1):
            if progress:  # (the bytes on disk: what the progress's total counts)
                read = raw.tell() if compressed else done + len(line_bytes)
                progress.advance(read - done)
                done = read
            if number == 1:
                line_bytes = line_bytes.removeprefix(codecs.BOM_UTF8)
            try:
                line = line_bytes.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(f"data: {file}:{number}: not valid UTF-8 (byte 0x{line_bytes[error.start]:02x} at "
                                f"column {error.start + 1}); save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                                ) from None
            if line.strip():
                yield RawRow(line, f"{file}:{number}")


def _json_array_rows(file: Path, raw: bytes) -> Iterator[RawRow]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise UserError(f"data: {file}:{line}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at column {column}); "
                        "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"data: {file}:{error.lineno}: malformed JSON: {error.msg}") from None
    for index, row in enumerate(rows):
        yield RawRow(row, f"{file} row {index + 1}")


def parse_row(raw: RawRow) -> SourceRow:
    """The row checked: a JSON line parsed, and a JSON object either way."""
    value = raw.value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise UserError(f"data: {raw.where}: malformed JSON line: {error.msg} (column {error.colno})") from None
    return _checked_row(value, raw.where)


def _checked_row(row, where: str) -> SourceRow:
    if not isinstance(row, dict):
        raise UserError(f"data: {where}: expected a JSON object, got {type(row).__name__}")
    return SourceRow(row, where)


def _table_rows(file: Path, kind: str, progress: ReadProgress | None = None) -> Iterator[RawRow]:
    import datasets  # heavy; only needed for these formats

    try:
        if kind == "arrow":
            table = datasets.Dataset.from_file(str(file))
        else:
            table = datasets.load_dataset(kind, data_files=str(file), split="train")
    except Exception as error:  # pyarrow and datasets raise many types for a malformed file
        raise UserError(f"data: {file} could not be read as {kind}: {type(error).__name__}: {error}") from None
    offset = 2 if kind == "csv" else 1  # csv line 1 is the header
    label = "line" if kind in ("csv", "text") else "row"
    for index, row in enumerate(table):
        yield RawRow(dict(row), f"{file} {label} {index + offset}")
    if progress:
        progress.advance(file.stat().st_size)


def stream_rows(entry, progress: ReadProgress | None = None) -> Iterator[RawRow]:
    """The entry's rows in order, one at a time (memory does not grow with the data); a sliced split
    (`train[:10%]`) counts the rows first when it is given in percent."""
    if is_hub_dataset(entry):
        return _hub_rows(entry)
    files = check_local_entry(entry)
    _, start, stop = parse_split(entry.split)

    def every_row(report: ReadProgress | None) -> Iterator[RawRow]:
        for file in files:
            kind = _file_type(entry, file)
            yield from _json_rows(file, report) if kind == "json" else _table_rows(file, kind, report)

    if start is None and stop is None:
        return every_row(progress)
    total = sum(1 for _ in every_row(None)) if "%" in f"{start}{stop}" else None
    first, last = slice_bounds(total, start, stop)
    return itertools.islice(every_row(progress), first, last)


def check_local_entry(entry) -> list[Path]:
    """A local entry's files, with what cannot be read from them refused before a row is read (a stream's entries
    are checked so when the run is planned, not when the loop reaches them)."""
    for key in ("name", "revision"):
        if getattr(entry, key):
            raise UserError(f"data: `{key}: {getattr(entry, key)}` applies to hub datasets, and {entry.path} is a "
                            f"local file or folder; remove `{key}`")
    split_name, _, _ = parse_split(entry.split)
    if split_name != "train":
        raise UserError(f"data: `split: {entry.split}` for {entry.path}: local files hold one split, `train` (sliced "
                        "if you like: train[:10%]); point `path` or `data_files` at the file of the split you want")
    return data_files_of(entry)


def slice_bounds(total: int | None, start: str | None, stop: str | None) -> tuple[int, int | None]:
    """Row positions of a slice; percentages need the total (and round to the closest row, as `datasets`)."""

    def position(bound: str | None, default):
        if bound is None:
            return default
        if bound.endswith("%"):
            return min(total, round(total * int(bound[:-1]) / 100))
        return int(bound) if total is None else min(total, int(bound))

    return position(start, 0), position(stop, total)


def read_rows(entry) -> list[SourceRow]:
    """Every row of the entry, checked, in a list (for small sets: preparation streams them instead)."""
    return [parse_row(raw) for raw in stream_rows(entry)]


def _hub_rows(entry) -> Iterator[RawRow]:
    import datasets  # heavy; only needed here

    options = {"name": entry.name, "data_files": entry.data_files, "revision": entry.revision}
    try:
        table = datasets.load_dataset(entry.path, split=entry.split, **{k: v for k, v in options.items() if v})
    except Exception as error:  # no network, no such dataset, a private one: the hub says it many ways
        raise UserError(f"data: cannot load the dataset {entry.path!r} (split {entry.split!r}) from the Hugging "
                        f"Face hub: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. "
                        "tuneloop reads local files and folders; for a hub dataset it needs the network "
                        "(or the hub's cache)") from None
    return (RawRow(dict(row), f"{entry.path} row {index + 1}") for index, row in enumerate(table))
