"""One rank's share of a streamed dataset: rows tokenized as training reaches them, for corpora too big to
prepare whole.

Preparation (prepare.py) tokenizes every row once into a store before the first step; a stream instead reads
the files as the loop asks for rows, so nothing but one chunk of tokens is held at a time and no store is
written. Shares are fixed without anyone dealing them out: source rows are numbered over all the entries in
order (entry 0's rows, then entry 1's, ...), and row g is rank g % world_size's. Every rank reads every line
(reading is cheap) and tokenizes only its own rows, `chunk_rows` of them at a time, one entry per chunk (a
chunk's rows share their entry's rules).

The data is read in file order. With `shuffle_seed`, each chunk's sequences (a rank's next `chunk_rows` rows)
come in a seeded order of their own, different each pass: a local shuffle, like a shuffle buffer of one chunk
(rows far apart in the files never trade places: shuffle the files beforehand if their order runs deep).

Packed (pretraining), the kept sequences' tokens run on, concatenated, and are cut into rows of exactly
`sequence_len` tokens; a row's sequences are the pieces it holds, so the collator restarts positions and
shifts labels per piece (a sequence cut at a row's end loses the one target across the cut). What cannot
fill a whole row at the end of a pass is dropped. Unpacked, each kept sequence is a row as it was tokenized.

A StreamPosition, taken between rows, is everything a resumed run needs to go on with exactly the rows the
interrupted one would have had next: the pass, how many of this rank's rows were tokenized (skipped unread
by the tokenizer on resume), and the tokens tokenized but not yet emitted (the carry, at most one chunk's).
It assumes the same data, world size and rank, and the same `sequence_len` and packing.

Streams carry causal sequences, and encoder-decoder rows (unpacked: each row one source and its target, the
carry keeping each row's encoder length); preference pairs and KTO's labelled rows, whose two sequences
belong together, are prepared whole instead.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from tuneloop.data.labels import IGNORE_INDEX, count_targets
from tuneloop.data.load import RawRow, stream_rows
from tuneloop.data.prepare import ChunkJob, ChunkResult, PrepareStats
from tuneloop.data.token_store import ROW_COLUMNS, SOURCE, TOKEN_COLUMNS, TokenChunk

Piece = tuple[np.ndarray, np.ndarray]  # a sequence, or the part of one that a row holds: (input_ids, labels)


@dataclass
class StreamPosition:
    """Where one rank is in the stream: enough to continue exactly after a resume."""

    passes: int = 0  # which pass over the data this is (0-based)
    rows_read: int = 0  # this rank's source rows of this pass already tokenized (a resume skips them untokenized)
    carry_ids: list[int] = field(default_factory=list)  # tokens tokenized but not yet in an emitted row
    carry_labels: list[int] = field(default_factory=list)
    carry_lengths: list[int] = field(default_factory=list)  # the carry's pieces: where its sequences start again
    carry_sources: list[int] = field(default_factory=list)  # encoder-decoder rows: each carried row's encoder part

    def to_json(self) -> dict:
        return {"passes": self.passes, "rows_read": self.rows_read, "carry_ids": list(self.carry_ids),
                "carry_labels": list(self.carry_labels), "carry_lengths": list(self.carry_lengths),
                "carry_sources": list(self.carry_sources)}

    @classmethod
    def from_json(cls, data: dict) -> "StreamPosition":
        position = cls(int(data["passes"]), int(data["rows_read"]), [int(t) for t in data["carry_ids"]],
                       [int(t) for t in data["carry_labels"]], [int(n) for n in data["carry_lengths"]],
                       [int(n) for n in data.get("carry_sources", [])])
        carried = sum(position.carry_lengths)
        if not len(position.carry_ids) == len(position.carry_labels) == carried:
            raise ValueError(f"stream position: the carry has {len(position.carry_ids)} ids and "
                             f"{len(position.carry_labels)} labels but its pieces add up to {carried}")
        return position


def row_chunk(pieces: list[Piece], source_length: int | None = None) -> TokenChunk:
    """A row as a TokenChunk whose rows are its pieces. A piece's targets are counted as the collator will see
    them once it shifts the piece's labels on its own: every trained label but the piece's first. An
    encoder-decoder row (one piece, `source_length` of it the encoder's) counts every trained label: its
    targets are not shifted."""
    if not pieces:
        return TokenChunk.empty()
    if source_length is not None:
        (ids, labels), = pieces
        return TokenChunk(ids.astype(np.int32), labels.astype(np.int32), np.array([len(ids)], dtype=np.int32),
                          np.array([np.count_nonzero(labels != IGNORE_INDEX)], dtype=np.int32),
                          source_length=np.array([source_length], dtype=np.int32))
    return TokenChunk(np.concatenate([ids for ids, _ in pieces]).astype(np.int32),
                      np.concatenate([labels for _, labels in pieces]).astype(np.int32),
                      np.array([len(ids) for ids, _ in pieces], dtype=np.int32),
                      np.array([count_targets(labels) for _, labels in pieces], dtype=np.int32))


def split_pieces(ids: np.ndarray, labels: np.ndarray, lengths) -> list[Piece]:
    """Flat tokens back into their pieces (empty ones left out: they would only be empty sequences in a row)."""
    bounds = np.cumsum(np.asarray(lengths, dtype=np.int64))[:-1]
    return [(piece_ids, piece_labels) for piece_ids, piece_labels in zip(np.split(ids, bounds),
                                                                         np.split(labels, bounds))
            if len(piece_ids)]


class TokenStream:
    """This rank's rows, one at a time, tokenized a chunk at a time as they are needed (see the module's
    docstring). `tokenize` is what prepare.py runs on a chunk (a ChunkTokenizer): it drops the rows the run
    cannot use, sequences longer than its own `Limits.sequence_len` among them."""

    def __init__(self, entries: list, tokenize: Callable[[ChunkJob], ChunkResult], sequence_len: int,
                 rank: int, world_size: int, packed: bool, position: StreamPosition | None = None,
                 chunk_rows: int = 256, shuffle_seed: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of world_size={world_size} ranks")
        if sequence_len < 1 or chunk_rows < 1:
            raise ValueError(f"sequence_len ({sequence_len}) and chunk_rows ({chunk_rows}) must be positive")
        self.entries, self.tokenize = entries, tokenize
        self.sequence_len, self.rank, self.world_size = sequence_len, rank, world_size
        self.packed, self.chunk_rows = packed, chunk_rows
        self.shuffle_seed = shuffle_seed  # None: file order; else each chunk's sequences in a seeded order
        self.stats = PrepareStats()  # rows read and dropped by `tokenize` since this stream was made (not resumed)
        self.rows_without_targets = 0  # packed rows skipped since this stream was made: no trained token in them
        self._start(position or StreamPosition())

    def _start(self, position: StreamPosition) -> None:
        """Reading from `position`: its rows skipped, its carry waiting to go into the next rows."""
        self._passes, self._rows_read = position.passes, position.rows_read
        carry = split_pieces(np.asarray(position.carry_ids, dtype=np.int32),
                             np.asarray(position.carry_labels, dtype=np.int32), position.carry_lengths)
        self._pending: collections.deque[Piece] = collections.deque(carry)
        self._pending_sources: collections.deque[int] = collections.deque(position.carry_sources)
        self._pending_tokens = sum(len(ids) for ids, _ in carry)
        self._jobs = self._read_jobs(skip=position.rows_read)
        self._pass_done = False

    def _read_jobs(self, skip: int) -> Iterator[ChunkJob]:
        """This rank's rows of the pass in jobs of `chunk_rows`, after its first `skip` rows (read, not kept). A
        job closes early where its entry ends. The jobs after a skip of whole jobs are the jobs the pass would
        have had there: job boundaries count from each entry's first row, and a position's `rows_read` is a
        sum of whole jobs."""
        number = 0  # the row's number over all the entries: whose row it is
        for index, entry in enumerate(self.entries):
            rows: list[RawRow] = []
            for raw in stream_rows(entry):
                mine = number % self.world_size == self.rank
                number += 1
                if not mine:
                    continue
                if skip:
                    skip -= 1
                    continue
                rows.append(raw)
                if len(rows) == self.chunk_rows:
                    yield ChunkJob(index, rows)
                    rows = []
            if rows:
                yield ChunkJob(index, rows)

    def _tokenize_next_job(self) -> bool:
        """The next job's kept sequences onto the pending pieces; False when the pass has no more rows."""
        job = next(self._jobs, None)
        if job is None:
            return False
        result = self.tokenize(job)
        tokens = result.tokens
        if tokens.label is not None:
            raise ValueError("a stream carries single sequences: labelled (KTO) rows, which come in pairs, are "
                             "prepared whole")
        if tokens.source_length is not None and self.packed:
            raise ValueError("encoder-decoder rows are streamed one a row, not packed")
        sequences = split_pieces(tokens.input_ids, tokens.labels, tokens.length)
        sources = [] if tokens.source_length is None else [int(n) for n in tokens.source_length]
        if self.shuffle_seed is not None:
            # a seeded order per chunk, from where the chunk starts in this rank's pass: a resume (which skips
            # whole chunks and carries the rest) sees the same order, and each pass a new one
            order = np.random.default_rng([self.shuffle_seed, self.rank, self._passes, self._rows_read]).permutation(
                len(sequences))
            sequences = [sequences[i] for i in order]
            sources = [sources[i] for i in order] if sources else sources
        self._rows_read += len(job.rows)
        self.stats.add(result.stats)
        self._pending_sources.extend(sources)
        self._pending.extend(sequences)
        self._pending_tokens += sum(len(ids) for ids, _ in sequences)
        return True

    def next_row(self) -> TokenChunk | None:
        """The next row of this rank: a TokenChunk whose rows are the row's sequences (pieces). None when this
        rank's share of the current pass is used up (the caller decides when all ranks start the next pass)."""
        wanted = self.sequence_len if self.packed else 1  # a whole row of tokens, or one whole sequence
        while not self._pass_done:
            while self._pending_tokens < wanted:
                if not self._tokenize_next_job():
                    self._end_pass()
                    return None
            if not self.packed:
                source = self._pending_sources.popleft() if self._pending_sources else None
                return row_chunk([self._take(len(self._pending[0][0]))], source)
            row = row_chunk(self._take_packed_row())
            if row.n_targets.sum():
                return row
            # a full row cut from inside untrained text (a long prompt) teaches nothing, and a step of such rows
            # would have no token to average over: skipped (unpacked, the tokenizer drops such sequences)
            self.rows_without_targets += 1
        return None

    def _take_packed_row(self) -> list[Piece]:
        pieces, room = [], self.sequence_len
        while room:
            piece = self._take(room)
            pieces.append(piece)
            room -= len(piece[0])
        return pieces

    def _take(self, most: int) -> Piece:
        """The first pending piece, or its first `most` tokens (the rest stays first in line)."""
        ids, labels = self._pending[0]
        if len(ids) <= most:
            self._pending.popleft()
        else:
            self._pending[0] = (ids[most:], labels[most:])
            ids, labels = ids[:most], labels[:most]
        self._pending_tokens -= len(ids)
        return ids, labels

    def _end_pass(self) -> None:
        """What is left cannot fill a row: dropped (a resume from here starts no row with it either)."""
        self._pending.clear()
        self._pending_sources.clear()
        self._pending_tokens = 0
        self._pass_done = True
        self._jobs.close()

    def start_next_pass(self) -> None:
        """From the first row again, with nothing carried over."""
        self._jobs.close()
        self._start(StreamPosition(passes=self._passes + 1))

    @property
    def position(self) -> StreamPosition:
        """A copy of where the stream is (between next_row calls), JSON-able through to_json."""
        carry = row_chunk(list(self._pending))
        return StreamPosition(self._passes, self._rows_read, carry.input_ids.tolist(), carry.labels.tolist(),
                              carry.length.tolist(), list(self._pending_sources))


