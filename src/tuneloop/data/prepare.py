"""Tokenize and mask every row once, split off the eval set, and cache the result as Arrow.

The cache key is a hash of everything that changes the prepared tokens: the data files'
bytes, the dataset entries, the tokenizer (vocabulary, special tokens, chat template) and
the settings sequence_len, train_on_inputs, val_set_size and seed. Same key, same tokens.

Like every module of data/, this one sits under the config (which validates a dataset's `type:`
against formats.FORMATS): it takes the config's objects (`cfg`, dataset entries) without importing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tuneloop.data.chat_templates import resolve_template
from tuneloop.data.formats import RenderContext, render_row
from tuneloop.data.labels import IGNORE_INDEX, count_targets
from tuneloop.data.load import data_files_of, read_rows
from tuneloop.errors import UserError
from tuneloop.run_files import make_readable

PREPARE_VERSION = 1  # bump when the tokenization or masking rules change


@dataclass
class PrepareStats:
    rows_read: int = 0
    dropped_too_long: int = 0
    dropped_no_trained_tokens: int = 0
    train_rows: int = 0
    eval_rows: int = 0


@dataclass
class PreparedData:
    train: "datasets.Dataset"  # noqa: F821  columns: input_ids, labels, length, n_targets
    eval: "datasets.Dataset | None"  # noqa: F821
    stats: PrepareStats
    cache_dir: Path


def tokenize_batch(rendered: list, tokenizer, train_on_inputs: bool) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels per row: a token is trained when its characters overlap a trained span.

    Rows are tokenized together (the fast tokenizer runs a batch in parallel, in Rust); all rows of
    a batch come from one dataset entry, so they share `add_special_tokens`.
    """
    encoded = tokenizer([r.text for r in rendered], add_special_tokens=rendered[0].add_special_tokens,
                        return_offsets_mapping=True)
    results = []
    for row, input_ids, offsets in zip(rendered, encoded["input_ids"], encoded["offset_mapping"]):
        spans = [(0, len(row.text))] if train_on_inputs else row.trained_spans
        ids = np.asarray(input_ids, dtype=np.int64)
        bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        trained = np.zeros(len(ids), dtype=bool)
        for span_start, span_end in spans:
            trained |= (starts < span_end) & (ends > span_start)
        trained &= ends > starts  # special tokens the tokenizer added have no characters
        labels = np.where(trained, ids, IGNORE_INDEX).tolist()
        input_ids = ids.tolist()
        if row.append_eos and tokenizer.eos_token_id is not None:
            input_ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id)
        results.append((input_ids, labels))
    return results


def _hash_file(path: Path, digest) -> None:
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)


def cache_key(cfg, tokenizer) -> str:
    digest = hashlib.sha256()
    settings = {
        "version": PREPARE_VERSION,
        "datasets": [entry.model_dump() for entry in cfg.datasets],
        "test_datasets": [entry.model_dump() for entry in cfg.test_datasets],
        "sequence_len": cfg.sequence_len,
        "train_on_inputs": cfg.train_on_inputs,
        "val_set_size": cfg.val_set_size,
        "shard": [cfg.dataset_shard_num, cfg.dataset_shard_idx],
        "seed": cfg.seed,
        "chat_template": resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer),
        "eot_tokens": cfg.eot_tokens,
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    for entry in cfg.datasets + cfg.test_datasets:
        for file in data_files_of(entry):
            digest.update(str(file).encode())
            _hash_file(file, digest)
    return digest.hexdigest()[:16]


TOKENIZE_BATCH_ROWS = 1000


def render_context(cfg, entry, tokenizer) -> RenderContext:
    """What rendering an entry's rows needs: its chat template (the entry's own, else the run's) and eot_tokens."""
    name = entry.chat_template or cfg.chat_template
    jinja = entry.chat_template_jinja or cfg.chat_template_jinja
    return RenderContext(tokenizer, resolve_template(name, jinja, tokenizer), tuple(cfg.eot_tokens or ()))


def _tokenize_entries(entries: list, cfg, tokenizer, stats: PrepareStats,
                      shard: tuple[int, int] | None = None) -> dict:
    columns = {"input_ids": [], "labels": [], "length": [], "n_targets": []}

    def keep_tokens(input_ids: list[int], labels: list[int]) -> None:
        if len(input_ids) > cfg.sequence_len:
            stats.dropped_too_long += 1
            return
        n_targets = count_targets(labels)
        if n_targets == 0:
            stats.dropped_no_trained_tokens += 1
            return
        columns["input_ids"].append(input_ids)
        columns["labels"].append(labels)
        columns["length"].append(len(input_ids))
        columns["n_targets"].append(n_targets)

    def keep(batch: list) -> None:
        for input_ids, labels in tokenize_batch(batch, tokenizer, cfg.train_on_inputs):
            keep_tokens(input_ids, labels)

    position = -1
    for entry in entries:
        batch = []
        context = render_context(cfg, entry, tokenizer)
        for row in read_rows(entry):
            position += 1
            if shard and position % shard[0] != shard[1]:  # axolotl's dataset_shard_num/idx: every N-th row
                continue
            stats.rows_read += 1
            if entry.type is None:
                keep_tokens(*pretokenized(row, len(tokenizer)))
                continue
            batch.append(render_row(row, entry, context))
            if len(batch) == TOKENIZE_BATCH_ROWS:
                keep(batch)
                batch = []
        if batch:
            keep(batch)
    return columns


