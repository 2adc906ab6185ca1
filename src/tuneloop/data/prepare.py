"""Tokenize and mask every row once, split off the eval set, and cache the result on disk.

Rows stream through: read a chunk of rows (CHUNK_ROWS), render and tokenize it, write its tokens to the
store (token_store.py), next chunk. Nothing grows with the number of rows but the per-row counts written
to disk, so a million rows prepare in about the memory of a thousand. With `dataset_processes` above one
(axolotl's key; default: every core this process may use), chunks are tokenized by that many worker
processes, spawned with a pickled copy of the tokenizer (no torch in them: about 100 MB each), and their
results written in reading order: the store's bytes are the same for any process count, and the process
count is not part of the cache key.

The cache key is a hash of everything that changes the prepared tokens: the data files' bytes, the dataset
entries, the tokenizer (vocabulary, special tokens, chat template) and the settings sequence_len,
train_on_inputs, val_set_size and seed. Same key, same tokens.

Like every module of data/, this one sits under the config (which validates a dataset's `type:`
against formats.FORMATS): it takes the config's objects (`cfg`, dataset entries) without importing it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import re
import os
import pickle
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tuneloop.data.chat_templates import resolve_template
from tuneloop.data.formats import RenderContext, render_row
from tuneloop.data.images import (check_images_fit, checked_size, image_inputs_of, references_json,
                                  row_image_references)
from tuneloop.data.labels import IGNORE_INDEX, count_targets
from tuneloop.data.load import RawRow, ReadProgress, data_files_of, is_hub_dataset, parse_row, stream_rows
from tuneloop.data.mistral_chat import MistralChats, fingerprint, is_mistral_common
from tuneloop.data.preference import render_preference, render_unpaired
from tuneloop.data.stepwise import STEPWISE_TYPES, stepwise_tokens
from tuneloop.data.source_target import pretokenized_pair, tokenize_source_target
from tuneloop.data.token_store import TokenChunk, TokenRows, TokenStoreWriter
from tuneloop.errors import UserError
from tuneloop.run_files import make_readable

PREPARE_VERSION = 3  # bump when the tokenization or masking rules, or the store's layout, change
CHUNK_ROWS = 2000  # rows read, tokenized and written at a time (a worker's unit of work)
SPLIT_BLOCK_ROWS = 50_000  # rows per read when the eval rows are split off


@dataclass
class PrepareStats:
    rows_read: int = 0
    dropped_too_long: int = 0
    dropped_no_trained_tokens: int = 0
    dropped_identical_pairs: int = 0  # preference pairs whose chosen and rejected tokens are the same
    dropped_too_short: int = 0  # rows (pairs: either sequence) under `min_sample_len` tokens
    dropped_duplicates: int = 0  # rows (or pairs) whose tokens and labels repeat an earlier one's
    train_rows: int = 0  # units: rows, or preference pairs
    eval_rows: int = 0

    def add(self, other: "PrepareStats") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class PreparedData:
    train: TokenRows  # input_ids, labels (tokens), length, n_targets (one per row)
    eval: TokenRows | None
    stats: PrepareStats
    cache_dir: Path
    worker_processes: int = 0  # the processes besides this one that tokenized it (0: this one, or a cache hit)


def processes_for(cfg) -> int:
    """`dataset_processes`, else every core this process may run on."""
    if cfg.dataset_processes:
        return cfg.dataset_processes
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---- rows to tokens: the same code in this process and in workers ---------------------------------
@dataclass(frozen=True)
class EntryRules:
    """How one dataset entry's rows become tokens: the entry and its chat template's text."""

    entry: object  # a DatasetConfig
    template: str | None
    eot_tokens: tuple[str, ...]
    template_name: str | None = None  # the `chat_template` value the text came from (None: the tokenizer's)


@dataclass(frozen=True)
class ChunkJob:
    entry_index: int
    rows: list  # RawRow


@dataclass
class ChunkResult:
    tokens: TokenChunk
    stats: PrepareStats
    pid: int  # the process that tokenized it


@dataclass(frozen=True)
class Limits:
    """What a kept row must satisfy, and how rows group."""

    sequence_len: int
    train_on_inputs: bool
    # preference data: each source row becomes two sequences, kept or dropped together: (chosen, rejected), or
    # for KTO's labelled rows (`labelled`) (the row's reply, the row's prompt with another row's reply)
    paired: bool = False
    pair_in_one_row: bool = False  # packed preference data (train or eval): both sequences fit one row together
    labelled: bool = False
    # an encoder-decoder's rows: the prompt for the encoder, the trained text as the decoder's targets; each side
    # at most sequence_len tokens
    encoder_decoder: bool = False
    min_len: int = 0  # `min_sample_len`: shorter rows are dropped
def limits_of(cfg, encoder_decoder: bool = False) -> Limits:
    from tuneloop.rl_methods import RL_METHODS

    labelled = bool(cfg.rl) and not RL_METHODS[cfg.rl].paired
    two = two_sequences_a_row(cfg)
    packs = cfg.sample_packing or cfg.resolved_eval_sample_packing  # a pair packs whole, in train or eval rows
    return Limits(cfg.sequence_len, cfg.train_on_inputs, two, two and packs, labelled,
                  encoder_decoder, cfg.min_sample_len or 0)


def two_sequences_a_row(cfg) -> bool:
    """Each source row becomes two sequences kept together: preference data (`rl:`) or a reward model's pairs."""
    return bool(cfg.rl or cfg.reward_model)


