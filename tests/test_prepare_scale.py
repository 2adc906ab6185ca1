"""Preparation that streams through worker processes: the cache is the same bytes whatever the process count,
errors found in a worker name their row, a program that forgot its main guard still gets its data, and the
store reads back what was written. (Speed and memory at a million rows: benchmarks/prepare_scale.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.data import prepare as prepare_module
from tuneloop.data.token_store import TokenChunk, TokenRows, TokenStoreWriter


def config_for(tmp_path: Path, model_dir: Path, data: Path, prepared: str, **keys):
    from tuneloop.config import config_from_dict

    return config_from_dict({"base_model": str(model_dir), "datasets": [{"path": str(data), "type": "alpaca"}],
                             "dataset_prepared_path": str(tmp_path / prepared), "sequence_len": 110,
                             "val_set_size": 0.1, **keys})


def store_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def test_one_and_two_processes_write_the_same_cache_under_the_same_key(tmp_path, tiny_model_dir, monkeypatch):
    from tuneloop.model.tokenizer import load_tokenizer

    monkeypatch.setattr(prepare_module, "CHUNK_ROWS", 16)  # 300 rows: 19 chunks to share between the workers
    data = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(300))
    results = {}
    for processes in (1, 2):
        cfg = config_for(tmp_path, tiny_model_dir, data, f"prepared-{processes}", dataset_processes=processes)
        results[processes] = prepare_module.prepare(cfg, load_tokenizer(cfg, encoder_decoder=False))
    one, two = results[1], results[2]
    assert one.worker_processes == 0 and two.worker_processes >= 1  # the second really ran in workers
    assert one.cache_dir.name == two.cache_dir.name  # the process count is not part of the key
    assert one.stats == two.stats and one.stats.dropped_too_long > 0  # (sequence_len 110 drops some rows)
    for split in ("train", "eval"):
        assert store_bytes(one.cache_dir / split) == store_bytes(two.cache_dir / split)
    assert (one.cache_dir / "stats.json").read_bytes() == (two.cache_dir / "stats.json").read_bytes()
    assert len(one.train) + len(one.eval) == one.stats.rows_read - one.stats.dropped_too_long \
        - one.stats.dropped_no_trained_tokens


def test_a_bad_row_found_in_a_worker_names_its_line(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "CHUNK_ROWS", 8)
    rows = tiny_rows(60)
    rows[37] = {"instruction": "no output here"}
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = write_config(tmp_path / "run.yml", base_model=str(tiny_model_dir), sequence_len=64,
                          datasets=[{"path": str(data), "type": "alpaca"}],
                          dataset_prepared_path=str(tmp_path / "prepared"), dataset_processes=2)
    result = run_in_process("preprocess", str(config))
    assert_user_error(result, f"{data}:38", "output")
    left = [path.name for path in (tmp_path / "prepared").iterdir()]
    assert left == [prepare_module.FILE_DIGESTS]  # no cache, not even half of one (only the data file's hash)


@pytest.mark.slow  # (a process of its own)
def test_a_script_without_a_main_guard_still_prepares_its_data_in_its_own_process(tmp_path, tiny_model_dir):
    """Spawned workers import the program's main module again; one that prepares data at import cannot start
    workers. tuneloop says so and finishes in the parent instead of hanging."""
    data = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(120))
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from tuneloop.config import config_from_dict
        from tuneloop.data import prepare
        from tuneloop.model.tokenizer import load_tokenizer

        prepare.CHUNK_ROWS = 16
        cfg = config_from_dict({{"base_model": {str(tiny_model_dir)!r}, "sequence_len": 256,
                                 "datasets": [{{"path": {str(data)!r}, "type": "alpaca"}}],
                                 "dataset_prepared_path": {str(tmp_path / "prepared")!r}, "dataset_processes": 2}})
        tokenizer = load_tokenizer(cfg, encoder_decoder=False)
        prepared = prepare.prepare(cfg, tokenizer, notice=lambda text: print("notice:", text))
        print("rows", len(prepared.train))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "notice: data preparation workers stopped" in done.stdout and "__main__" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "rows 120"


def test_the_store_reads_back_rows_columns_and_blocks(tmp_path):
    writer = TokenStoreWriter(tmp_path / "store")
    chunks = [TokenChunk(np.array([5, 6, 7, 8, 9], np.int32), np.array([-100, 6, 7, -100, 9], np.int32),
                         np.array([3, 2], np.int32), np.array([1, 1], np.int32)),
              TokenChunk.empty(),
              TokenChunk(np.array([1], np.int32), np.array([1], np.int32), np.array([1], np.int32),
                         np.array([0], np.int32))]
    for chunk in chunks:
        writer.write(chunk)
    assert writer.close() == 3
    rows = TokenRows(tmp_path / "store")
    assert len(rows) == 3 and rows[1] == {"input_ids": [8, 9], "labels": [-100, 9], "length": 2, "n_targets": 1}
    assert rows[-1]["input_ids"] == [1] and list(rows["length"]) == [3, 2, 1]
    assert rows["input_ids"] == [[5, 6, 7], [8, 9], [1]]
    block = rows.read_chunk(1, 3)
    assert block.input_ids.tolist() == [8, 9, 1] and block.length.tolist() == [2, 1]
    kept = block.rows(np.array([False, True]))
    assert kept.input_ids.tolist() == [1] and kept.n_targets.tolist() == [0]
    with pytest.raises(IndexError):
        rows[3]
    empty = TokenStoreWriter(tmp_path / "empty")
    assert empty.close() == 0 and len(TokenRows(tmp_path / "empty")) == 0


def test_the_backend_encoder_gives_what_the_tokenizer_gives(tiny_tokenizer_dir):
    """Preparation calls the fast tokenizer's Rust backend directly; it must give the same ids and character
    offsets as calling the tokenizer, special tokens included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    texts = ["The quick brown fox.", "<|im_start|>user\nHello there<|im_end|>\n", "  spaces  and\ttabs "]
    encoder = prepare_module.plain_encoder(tokenizer)
    for add_special in (True, False):
        expected = tokenizer(texts, add_special_tokens=add_special, return_offsets_mapping=True)
        got = encoder.encode_batch(texts, add_special_tokens=add_special)
        assert [e.ids for e in got] == expected["input_ids"]
        assert [[tuple(o) for o in e.offsets] for e in got] == [[tuple(o) for o in row]
                                                                 for row in expected["offset_mapping"]]