def pretokenized(row, vocabulary: int) -> tuple[list[int], list[int]]:
    """A row given as tokens (a dataset entry without `type`, as in axolotl): `input_ids`, and `labels` with -100
    where nothing is trained (all of it is trained without labels). Ids outside the tokenizer's vocabulary are
    refused here, naming the row, rather than crashing the embedding lookup or the loss mid-training."""
    input_ids, labels = row.values.get("input_ids"), row.values.get("labels")
    if not isinstance(input_ids, list) or not all(isinstance(token, int) for token in input_ids):
        raise UserError(f"data: {row.where}: a dataset without `type` is read as tokens and needs `input_ids` (a list "
                        f"of token ids; fields present: {', '.join(sorted(row.values)) or 'none'}); or set `type`")
    if labels is None:
        labels = list(input_ids)
    if not isinstance(labels, list) or len(labels) != len(input_ids):
        raise UserError(f"data: {row.where}: `labels` must be a list as long as `input_ids` ({len(input_ids)})")
    outside = [token for token in input_ids if not 0 <= token < vocabulary]
    outside += [label for label in labels
                if label != IGNORE_INDEX and not (isinstance(label, int) and 0 <= label < vocabulary)]
    if outside:
        raise UserError(f"data: {row.where}: token id {outside[0]} is outside the tokenizer's vocabulary of "
                        f"{vocabulary} (labels may also be -100); were these rows made with another tokenizer?")
    return list(input_ids), list(labels)


def _split_eval(columns: dict, val_set_size: float, seed: int) -> tuple[dict, dict | None]:
    total = len(columns["length"])
    if not val_set_size:
        return columns, None
    n_eval = int(val_set_size) if val_set_size >= 1 else int(round(total * val_set_size))
    if n_eval >= total:
        raise UserError(f"config: `val_set_size: {val_set_size:g}` asks for {n_eval} eval rows, but the data has "
                        f"{total} usable rows: nothing would be left to train on. Lower it (a fraction such as "
                        "0.05 is a share of the rows).")
    n_eval = max(1, n_eval)
    order = np.random.default_rng(seed).permutation(total)
    eval_index, train_index = sorted(order[:n_eval]), sorted(order[n_eval:])
    pick = lambda index: {name: [values[i] for i in index] for name, values in columns.items()}  # noqa: E731
    return pick(train_index), pick(eval_index)


def _build(cfg, tokenizer, target: Path) -> None:
    import datasets

    stats = PrepareStats()
    shard = (cfg.dataset_shard_num, cfg.dataset_shard_idx) if cfg.dataset_shard_num else None
    train_columns = _tokenize_entries(cfg.datasets, cfg, tokenizer, stats, shard)
    if cfg.test_datasets:
        eval_columns = _tokenize_entries(cfg.test_datasets, cfg, tokenizer, stats)
    else:
        train_columns, eval_columns = _split_eval(train_columns, cfg.val_set_size, cfg.seed)
    stats.train_rows = len(train_columns["length"])
    stats.eval_rows = len(eval_columns["length"]) if eval_columns else 0
    if stats.train_rows == 0:
        raise UserError(f"data: no training rows left: read {stats.rows_read}, dropped {stats.dropped_too_long} "
                        f"longer than sequence_len={cfg.sequence_len} and {stats.dropped_no_trained_tokens} "
                        "with no trained tokens")
    if eval_columns is not None and stats.eval_rows == 0:
        raise UserError("data: the eval set is empty after filtering; check test_datasets or sequence_len")
    temp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    datasets.Dataset.from_dict(train_columns).save_to_disk(str(temp / "train"))
    if eval_columns is not None:
        datasets.Dataset.from_dict(eval_columns).save_to_disk(str(temp / "eval"))
    (temp / "stats.json").write_text(json.dumps(asdict(stats), indent=2))
    make_readable(temp)  # mkdtemp made it private
    try:
        os.replace(temp, target)  # atomic: a reader sees a complete cache or none
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)  # another process finished first; theirs is identical
        if not (target / "stats.json").exists():
            raise


def prepare(cfg, tokenizer, force: bool = False) -> PreparedData:
    import datasets

    datasets.disable_progress_bars()
    root = Path(cfg.dataset_prepared_path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()  # can we write here, not just look?
    except OSError as error:
        raise UserError(f"config: cannot write the prepared data in `dataset_prepared_path: {root}` "
                        f"({error.strerror or error}); choose a folder you can write to") from None
    target = root / cache_key(cfg, tokenizer)
    if force and target.exists():
        shutil.rmtree(target)
    if not (target / "stats.json").exists():
        _build(cfg, tokenizer, target)
    stats = PrepareStats(**json.loads((target / "stats.json").read_text()))
    train = datasets.load_from_disk(str(target / "train"))
    eval_set = datasets.load_from_disk(str(target / "eval")) if (target / "eval").exists() else None
    return PreparedData(train, eval_set, stats, target)
