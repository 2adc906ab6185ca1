"""Streamed data (data/stream.py): each rank tokenizes its own rows only, packed rows are exactly sequence_len
tokens and lose or reorder nothing, a resumed stream goes on with exactly the rows the interrupted one would
have had, passes repeat, and the collator takes streamed rows as it takes stored ones."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from conftest import CORPUS, write_jsonl
from transformers import AutoTokenizer

from tuneloop.config import DatasetConfig
from tuneloop.data.collate import Collator, Padding, collator_for
from tuneloop.data.labels import IGNORE_INDEX, count_targets, shifted_targets
from tuneloop.data.load import stream_rows
from tuneloop.data.prepare import ChunkJob, ChunkResult, ChunkTokenizer, EntryRules, Limits, PrepareStats
from tuneloop.data.stream import MemoryRows, StreamPosition, TokenStream
from tuneloop.data.token_store import TokenChunk

WORDS = " ".join(CORPUS).split()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def text_entries(tmp_path_factory) -> list[DatasetConfig]:
    """Two files (13 and 8 rows, so shares run on across the entries' boundary), each row's text starting with
    its global number: `row7 ...`; one row of the second file is empty (no trained token: dropped)."""
    folder = tmp_path_factory.mktemp("stream")
    rng = random.Random(3)
    texts = [f"row{number} " + " ".join(rng.choices(WORDS, k=rng.randint(2, 14))) for number in range(21)]
    texts[17] = ""
    first = write_jsonl(folder / "a.jsonl", [{"text": text} for text in texts[:13]])
    second = write_jsonl(folder / "b.jsonl", [{"text": text} for text in texts[13:]])
    return [DatasetConfig(path=str(first), type="completion"), DatasetConfig(path=str(second), type="completion")]


def chunk_tokenizer(tokenizer, entries, sequence_len: int = 10**6) -> ChunkTokenizer:
    """What prepare.py runs on a chunk; a stream's own limit is large (a packed stream cuts long sequences)."""
    return ChunkTokenizer(tokenizer, [EntryRules(entry, None, ()) for entry in entries],
                          Limits(sequence_len, train_on_inputs=False))


class Recorder:
    """A tokenize callable that records each job it is given: (entry index, the rows' `where`)."""

    def __init__(self, tokenize):
        self.tokenize, self.jobs = tokenize, []

    def __call__(self, job: ChunkJob):
        self.jobs.append((job.entry_index, [raw.where for raw in job.rows]))
        return self.tokenize(job)

    @property
    def wheres(self) -> list[str]:
        return [where for _, wheres in self.jobs for where in wheres]


def every_where(entries) -> list[str]:
    """Every source row's `where`, in the global numbering (file a's rows, then file b's)."""
    return [f"{entry.path}:{line}" for entry in entries
            for line in range(1, len(open(entry.path).read().splitlines()) + 1)]


def drain(stream: TokenStream) -> list:
    rows = []
    while (row := stream.next_row()) is not None:
        rows.append(row)
    return rows


def as_lists(row) -> tuple:
    return row.input_ids.tolist(), row.labels.tolist(), row.length.tolist(), row.n_targets.tolist()


def kept_sequences(tokenizer, entries, rank: int, world_size: int) -> list[tuple[list, list]]:
    """This rank's kept sequences, tokenized all at once (one job per entry), without a stream."""
    work = chunk_tokenizer(tokenizer, entries)
    sequences, number = [], 0
    for index, entry in enumerate(entries):
        mine = []
        for raw in stream_rows(entry):
            if number % world_size == rank:
                mine.append(raw)
            number += 1
        tokens = work(ChunkJob(index, mine)).tokens
        bounds = np.cumsum(tokens.length)[:-1]
        sequences += [(ids.tolist(), labels.tolist())
                      for ids, labels in zip(np.split(tokens.input_ids, bounds), np.split(tokens.labels, bounds))]
    return sequences


def test_ranks_tokenize_disjoint_shares_covering_every_row(tokenizer, text_entries):
    world_size, everything = 3, every_where(text_entries)
    seen = []
    for rank in range(world_size):
        recorder = Recorder(chunk_tokenizer(tokenizer, text_entries))
        rows = drain(TokenStream(text_entries, recorder, 16, rank, world_size, packed=False, chunk_rows=2))
        # row g is rank g % world_size's, numbered over both files, in reading order
        assert recorder.wheres == everything[rank::world_size]
        for entry_index, wheres in recorder.jobs:  # a job holds rows of one entry, at most chunk_rows of them
            assert 1 <= len(wheres) <= 2
            assert all(where.startswith(text_entries[entry_index].path + ":") for where in wheres)
        # what came out is those rows' text (the empty row 17 dropped)
        numbers = [int(re.match(r"row(\d+) ", tokenizer.decode(row.input_ids.tolist())).group(1)) for row in rows]
        assert numbers == [g for g in range(rank, 21, world_size) if g != 17]
        seen += recorder.wheres
    assert sorted(seen) == sorted(everything) and len(seen) == len(set(seen)) == 21


def test_packed_rows_are_full_and_keep_every_token_in_order(tokenizer, text_entries):
    sequence_len, chunk_rows = 16, 3
    for rank in range(2):
        expected = kept_sequences(tokenizer, text_entries, rank, 2)
        stream = TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), sequence_len, rank, 2,
                             packed=True, chunk_rows=chunk_rows)
        first = stream.next_row()
        # one chunk is enough for the first row, and nothing more was tokenized
        assert sum(len(ids) for ids, _ in expected[:chunk_rows]) >= sequence_len
        assert stream.position.rows_read == chunk_rows
        rows = [first, *drain(stream)]
        assert all(int(row.length.sum()) == len(row.input_ids) == sequence_len for row in rows)
        all_ids = [token for ids, _ in expected for token in ids]
        all_labels = [label for _, labels in expected for label in labels]
        assert len(rows) == len(all_ids) // sequence_len >= 3  # only the last part row's tokens are dropped
        emitted = np.concatenate([row.input_ids for row in rows]).tolist()
        assert emitted == all_ids[:len(emitted)]
        assert np.concatenate([row.labels for row in rows]).tolist() == all_labels[:len(emitted)]
        # pieces end where a sequence ends or a row ends, nowhere else
        piece_ends = np.cumsum(np.concatenate([row.length for row in rows])).tolist()
        sequence_ends = np.cumsum([len(ids) for ids, _ in expected]).tolist()
        row_ends = [sequence_len * (i + 1) for i in range(len(rows))]
        assert piece_ends == sorted({end for end in sequence_ends + row_ends if end <= len(emitted)})
        for row in rows:  # targets as the collator counts them: each piece shifted on its own
            bounds = np.cumsum(row.length)[:-1]
            assert row.n_targets.tolist() == [count_targets(labels) for labels in np.split(row.labels, bounds)]
        assert any(len(row) > 1 for row in rows) and any(len(row) == 1 for row in rows)