def test_preparation_progress_is_one_line_redrawn_on_a_terminal(monkeypatch):
    import io

    from tuneloop.console import PrepareProgress

    clock = iter([0.0, 1.0, 1.05, 3.0])
    monkeypatch.setattr("tuneloop.console.time.perf_counter", lambda: next(clock))
    screen = io.StringIO()
    progress = PrepareProgress(screen, live=True)  # started at 0
    progress.update(2000, 0.25)  # at 1 s
    progress.update(2100, 0.26)  # at 1.05 s: too soon to redraw
    progress.update(8000, 1.0)  # at 3 s
    progress.close()
    draws = screen.getvalue().replace("\x1b[K", "").split("\r")[1:]
    assert draws == ["preparing data: 2,000 rows read (25% of the files) | 2,000 rows/s | left 0m03s",
                     "preparing data: 8,000 rows read (100% of the files) | 2,667 rows/s\n"]


def test_data_files_are_hashed_once_until_they_change(tmp_path, tiny_model_dir):
    import hashlib
    import json
    import os

    from tuneloop.model.tokenizer import load_tokenizer

    data = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(40))
    cfg = config_for(tmp_path, tiny_model_dir, data, "prepared")
    tokenizer = load_tokenizer(cfg, encoder_decoder=False)
    first = prepare_module.prepare(cfg, tokenizer).cache_dir
    memo = json.loads((tmp_path / "prepared" / prepare_module.FILE_DIGESTS).read_text())
    assert memo[str(data.resolve())]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert prepare_module.prepare(cfg, tokenizer).cache_dir == first
    write_jsonl(data, tiny_rows(40, seed=1))  # new content (and a new modification time)
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1_000_000))
    assert prepare_module.prepare(cfg, tokenizer).cache_dir != first
