"""Read a dataset entry's rows from local files (json, jsonl, parquet, csv, arrow, text).

Each row comes back with where it was read from (`file:line` for JSON lines, `file row N`
otherwise), so that a later error about a missing field can point at the exact row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tuneloop.errors import UserError

# `entry` below is a dataset entry of the config (DatasetConfig); data/ sits under the config (prepare.py says why).

SUFFIX_TO_TYPE = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
                  ".arrow": "arrow", ".txt": "text"}


@dataclass(frozen=True)
class SourceRow:
    values: dict
    where: str  # e.g. "data/train.jsonl:17"


def data_files_of(entry) -> list[Path]:
    """The local files an entry reads, in a stable order."""
    base = Path(entry.path)
    if entry.data_files:
        names = [entry.data_files] if isinstance(entry.data_files, str) else entry.data_files
        # as in axolotl, data_files may be relative to a folder given as `path`
        files = [base / name if base.is_dir() and not Path(name).is_absolute() and not Path(name).exists()
                 else Path(name) for name in names]
    elif base.is_dir():
        files = sorted(p for p in base.rglob("*") if p.suffix in SUFFIX_TO_TYPE and p.is_file())
        if not files:
            raise UserError(f"data: folder {base} holds no .json/.jsonl/.parquet/.csv/.arrow/.txt files")
    else:
        files = [base]
    for file in files:
        if not file.is_file():
            raise UserError(f"data: no such file {file} (from datasets path {entry.path!r}); "
                            "tuneloop reads local files: give a path to a file or folder")
    return files


def _file_type(entry, file: Path) -> str:
    if entry.ds_type:
        return "json" if entry.ds_type == "jsonl" else entry.ds_type
    if file.suffix in SUFFIX_TO_TYPE:
        return SUFFIX_TO_TYPE[file.suffix]
    raise UserError(f"data: cannot tell the format of {file}; set `ds_type` (json, parquet, csv, arrow, text)")


def _json_rows(file: Path) -> Iterator[SourceRow]:
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise UserError(f"data: {file}:{line}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at column {column}); "
                        "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"data: {file}:{error.lineno}: malformed JSON: {error.msg}") from None
        for index, row in enumerate(rows):
            yield _checked_row(row, f"{file} row {index + 1}")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"data: {file}:{number}: malformed JSON line: {error.msg} (column {error.colno})") from None
        yield _checked_row(row, f"{file}:{number}")


def _checked_row(row, where: str) -> SourceRow:
    if not isinstance(row, dict):
        raise UserError(f"data: {where}: expected a JSON object, got {type(row).__name__}")
    return SourceRow(row, where)


def _table_rows(file: Path, kind: str) -> Iterator[SourceRow]:
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
        yield SourceRow(dict(row), f"{file} {label} {index + offset}")


def read_rows(entry) -> list[SourceRow]:
    rows: list[SourceRow] = []
    for file in data_files_of(entry):
        kind = _file_type(entry, file)
        rows.extend(_json_rows(file) if kind == "json" else _table_rows(file, kind))
    return rows