@pytest.mark.parametrize("packed", [True, False])
def test_a_resumed_stream_continues_with_the_same_rows(tokenizer, text_entries, packed):
    def stream(position=None, recorder=None):
        return TokenStream(text_entries, recorder or chunk_tokenizer(tokenizer, text_entries), 8, 1, 2,
                           packed=packed, position=position, chunk_rows=3)

    original = Recorder(chunk_tokenizer(tokenizer, text_entries))
    uninterrupted = [as_lists(row) for row in drain(stream(recorder=original))]
    assert len(uninterrupted) >= 6
    from_carry = needing_a_chunk = 0  # resumes whose next row came from the carry alone / needed a new chunk
    for k in range(len(uninterrupted) + 1):
        first = stream()
        for _ in range(k):
            first.next_row()
        position = first.position
        for restored in (position, StreamPosition.from_json(json.loads(json.dumps(position.to_json())))):
            recorder = Recorder(chunk_tokenizer(tokenizer, text_entries))
            resumed = stream(restored, recorder)
            rest = [as_lists(row) for row in [resumed.next_row()] if row is not None]
            from_carry += bool(rest) and not recorder.jobs
            needing_a_chunk += bool(rest) and bool(recorder.jobs)
            rest += [as_lists(row) for row in drain(resumed)]
            assert rest == uninterrupted[k:], k
            # the rows before the position were read but not tokenized again
            assert recorder.wheres == original.wheres[position.rows_read:], k
    assert from_carry and needing_a_chunk


