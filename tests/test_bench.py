"""benchmarks/compare.py --quick, as small as still meaningful: every variant runs on the same tokens (the bf16
rows where the CPU has native bf16; elsewhere they are left out, and the benchmark says so).

No timing assertions (timings on shared CPUs say nothing in a test); only that the comparison is fair
(every row processed the same real tokens) and that the runs did comparable training (final losses agree).

The quick compare.py run is part of `make test`; the three that run TRL's and the Seq2SeqTrainer's whole benchmarks
are marked `bench`: they prove the benchmarks fair, not tuneloop correct, and run with `make bench-check` whenever
benchmarks/ changes (the suite's own run leaves them out: pyproject.toml's addopts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMES = ["tuneloop", "trainer", "trainer_group_by_length", "bare_loop", "tuneloop_packed", "tuneloop_defaults",
         "tuneloop_packed_defaults", "trainer_bf16", "trainer_bf16_group_by_length"]
UNPACKED = NAMES[:4]
UNPACKED_BF16 = ["tuneloop_defaults", "trainer_bf16", "trainer_bf16_group_by_length"]


@pytest.mark.slow
def test_quick_benchmark_is_fair_and_complete(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--quick", "--repeats", "1",
               "--train-rows", "32", "--eval-rows", "8", "--sequence-len", "256", "--workdir", str(tmp_path / "work"),
               "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    from tuneloop.host.hardware import native_bf16

    document = json.loads(out.read_text())
    assert document["preset"] == "quick"
    rows = {row["name"]: row for row in document["rows"]}
    bf16_here = native_bf16() is not None
    assert list(rows) == (NAMES if bf16_here else UNPACKED + ["tuneloop_packed"])
    if not bf16_here:  # said, in the output and the document
        assert "bf16 rows left out" in result.stdout and "no native bf16" in document["bf16_rows_left_out"]
    for name, row in rows.items():
        for key in ("real_tokens", "real_tokens_per_s", "steps_per_s", "peak_mem_mb", "final_loss",
                    "ratio_vs_bare", "ratio_vs_trainer"):
            assert isinstance(row[key], (int, float)) and row[key] > 0, (name, key, row[key])
    assert rows["bare_loop"]["ratio_vs_bare"] == 1.0 and rows["trainer"]["ratio_vs_trainer"] == 1.0
    # every row says its precision; tuneloop's defaults are bf16 on this CPU (AVX512-BF16), and tuneloop's
    # rows carry its MFU
    assert {row["precision"] for row in rows.values()} == ({"fp32", "bf16: auto", "bf16"} if bf16_here else {"fp32"})
    assert all(0 < rows[name]["mfu"] < 1 for name in rows if name.startswith("tuneloop"))

    # fairness: every variant processed exactly the same real (non-pad) tokens: the whole prepared train set
    assert {row["real_tokens"] for row in rows.values()} == {document["data"]["train_tokens"]}
    # same global batch over the same rows: the unpacked variants take the same number of optimizer steps,
    # packing takes fewer (that is the point) and computes almost no padding
    unpacked_names = UNPACKED + (UNPACKED_BF16 if bf16_here else [])
    assert len({rows[name]["steps"] for name in unpacked_names}) == 1
    assert rows["tuneloop_packed"]["steps"] < rows["tuneloop"]["steps"]
    assert rows["tuneloop_packed"]["padding_fraction"] < rows["tuneloop"]["padding_fraction"]

    # comparable training: eval loss per token on the same held-out rows. The unpacked runs differ only in
    # row order (and the bare loop's mean-of-means accumulation); the packed run takes fewer, larger steps.
    losses = {name: row["final_loss"] for name, row in rows.items()}
    untrained = 6.93  # ln(1024): the tiny model's vocabulary
    assert all(loss < untrained - 0.2 for loss in losses.values()), losses
    unpacked = [losses[name] for name in UNPACKED]
    assert max(unpacked) - min(unpacked) < 0.15, losses
    assert abs(losses["tuneloop_packed"] - losses["tuneloop"]) < 0.6, losses
    if bf16_here:  # bf16 trains the same model to within bf16's rounding: the same steps, a close loss
        assert rows["tuneloop_packed_defaults"]["steps"] == rows["tuneloop_packed"]["steps"]
        for name in UNPACKED_BF16:
            assert abs(losses[name] - losses["tuneloop"]) < 0.15, losses
        assert abs(losses["tuneloop_packed_defaults"] - losses["tuneloop_packed"]) < 0.15, losses


@pytest.mark.slow
@pytest.mark.bench
def test_the_dpo_benchmark_against_trl_is_fair(tmp_path):
    """benchmarks/preference.py --quick: tuneloop (padded, packed) and TRL's DPOTrainer train on the same pairs
    at the same precision; every row has its numbers and its ratio to TRL. No timing assertions."""
    out = tmp_path / "dpo.json"
    command = [sys.executable, str(REPO / "benchmarks" / "preference.py"), "--quick", "--pairs", "24",
               "--workdir", str(tmp_path / "work"), "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["tuneloop", "tuneloop_packed", "trl"] and rows["trl"]["ratio_vs_trl"] == 1.0
    assert {row["pairs"] for row in rows.values()} == {24} and {row["precision"] for row in rows.values()} == {"fp32"}
    assert rows["tuneloop"]["steps"] == rows["trl"]["steps"] == 3  # 24 pairs, 8 per step
    assert rows["tuneloop_packed"]["steps"] < rows["tuneloop"]["steps"]
    assert rows["tuneloop_packed"]["real_tokens"] == rows["tuneloop"]["real_tokens"]
    # the same conversations through the same chat template: TRL's token count is tuneloop's to within a few
    # tokens a pair (where each puts the reply's end marker and EOS)
    assert abs(rows["trl"]["real_tokens"] - rows["tuneloop"]["real_tokens"]) <= 4 * 24
    for row in rows.values():
        assert row["pairs_per_second"] > 0 and row["ratio_vs_trl"] > 0 and 0 < row["final_loss"] < 2
    assert "| trl | fp32 | 24 | 3 |" in result.stdout


@pytest.mark.slow
@pytest.mark.bench
def test_the_seq2seq_benchmark_reproduces_the_forum_comparison_fairly(tmp_path):
    """benchmarks/seq2seq.py --quick: tuneloop, Seq2SeqTrainer and the forum's max_length-padded Accelerate loop
    train the same tiny T5 (same weights, tokenizer, rows, batch, steps, optimizer) in fp32. No timing
    assertions: only that every row processed the same real tokens in the same steps, the forum loop computed
    more padding, and the three trained models agree on the held-out loss."""
    import math

    out = tmp_path / "seq2seq.json"
    command = [sys.executable, str(REPO / "benchmarks" / "seq2seq.py"), "--quick", "--workdir",
               str(tmp_path / "work"), "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["preset"] == "quick" and document["data"]["source"].startswith("embedded")
    rows = {row["name"]: row for row in document["rows"]}
    assert list(rows) == ["tuneloop", "seq2seq_trainer", "forum_loop"]
    for name, row in rows.items():
        assert row["precision"] == "fp32", name
        assert row["real_tokens_per_s"] > 0 and row["ratio_vs_forum_loop"] > 0 and row["ratio_vs_trainer"] > 0, row
    assert rows["forum_loop"]["ratio_vs_forum_loop"] == 1.0 and rows["seq2seq_trainer"]["ratio_vs_trainer"] == 1.0
    # fairness: every prepared token (encoder + decoder), every epoch, in the same optimizer steps
    assert {row["real_tokens"] for row in rows.values()} == {document["data"]["expected_real_tokens"]}
    assert len({row["steps"] for row in rows.values()}) == 1
    assert rows["tuneloop"]["steps"] == document["data"]["steps_per_epoch"] * document["settings"]["epochs"]
    # the forum's max_length padding computes far more positions than padding to the longest row
    assert rows["forum_loop"]["padding_fraction"] > rows["tuneloop"]["padding_fraction"] + 0.2, rows
    # the same training up to row order (the loss is the micro-batch's token mean in all three): measured
    # spread 0.03 on the quick preset; the loss fell from ln(400) = 5.99 at random init
    losses = [row["eval_loss"] for row in rows.values()]
    assert all(math.isfinite(loss) and loss < math.log(400) - 0.3 for loss in losses), losses
    assert max(losses) - min(losses) < 0.12, losses


@pytest.mark.slow
@pytest.mark.bench
def test_the_grpo_benchmark_against_trl_is_fair(tmp_path):
    """benchmarks/grpo.py --quick: tuneloop and TRL's GRPOTrainer train the same steps of the same number of
    completions at the same precision, each with its generation time apart; every row has its ratio to TRL. No
    timing assertions."""
    out = tmp_path / "grpo.json"
    command = [sys.executable, str(REPO / "benchmarks" / "grpo.py"), "--quick", "--workdir", str(tmp_path / "work"),
               "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["tuneloop", "trl"] and rows["trl"]["ratio_vs_trl"] == 1.0
    assert {row["steps"] for row in rows.values()} == {3} and {row["completions"] for row in rows.values()} == {24}
    assert {row["precision"] for row in rows.values()} == {"fp32"}
    for row in rows.values():
        assert 0 < row["generation_seconds_per_step"] < row["seconds_per_step"]
        assert 0 < row["completion_tokens"] <= 24 * 8 and row["ratio_vs_trl"] > 0
    assert "| trl | fp32 | 3 | 24 |" in result.stdout


def test_tuneloop_rows_and_their_profiles_start_under_mimalloc_and_other_tools_rows_do_not(monkeypatch):
    """compare.py starts each row's process as its tool's users get it: tuneloop's (and the --profile children that
    run tuneloop) under mimalloc as the `tuneloop` command would, the Trainer's and the bare loop's under glibc."""
    from tuneloop.host.allocator import GLIBC_SETTINGS, OPT_OUT, mimalloc_library

    if mimalloc_library() is None:
        pytest.skip("mimalloc is not installed here (cmeel-mimalloc, Linux only)")
    for name in (OPT_OUT, "LD_PRELOAD", *GLIBC_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import compare

    for name in [*compare.VARIANTS, *compare.PROFILES]:
        runs = compare.PROFILES.get(name) or compare.VARIANTS[name][0]
        assert ("LD_PRELOAD" in compare.child_env(1, name)) == runs.startswith("tuneloop"), name
    assert "LD_PRELOAD" not in compare.child_env(1, None)