class MemoryRows:
    """Rows held in memory with what the Collator reads of a TokenRows (tokens, offsets, group, labelled), so
    that streamed rows collate as stored ones do. Each given row's pieces become sequences of this store, in
    order; `units[i]` names the sequences of the i-th given row, for `Collator(...)(units)` (packed: each
    given row is one row of the micro-batch). Note: TokenRows.units is a count; here it is the rows' indices."""

    group = 1  # single sequences (a stream carries no preference pairs)
    labelled = False

    def __init__(self, rows: list[TokenChunk]):
        self.encoder_decoder = any(row.source_length is not None for row in rows)
        names = (*TOKEN_COLUMNS, *ROW_COLUMNS, *((SOURCE,) if self.encoder_decoder else ()))
        self.columns = {name: np.concatenate([np.zeros(0, np.int32), *(getattr(row, name) for row in rows)])
                        for name in names}
        self.count = len(self.columns["length"])
        self.offsets = np.concatenate([[0], np.cumsum(self.columns["length"], dtype=np.int64)])
        starts = np.cumsum([0] + [len(row) for row in rows])
        self.units = [list(range(int(start), int(stop))) for start, stop in zip(starts[:-1], starts[1:])]

    def __len__(self) -> int:
        return self.count

    def tokens(self, name: str, index: int) -> np.ndarray:
        return self.columns[name][self.offsets[index]:self.offsets[index + 1]]