def test_resume_where_the_carry_is_empty(tokenizer, tmp_path):
    """Rows given as tokens (an entry without `type`), each 6 long: a chunk of 2 fills a row of 12 exactly, so
    after every row nothing is carried and the next row starts a new chunk."""
    rows = [{"input_ids": [10 + i] * 6, "labels": [-100, -100] + [10 + i] * 4} for i in range(8)]
    entries = [DatasetConfig(path=str(write_jsonl(tmp_path / "tokens.jsonl", rows)))]

    def stream(position=None):
        return TokenStream(entries, chunk_tokenizer(tokenizer, entries), 12, 0, 1, packed=True, position=position,
                           chunk_rows=2)

    uninterrupted = [as_lists(row) for row in drain(stream())]
    assert len(uninterrupted) == 4
    assert uninterrupted[0] == ([10] * 6 + [11] * 6, [-100, -100] + [10] * 4 + [-100, -100] + [11] * 4, [6, 6], [4, 4])
    for k in range(5):
        first = stream()
        for _ in range(k):
            first.next_row()
        assert first.position == StreamPosition(0, 2 * k)
        assert [as_lists(row) for row in drain(stream(first.position))] == uninterrupted[k:]


def test_a_pass_ends_and_the_next_repeats_it(tokenizer, text_entries):
    stream = TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), 8, 0, 2, packed=True,
                         chunk_rows=4)
    first_pass = [as_lists(row) for row in drain(stream)]
    assert stream.next_row() is None  # and stays used up until the next pass
    end = stream.position
    assert (end.passes, end.rows_read, end.carry_ids, end.carry_lengths) == (0, 11, [], [])  # rows 0, 2, ... 20
    assert TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), 8, 0, 2, packed=True,
                       position=end, chunk_rows=4).next_row() is None
    stream.start_next_pass()
    assert stream.position == StreamPosition(passes=1)
    second_pass = [as_lists(stream.next_row()) for _ in range(3)]
    middle = stream.position
    second_pass += [as_lists(row) for row in drain(stream)]
    assert second_pass == first_pass
    resumed = TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), 8, 0, 2, packed=True,
                          position=middle, chunk_rows=4)
    assert [as_lists(row) for row in drain(resumed)] == first_pass[3:]
    assert resumed.position.passes == 1


def test_unpacked_rows_are_the_sequences_as_tokenized(tokenizer, text_entries):
    expected = kept_sequences(tokenizer, text_entries, 0, 1)
    stream = TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), 4, 0, 1, packed=False,
                         chunk_rows=5)
    rows = drain(stream)
    assert len(rows) == len(expected) == 20  # 21 rows, the empty one dropped
    assert stream.stats.rows_read == 21 and stream.stats.dropped_no_trained_tokens == 1
    for row, (ids, labels) in zip(rows, expected):
        assert as_lists(row) == (ids, labels, [len(ids)], [count_targets(np.asarray(labels))])
    assert all(len(row.input_ids) > 4 for row in rows)  # longer than sequence_len, and not cut


def test_streamed_rows_collate_like_stored_ones(tokenizer, text_entries):
    stream = TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), 16, 0, 1, packed=True,
                         chunk_rows=4)
    rows = [stream.next_row() for _ in range(3)]
    store = MemoryRows(rows)
    assert store.units == [list(range(0, len(rows[0]))), list(range(len(rows[0]), len(rows[0]) + len(rows[1]))),
                           list(range(len(rows[0]) + len(rows[1]), len(store)))]
    batch = Collator(store, tokenizer.pad_token_id, packed=True, padding=Padding())(store.units)
    assert batch.inputs["input_ids"].tolist() == [row.input_ids.tolist() for row in rows]
    for i, row in enumerate(rows):
        pieces = np.split(row.labels, np.cumsum(row.length)[:-1])
        assert batch.inputs["position_ids"][i].tolist() == np.concatenate([np.arange(n) for n in row.length]).tolist()
        assert batch.targets[i].tolist() == np.concatenate([shifted_targets(labels) for labels in pieces]).tolist()
    assert batch.n_targets == sum(int(row.n_targets.sum()) for row in rows) > 0
    assert int((batch.targets != IGNORE_INDEX).sum()) == batch.n_targets
    assert any(len(row) > 1 for row in rows)  # some row holds several pieces, whose positions restart