class ChunkTokenizer:
    """Renders, tokenizes and masks a chunk of rows, and drops the rows the run cannot use."""

    def __init__(self, tokenizer, entries: list[EntryRules], limits: Limits):
        self.tokenizer, self.entries, self.limits = tokenizer, entries, limits
        self.sequence_len, self.train_on_inputs = limits.sequence_len, limits.train_on_inputs
        self.vision = image_inputs_of(tokenizer)  # a vision-language model's image side, or None
        placeholder = self.vision.family.placeholder if self.vision else None
        self.contexts = [RenderContext(tokenizer, rules.template, rules.eot_tokens, placeholder, rules.template_name)
                         for rules in entries]
        # a mistral-common tokenizer encodes chat rows itself (tokens, not text); it has no Rust backend
        self.chats = MistralChats(tokenizer) if is_mistral_common(tokenizer) else None
        self.encoder = None if self.chats else plain_encoder(tokenizer)
        self.vocabulary = len(tokenizer)

    def __call__(self, job: ChunkJob) -> ChunkResult:
        entry = self.entries[job.entry_index].entry
        rows = [parse_row(raw) for raw in job.rows]
        if self.limits.encoder_decoder:
            return self.kept_source_target(self.source_target(rows, entry, job.entry_index), len(rows))
        if entry.type is None:
            sequences = [pretokenized(row, self.vocabulary) for row in rows]
        elif entry.type in STEPWISE_TYPES:  # a process reward model's steps, labelled 0/1 at their ends
            sequences = [stepwise_tokens(row, entry, self.tokenizer, self.sequence_len) for row in rows]
        elif self.limits.labelled:
            rendered, desirable = render_unpaired(rows, entry, self.contexts[job.entry_index])
            return self.kept(tokenize_rendered(rendered, self.tokenizer, self.encoder, False), len(rows),
                             np.asarray(desirable, dtype=np.int32))
        elif self.limits.paired:
            context = self.contexts[job.entry_index]
            rendered = [half for row in rows for half in render_preference(row, entry, context)]
            sequences = tokenize_rendered(rendered, self.tokenizer, self.encoder, False)
        elif self.chats is not None:
            sequences = [self.chats.tokens(row, entry, self.train_on_inputs) for row in rows]
        elif self.vision is not None:
            sequences, images = self.with_images(rows, entry, self.contexts[job.entry_index])
            return self.kept(sequences, len(rows), images=images)
        else:
            context = self.contexts[job.entry_index]
            sequences = tokenize_rendered([render_row(row, entry, context) for row in rows], self.tokenizer,
                                          self.encoder, self.train_on_inputs)
        return self.kept(sequences, len(rows))

    def with_images(self, rows: list, entry, context: RenderContext) -> tuple[list, list[str]]:
        """A vision-language model's rows: each image's marker replaced by the text the processor writes for it
        (from the image's size: the row's length is final), that text never trained; and each row's image
        references for the collator."""
        from tuneloop.data.load import data_files_of

        files = data_files_of(entry)
        base_dir = files[0].parent if files else Path(".")
        rendered, images = [], []
        for row in rows:
            text = render_row(row, entry, context)
            references = row_image_references(text.images, row.values, row.where, base_dir)
            sizes = [checked_size(reference, row.where) for reference in references]
            spans = [(0, len(text.text))] if self.train_on_inputs else text.trained_spans
            expanded, spans, counts = self.vision.expanded(text.text, spans, sizes, row.where)
            check_images_fit(counts, references, sizes, self.sequence_len, self.vision.family, row.where)
            rendered.append(dataclasses.replace(text, text=expanded, trained_spans=spans))
            images.append(references_json(list(zip(references, counts))))
        # (train_on_inputs is in the spans already: the whole text but its images' text, newlines between tiles too)
        sequences = tokenize_rendered(rendered, self.tokenizer, self.encoder, False)
        never = np.asarray(self.vision.never_trained)
        return [(ids, np.where(np.isin(ids, never), IGNORE_INDEX, labels)) for ids, labels in sequences], images

    def source_target(self, rows: list, entry, entry_index: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """An encoder-decoder's rows: (encoder tokens then target tokens, their labels, how many are the encoder's)."""
        if entry.type is None:  # tokens as transformers' seq2seq collator takes them: input_ids, labels
            return [pretokenized_pair(row, self.vocabulary, self.tokenizer.pad_token_id) for row in rows]
        if entry.type == "completion":
            raise UserError(f"data: `type: completion` trains the whole text, and an encoder-decoder model needs a "
                            f"prompt for its encoder and a target for its decoder ({entry.path}): use `type: "
                            "seq2seq` with field_source/field_target, alpaca, or a chat dataset")
        context = self.contexts[entry_index]
        return tokenize_source_target([render_row(row, entry, context) for row in rows], self.tokenizer,
                                      self.encoder)

    def kept_source_target(self, sequences: list[tuple[np.ndarray, np.ndarray, int]], rows_read: int) -> ChunkResult:
        """The usable encoder-decoder rows: each side at most sequence_len tokens, and a target to train."""
        sources = np.fromiter((source for _, _, source in sequences), dtype=np.int64, count=len(sequences))
        lengths = np.fromiter((len(ids) for ids, _, _ in sequences), dtype=np.int64, count=len(sequences))
        n_targets = np.fromiter((np.count_nonzero(labels != IGNORE_INDEX) for _, labels, _ in sequences),
                                dtype=np.int64, count=len(sequences))
        too_long = np.maximum(sources, lengths - sources) > self.sequence_len
        untrained = ~too_long & (n_targets == 0)
        too_short = ~too_long & ~untrained & (lengths < self.limits.min_len)
        keep = ~too_long & ~untrained & ~too_short
        kept = [row for row, wanted in zip(sequences, keep) if wanted]
        tokens = TokenChunk(
            np.concatenate([ids for ids, _, _ in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
            np.concatenate([labels for _, labels, _ in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
            lengths[keep].astype(np.int32), n_targets[keep].astype(np.int32),
            source_length=sources[keep].astype(np.int32))
        return ChunkResult(tokens, PrepareStats(rows_read=rows_read, dropped_too_long=int(too_long.sum()),
                                                dropped_no_trained_tokens=int(untrained.sum()),
                                                dropped_too_short=int(too_short.sum())), os.getpid())

    def kept(self, sequences: list[tuple[np.ndarray, np.ndarray]], rows_read: int,
             desirable: np.ndarray | None = None, images: list[str] | None = None) -> ChunkResult:
        """The usable rows as a chunk; `desirable`: KTO's label of each source row (stored on both its sequences)."""
        lengths = np.fromiter((len(ids) for ids, _ in sequences), dtype=np.int64, count=len(sequences))
        n_targets = np.fromiter((count_targets(labels) for _, labels in sequences), dtype=np.int64,
                                count=len(sequences))
        too_long = lengths > self.sequence_len
        untrained = ~too_long & (n_targets == 0)
        short = lengths < self.limits.min_len
        identical = np.zeros(len(sequences), dtype=bool)
        if self.limits.paired:  # a pair is kept or dropped whole (and counted once)
            short = short.reshape(-1, 2).any(axis=1)
            too_long = too_long.reshape(-1, 2).any(axis=1)
            if self.limits.pair_in_one_row:
                too_long |= lengths.reshape(-1, 2).sum(axis=1) > self.sequence_len
            untrained = ~too_long & (n_targets.reshape(-1, 2) == 0).any(axis=1)
            if not self.limits.labelled:  # (a KTO row's mismatched reply may happen to be its own)
                identical = ~too_long & ~untrained & np.array(
                    [np.array_equal(sequences[i][0], sequences[i + 1][0]) for i in range(0, len(sequences), 2)],
                    dtype=bool)
            else:
                identical = np.zeros(len(sequences) // 2, dtype=bool)
        too_short = ~too_long & ~untrained & ~identical & short
        keep = ~too_long & ~untrained & ~identical & ~too_short
        per_sequence = np.repeat(keep, 2) if self.limits.paired else keep
        kept = [pair for pair, wanted in zip(sequences, per_sequence) if wanted]
        tokens = TokenChunk(
            np.concatenate([ids for ids, _ in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
            np.concatenate([labels for _, labels in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
            lengths[per_sequence].astype(np.int32), n_targets[per_sequence].astype(np.int32),
            np.repeat(desirable, 2)[per_sequence] if desirable is not None else None,
            images=None if images is None else [text for text, wanted in zip(images, per_sequence) if wanted])
        return ChunkResult(tokens, PrepareStats(rows_read=rows_read, dropped_too_long=int(too_long.sum()),
                                                dropped_no_trained_tokens=int(untrained.sum()),
                                                dropped_identical_pairs=int(identical.sum()),
                                                dropped_too_short=int(too_short.sum())), os.getpid())


def plain_encoder(tokenizer):
    """The fast tokenizer's Rust backend with truncation and padding off: what `tokenizer(texts)` runs, without
    building the Python dict of every encoding's fields (a third of the time, measured)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def tokenize_rendered(rendered: list, tokenizer, encoder, train_on_inputs: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and labels per row: a token is trained when its characters overlap a trained span.

    Rows are tokenized together; all rows of a chunk come from one dataset entry, so they share
    `add_special_tokens`.
    """
    if not rendered:
        return []
    encodings = encoder.encode_batch([row.text for row in rendered], add_special_tokens=rendered[0].add_special_tokens)
    eos = tokenizer.eos_token_id
    results = []
    for row, encoding in zip(rendered, encodings):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        bounds = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        spans = [(0, len(row.text))] if train_on_inputs else row.trained_spans
        trained = np.zeros(len(ids), dtype=bool)
        for span_start, span_end in spans:
            trained |= (starts < span_end) & (ends > span_start)
        trained &= ends > starts  # special tokens the tokenizer added have no characters
        labels = np.where(trained, ids, IGNORE_INDEX)
        if row.append_eos and eos is not None:
            ids, labels = np.append(ids, eos), np.append(labels, eos)
        results.append((ids, labels))
    return results


FILE_DIGESTS = ".file-digests.json"  # in dataset_prepared_path: each data file's sha256 by path, size and mtime


def file_digest(path: Path, known: dict) -> str:
    """The file's sha256, read again only when its size or modification time changed since it was last hashed
    (`known` is the memo, updated here): a resumed run or a second `plan` does not read a large dataset again."""
    status = path.stat()
    stamp = {"size": status.st_size, "mtime_ns": status.st_mtime_ns}
    remembered = known.get(str(path.resolve()))
    if remembered and {name: remembered.get(name) for name in stamp} == stamp:
        return remembered["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    known[str(path.resolve())] = {**stamp, "sha256": digest.hexdigest()}
    return digest.hexdigest()


def _read_digests(root: Path) -> dict:
    try:
        return json.loads((root / FILE_DIGESTS).read_text())
    except (OSError, ValueError):
        return {}


def _write_digests(root: Path, known: dict) -> None:
    """Atomically, so that ranks and runs sharing the folder never read a torn memo (a lost update is only a
    hash computed again)."""
    try:
        handle, temp = tempfile.mkstemp(prefix=".tmp-digests-", dir=root)
        with os.fdopen(handle, "w") as out:
            json.dump(known, out)
        os.replace(temp, root / FILE_DIGESTS)
    except OSError:
        pass  # a read-only cache folder: the key is still right, only computed again next time


def cache_key(cfg, tokenizer, encoder_decoder: bool = False) -> str:
    digest = hashlib.sha256()
    settings = {
        "version": PREPARE_VERSION,
        "datasets": [entry.model_dump() for entry in cfg.datasets],
        "test_datasets": [entry.model_dump() for entry in cfg.test_datasets],
        "sequence_len": cfg.sequence_len,
        "train_on_inputs": cfg.train_on_inputs,
        **({"deduplicated": True} if cfg.dataset_exact_deduplication else {}),
        **({"min_sample_len": cfg.min_sample_len} if cfg.min_sample_len else {}),
        "preference": [limits_of(cfg).paired, limits_of(cfg).pair_in_one_row, limits_of(cfg).labelled],
        **({"encoder_decoder": True} if encoder_decoder else {}),
        "val_set_size": cfg.val_set_size,
        "shard": [cfg.dataset_shard_num, cfg.dataset_shard_idx],
        "seed": cfg.seed,
        "chat_template": resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer),
        "eot_tokens": cfg.eot_tokens,
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        **({"images": image_settings(image_inputs_of(tokenizer))} if image_inputs_of(tokenizer) else {}),
    }
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(vocabulary_bytes(tokenizer))
    digest.update(data_files_digest(cfg, cfg.datasets + cfg.test_datasets).encode())
    return digest.hexdigest()[:16]


def image_settings(vision) -> dict:
    """What changes a vision-language row's image tokens: the family, the image processor's settings (with
    `processor_kwargs` applied) and the resize before it (`image_size`, `image_resize_algorithm`)."""
    return {"family": vision.family.name, "image_processor": vision.image_processor.to_json_string(),
            "processor": vision.processor.to_json_string() if vision.processor is not None else None,
            **({"resize": [vision.image_size, vision.resample]} if vision.image_size is not None else {})}


def vocabulary_bytes(tokenizer) -> bytes:
    """The tokenizer's vocabulary and rules, for the cache key: the fast tokenizer's JSON, mistral-common's file."""
    if is_mistral_common(tokenizer):
        return fingerprint(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode()


def data_files_digest(cfg, entries: list) -> str:
    """One hash of the entries' files (paths and bytes), each file hashed again only when it changed."""
    digest = hashlib.sha256()
    root = Path(cfg.dataset_prepared_path)
    known = _read_digests(root)
    before = json.dumps(known, sort_keys=True)
    for entry in entries:
        for file in data_files_of(entry):
            digest.update(str(file).encode())
            digest.update(file_digest(file, known).encode())
    if json.dumps(known, sort_keys=True) != before:
        _write_digests(root, known)
    return digest.hexdigest()


def pretokenized(row, vocabulary: int) -> tuple[np.ndarray, np.ndarray]:
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
    return np.asarray(input_ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)




# ---- reading in chunks, tokenizing them here or in workers ------------------------------------------
def entry_rules(cfg, entries: list, tokenizer) -> list[EntryRules]:
    """Each entry's chat template (its own, else the run's) resolved to text once, here: workers get text."""
    return [EntryRules(entry, resolve_template(entry.chat_template or cfg.chat_template,
                                               entry.chat_template_jinja or cfg.chat_template_jinja, tokenizer),
                       tuple(cfg.eot_tokens or ()), entry.chat_template or cfg.chat_template)
            for entry in entries]


def read_jobs(entries: list, progress: ReadProgress | None, shard: tuple[int, int] | None = None) -> Iterator[ChunkJob]:
    """Chunks of CHUNK_ROWS rows, in reading order; `shard` (axolotl's dataset_shard_num/idx) keeps every N-th
    row, counted over all the entries."""
    position = itertools.count()
    for index, entry in enumerate(entries):
        rows: list[RawRow] = []
        for raw in stream_rows(entry, progress):
            if shard and next(position) % shard[0] != shard[1]:
                continue
            rows.append(raw)
            if len(rows) == CHUNK_ROWS:
                yield ChunkJob(index, rows)
                rows = []
        if rows:
            yield ChunkJob(index, rows)


_WORKER: ChunkTokenizer | None = None


def _start_worker(state_file: str) -> None:
    """In a spawned worker: one thread of tokenization per process (the processes are the parallelism). The
    state comes in a file: a large argument would block the parent's write to a worker that died starting."""
    from tuneloop.host.allocator import tune_host_allocator

    global _WORKER
    tune_host_allocator()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer, entries, limits = pickle.loads(Path(state_file).read_bytes())
    _WORKER = ChunkTokenizer(tokenizer, entries, limits)


def _work(job: ChunkJob) -> ChunkResult:
    return _WORKER(job)


def tokenized_chunks(jobs: Iterator[ChunkJob], make_tokenizer: Callable[[], ChunkTokenizer],
                     write_worker_state: Callable[[], Path], processes: int,
                     notice: Callable[[str], None] | None = None) -> Iterator[ChunkResult]:
    """Each job's result, in the jobs' order. Workers start only when there is more than one chunk to share;
    at most two chunks per worker are in flight, so reading never runs ahead of tokenizing by more. Workers
    that cannot run (a worker killed, or a program whose main module a spawned process cannot import) leave
    the rest of the work to this process, with a notice."""
    first = next(jobs, None)
    second = next(jobs, None) if first is not None else None
    if first is None:
        return
    jobs = itertools.chain([first], [second] if second is not None else [], jobs)
    if processes > 1 and second is not None and _in_spawned_bootstrap():
        # a program without `if __name__ == "__main__":` runs its work again in every spawned process; starting
        # workers from there would never end. Failing here lets the parent prepare in its own process.
        raise RuntimeError("tuneloop's data workers run the program's main module again, and it prepares data "
                           "when imported: put its work under `if __name__ == \"__main__\":`")
    if processes <= 1 or second is None or not _can_spawn():
        yield from map(make_tokenizer(), jobs)  # this process (the tokenizer's Rust threads use the cores)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pending: collections.deque = collections.deque()  # (job, future), in reading order
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch, no copy of this process
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_start_worker,
                             initargs=(str(write_worker_state()),)) as pool:
        try:
            for job in jobs:
                pending.append((job, pool.submit(_work, job)))
                if len(pending) >= 2 * processes:
                    yield pending[0][1].result()
                    pending.popleft()
            while pending:
                yield pending[0][1].result()
                pending.popleft()
            return
        except (BrokenProcessPool, BrokenPipeError) as error:  # a worker died (or could not start)
            if notice:
                notice(f"data preparation workers stopped ({type(error).__name__}: {error}); preparing the rest "
                       "in this process (a program that prepares data when imported needs `if __name__ == "
                       "\"__main__\":`)")
    work = make_tokenizer()
    yield from map(work, itertools.chain((job for job, _ in pending), jobs))


def _in_spawned_bootstrap() -> bool:
    """True while a spawned process imports its parent's main module (multiprocessing marks it inheriting)."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _can_spawn() -> bool:
    """A spawned process imports the parent's main module again; one read from stdin or a REPL has no file."""
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or Path(path).is_file()


class RepeatedRows:
    """`dataset_exact_deduplication`: a unit (a row, or a preference pair's two) whose tokens and labels repeat
    an earlier unit's of the same store is dropped, as axolotl drops a row equal to an earlier one after
    tokenization; a vision-language row's image references are part of it (the same text about another image is
    another row). Chunks arrive in the data's order, so the first of equal units is kept."""

    def __init__(self, group: int):
        self.group = group
        self.seen: set[bytes] = set()

    def dropped_from(self, tokens: TokenChunk) -> TokenChunk:
        ends = np.cumsum(tokens.length)
        starts = ends - tokens.length
        keep = np.zeros(len(tokens), dtype=bool)
        for unit in range(len(tokens) // self.group):
            first, last = unit * self.group, (unit + 1) * self.group - 1
            span = slice(int(starts[first]), int(ends[last]))
            digest = hashlib.blake2b(digest_size=16)
            for part in (tokens.length[first:last + 1], tokens.input_ids[span], tokens.labels[span],
                         *(() if tokens.label is None else (tokens.label[first:last + 1],)),
                         *(() if tokens.source_length is None else (tokens.source_length[first:last + 1],))):
                digest.update(np.ascontiguousarray(part).tobytes())
            for images in (() if tokens.images is None else tokens.images[first:last + 1]):
                digest.update(images.encode())  # a vision-language row's image references: same text, other image
                digest.update(b"\0")
            key = digest.digest()
            if key not in self.seen:
                self.seen.add(key)
                keep[first:last + 1] = True
        return tokens.rows(keep)


def _tokenize_into(store: TokenStoreWriter, entries: list, cfg, tokenizer, stats: PrepareStats,
                   progress: ReadProgress, notice, shard: tuple[int, int] | None = None) -> set[int]:
    """Every row of `entries` into `store`; returns the ids of the processes that tokenized them."""
    rules = entry_rules(cfg, entries, tokenizer)
    limits = limits_of(cfg, store.encoder_decoder)

    def write_worker_state() -> Path:
        state = store.folder.parent / "worker-state.pkl"  # in the cache's temporary folder: removed with it
        state.write_bytes(pickle.dumps((tokenizer, rules, limits)))
        return state

    results = tokenized_chunks(read_jobs(entries, progress, shard),
                               lambda: ChunkTokenizer(tokenizer, rules, limits), write_worker_state,
                               processes_for(cfg), notice)
    pids = set()
    repeats = RepeatedRows(store.group) if cfg.dataset_exact_deduplication else None
    for result in results:
        tokens = result.tokens
        if repeats is not None:
            tokens = repeats.dropped_from(tokens)
            result.stats.dropped_duplicates = len(result.tokens) // store.group - len(tokens) // store.group
        store.write(tokens)
        stats.add(result.stats)
        pids.add(result.pid)
        if progress.report:
            progress.report(stats.rows_read, progress.fraction)
    return pids


# ---- the eval split and the cache -----------------------------------------------------------------
def eval_row_mask(total: int, val_set_size: float, seed: int) -> np.ndarray:
    """Which of `total` usable rows are held out: `val_set_size` of them (a share, or a count when ≥ 1), drawn
    by a permutation seeded with `seed`."""
    n_eval = int(val_set_size) if val_set_size >= 1 else int(round(total * val_set_size))
    if n_eval >= total:
        raise UserError(f"config: `val_set_size: {val_set_size:g}` asks for {n_eval} eval rows, but the data has "
                        f"{total} usable rows: nothing would be left to train on. Lower it (a fraction such as "
                        "0.05 is a share of the rows).")
    held_out = np.zeros(total, dtype=bool)
    held_out[np.random.default_rng(seed).permutation(total)[:max(1, n_eval)]] = True
    return held_out


def split_store(source: Path, train_dir: Path, eval_dir: Path, held_out: np.ndarray) -> tuple[int, int]:
    """One pass over `source` in blocks, each unit (row or pair) to the train or the eval store (in their order);
    `held_out` has one value per unit."""
    rows = TokenRows(source)
    group = rows.group
    train = TokenStoreWriter(train_dir, group, rows.labelled, rows.encoder_decoder, rows.has_images)
    evaluation = TokenStoreWriter(eval_dir, group, rows.labelled, rows.encoder_decoder, rows.has_images)
    per_row = np.repeat(held_out, group)
    block_rows = SPLIT_BLOCK_ROWS * group  # whole units per block
    for start in range(0, len(rows), block_rows):
        stop = min(start + block_rows, len(rows))
        block = rows.read_chunk(start, stop)
        evaluation.write(block.rows(per_row[start:stop]))
        train.write(block.rows(~per_row[start:stop]))
    del rows
    return train.close(), evaluation.close()


def _build(cfg, tokenizer, target: Path, report=None, notice=None, encoder_decoder: bool = False) -> int:
    """Builds the cache in `target`; returns how many worker processes tokenized rows."""
    stats = PrepareStats()
    temp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    progress = None
    try:
        progress = ReadProgress(_bytes_to_read(cfg.datasets + cfg.test_datasets), report)
        shard = (cfg.dataset_shard_num, cfg.dataset_shard_idx) if cfg.dataset_shard_num else None
        group, labelled = (2 if two_sequences_a_row(cfg) else 1), limits_of(cfg).labelled
        images = image_inputs_of(tokenizer) is not None
        usable = TokenStoreWriter(temp / "usable", group, labelled, encoder_decoder, images)
        pids = _tokenize_into(usable, cfg.datasets, cfg, tokenizer, stats, progress, notice, shard)
        total = usable.close()
        if cfg.test_datasets:
            evaluation = TokenStoreWriter(temp / "eval", group, labelled, encoder_decoder, images)
            pids |= _tokenize_into(evaluation, cfg.test_datasets, cfg, tokenizer, stats, progress, notice)
            stats.eval_rows = evaluation.close()
            (temp / "usable").rename(temp / "train")
            stats.train_rows = total
        elif cfg.val_set_size and total:
            held_out = eval_row_mask(total, cfg.val_set_size, cfg.seed)
            stats.train_rows, stats.eval_rows = split_store(temp / "usable", temp / "train", temp / "eval", held_out)
            shutil.rmtree(temp / "usable")
        else:
            (temp / "usable").rename(temp / "train")
            stats.train_rows = total
        if stats.train_rows == 0:
            others = "".join(f", {count} {why}" for count, why in (
                (stats.dropped_too_short, f"shorter than min_sample_len={cfg.min_sample_len}"),
                (stats.dropped_duplicates, "repeating an earlier row")) if count)
            raise UserError(f"data: no training rows left: read {stats.rows_read}, dropped {stats.dropped_too_long} "
                            f"longer than sequence_len={cfg.sequence_len}{others} and "
                            f"{stats.dropped_no_trained_tokens} with no trained tokens")
        if cfg.test_datasets and stats.eval_rows == 0:
            raise UserError("data: the eval set is empty after filtering; check test_datasets or sequence_len")
        (temp / "stats.json").write_text(json.dumps(asdict(stats), indent=2))
        make_readable(temp)  # mkdtemp made it private
    except BaseException as error:
        if isinstance(error, OSError):  # (what a full disk's message estimates the need from, before it goes)
            error.cache_bytes_written = _folder_bytes(temp)
            error.data_fraction_read = progress.fraction if progress is not None else None
        shutil.rmtree(temp, ignore_errors=True)
        raise
    try:
        os.replace(temp, target)  # atomic: a reader sees a complete cache or none
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)  # another process finished first; theirs is identical
        if not (target / "stats.json").exists():
            raise
    return len(pids - {os.getpid()})


def check_cache_apart_from_data(cfg, root: Path) -> None:
    """The cache never goes into a dataset's folder: tuneloop would write into the user's data, then read its own
    files there as data rows (a folder `path` reads every data file under it)."""
    cache = root.expanduser().resolve()
    for key in ("datasets", "test_datasets"):
        for index, entry in enumerate(getattr(cfg, key)):
            folder = Path(entry.path).expanduser()
            if not folder.is_dir():
                continue
            folder = folder.resolve()
            if cache == folder or folder in cache.parents:
                raise UserError(f"config: `dataset_prepared_path: {cfg.dataset_prepared_path}` is "
                                f"{'the folder' if cache == folder else 'inside the folder'} of `{key}[{index}].path: "
                                f"{entry.path}`; tuneloop would write its cache into your data and then read it as "
                                "data rows: give the cache a folder of its own (the default is last_run_prepared)")


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    except OSError:
        return 0


def _looks_full(error: OSError) -> bool:
    """A full disk or quota: by its errno, or numpy's short write ("4096 requested and 0 written", no errno)."""
    import errno

    return (error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or "No space left" in str(error)
            or re.search(r"\d+ requested and \d+ written", str(error)) is not None)


def _megabytes(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def cache_write_failure(error: OSError, root: Path) -> str:
    """The message for a cache that could not be written (a full disk, a quota, a file that cannot be read); on a
    full disk, how much had been written when it filled."""
    where = error.filename or root
    if _looks_full(error):
        free = shutil.disk_usage(root).free if root.exists() else 0
        written, fraction = getattr(error, "cache_bytes_written", 0), getattr(error, "data_fraction_read", None)
        # (what was written is a floor of the need, not an estimate of it: tokenizing workers run ahead of the
        # writer, and splitting an eval set off copies the rows once more)
        had = (f"; it filled with {_megabytes(written)} of prepared rows written and {fraction:.0%} of the data "
               "read, so they need more than that" if written and fraction is not None else "")
        return (f"data: the disk is full while writing the prepared data in `dataset_prepared_path: {root}` "
                f"({_megabytes(free)} free now{had}); nothing half-written was left. Free space, or point "
                "dataset_prepared_path at a larger disk, and run again")
    return (f"data: could not prepare the data: {where}: {error.strerror or error}; nothing half-written was left in "
            f"{root}")


def _bytes_to_read(entries: list) -> int:
    return sum(file.stat().st_size for entry in entries if not is_hub_dataset(entry)
               for file in data_files_of(entry))


def prepare(cfg, tokenizer, force: bool = False, report=None, notice=None,
            encoder_decoder: bool = False) -> PreparedData:
    """The prepared rows (built once per cache key); `encoder_decoder`: for a seq2seq model (each row its
    encoder's tokens, then its decoder's targets). While a cache is built, `report(rows_read, fraction of the
    bytes read)` is called after every chunk (for a progress display) and `notice(text)` with what the user
    should know (workers that stopped)."""
    root = Path(cfg.dataset_prepared_path)
    check_cache_apart_from_data(cfg, root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()  # can we write here, not just look?
    except OSError as error:
        raise UserError(f"config: cannot write the prepared data in `dataset_prepared_path: {root}` "
                        f"({error.strerror or error}); choose a folder you can write to") from None
    target = root / cache_key(cfg, tokenizer, encoder_decoder)
    if force and target.exists():
        shutil.rmtree(target)
    workers = 0
    if not (target / "stats.json").exists():
        try:
            workers = _build(cfg, tokenizer, target, report, notice, encoder_decoder)
        except OSError as error:  # (the half-built cache is gone already: _build removes its temporary folder)
            raise UserError(cache_write_failure(error, root)) from None
    stats = PrepareStats(**json.loads((target / "stats.json").read_text()))
    eval_set = TokenRows(target / "eval") if (target / "eval").exists() else None
    return PreparedData(TokenRows(target / "train"), eval_set, stats, target, workers)


# ---- a streamed run: only its eval set is prepared ---------------------------------------------------
def prepare_streamed_eval(cfg, tokenizer, force: bool = False, report=None, notice=None,
                          encoder_decoder: bool = False) -> PreparedData:
    """A streamed run (the training rows are read as it goes: stream.py) prepares its eval set alone, from
    `test_datasets` (a stream holds nothing out). `train` is None."""
    if not cfg.test_datasets:
        return PreparedData(None, None, PrepareStats(), Path(cfg.dataset_prepared_path))
    eval_only = cfg.model_copy(update={"datasets": cfg.test_datasets, "test_datasets": [], "val_set_size": 0.0,
                                       "dataset_shard_num": None})
    prepared = prepare(eval_only, tokenizer, force, report, notice, encoder_decoder)
    stats = PrepareStats(**{**asdict(prepared.stats), "train_rows": 0, "eval_rows": prepared.stats.train_rows})
    return PreparedData(None, prepared.train, stats, prepared.cache_dir, prepared.worker_processes)


def stream_key(cfg, tokenizer, encoder_decoder: bool, packed: bool) -> str:
    """What a streamed run's checkpoints are checked against on resume: the streamed entries, the tokenizer and
    the settings that change the rows, and each file's path, size and modification time (a stream may be too
    large to hash whole before every run)."""
    digest = hashlib.sha256()
    settings = {"version": PREPARE_VERSION, "streamed": [entry.model_dump() for entry in cfg.train_entries],
                "sequence_len": cfg.sequence_len, "packed": packed, "train_on_inputs": cfg.train_on_inputs,
                "encoder_decoder": encoder_decoder,
                "chat_template": resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)}
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(vocabulary_bytes(tokenizer))
    for entry in cfg.train_entries:
        for file in data_files_of(entry):
            status = file.stat()
            digest.update(f"{file.resolve()}:{status.st_size}:{status.st_mtime_ns}".encode())
    return "stream-" + digest.hexdigest()[:16]