def test_rows_a_stream_cannot_carry_and_a_torn_position_are_refused(text_entries):
    def labelled(job):  # KTO's rows: each sequence labelled, in pairs
        ones = np.ones(4, dtype=np.int32)
        return ChunkResult(TokenChunk(ones, ones, np.array([2, 2], np.int32), np.array([1, 1], np.int32),
                                      np.array([1, 1], np.int32)), PrepareStats(), 0)

    with pytest.raises(ValueError, match="labelled"):
        TokenStream(text_entries, labelled, 8, 0, 1, packed=True).next_row()
    torn = StreamPosition(0, 4, [1, 2, 3], [1, 2, 3], [2]).to_json()
    with pytest.raises(ValueError, match="pieces add up to 2"):
        StreamPosition.from_json(torn)


def test_encoder_decoder_rows_stream_one_a_row_and_resume_with_their_encoder_lengths(tokenizer, tmp_path):
    rng = random.Random(5)
    rows = [{"source": " ".join(rng.choices(WORDS, k=rng.randint(1, 9))),
             "target": " ".join(rng.choices(WORDS, k=rng.randint(1, 9)))} for _ in range(15)]
    entries = [DatasetConfig(path=str(write_jsonl(tmp_path / "pairs.jsonl", rows)), type="seq2seq")]
    tokenize = ChunkTokenizer(tokenizer, [EntryRules(entries[0], None, ())],
                              Limits(64, train_on_inputs=False, encoder_decoder=True))

    def stream(position=None):
        return TokenStream(entries, tokenize, 64, 0, 1, packed=False, position=position, chunk_rows=4)

    whole = drain(stream())
    assert len(whole) == 15 and all(len(row) == 1 and row.source_length is not None for row in whole)
    for row, source in zip(whole, rows):
        split = int(row.source_length[0])
        assert tokenizer.decode(row.input_ids[:split], skip_special_tokens=True).strip() == source["source"]
        assert (row.labels[:split] == IGNORE_INDEX).all() and row.n_targets[0] == len(row.input_ids) - split
    for k in (1, 5, 9):  # inside a chunk of 4: the carry holds rows and their encoder lengths
        interrupted = stream()
        for _ in range(k):
            interrupted.next_row()
        position = StreamPosition.from_json(json.loads(json.dumps(interrupted.position.to_json())))
        assert len(position.carry_sources) == len(position.carry_lengths) > 0 or k % 4 == 0
        rest = drain(stream(position))
        assert [as_lists(row) + (row.source_length.tolist(),) for row in rest] == \
            [as_lists(row) + (row.source_length.tolist(),) for row in whole[k:]]
    batch = collator_for(MemoryRows(whole[:3]), tokenizer.pad_token_id, packed=False,
                         decoder_start_token_id=tokenizer.pad_token_id)(MemoryRows(whole[:3]).units)
    assert batch.n_targets == sum(int(row.n_targets[0]) for row in whole[:3])
    assert batch.inputs["input_ids"].shape[0] == 3 and "decoder_input_ids" in batch.inputs


def test_a_seeded_stream_shuffles_each_chunk_and_resumes_in_the_same_order(tokenizer, text_entries):
    def stream(position=None, seed=7):
        return TokenStream(text_entries, chunk_tokenizer(tokenizer, text_entries), 16, 0, 1, packed=False,
                           position=position, chunk_rows=5, shuffle_seed=seed)

    def numbers(rows) -> list[int]:
        return [int(re.search(r"row(\d+)", tokenizer.decode(row.input_ids)).group(1)) for row in rows]

    in_order, shuffled = numbers(drain(stream(seed=None))), numbers(drain(stream()))
    assert sorted(shuffled) == in_order and shuffled != in_order  # the same rows, in another order
    # a local shuffle: each chunk of 5 rows keeps its rows (the first two chunks: rows 0-4 and 5-9)
    assert [sorted(shuffled[i:i + 5]) for i in (0, 5)] == [in_order[i:i + 5] for i in (0, 5)]
    second = stream()
    drain(second)
    second.start_next_pass()
    assert numbers(drain(second)) != shuffled  # each pass in a new order
    for k in (2, 7):
        interrupted = stream()
        for _ in range(k):
            interrupted.next_row()
        assert numbers(drain(stream(interrupted.position))) == shuffled[k:]
