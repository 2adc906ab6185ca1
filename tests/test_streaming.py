"""Streamed runs (pretraining_dataset, streaming: true) through the real `tuneloop train`:

- the plan is what ran: max_steps steps of full sequence_len rows, every real token counted, over several
  passes of data that wraps (passes start on every rank together);
- a run killed mid-save resumes from its last checkpoint to the same weights as an uninterrupted run (each
  rank's stream position is in the checkpoint);
- two ranks read disjoint shares (data/stream.py's own tests show the shares; here two real ranks train a
  stream whose passes run out on different ranks at different times, and finish the plan);
- an encoder-decoder streams source/target rows (the forum's shape);
- what a stream cannot do is refused, naming the key.
"""

from __future__ import annotations

import json

import pytest
from conftest import (assert_user_error, base_config, read_metrics, run_in_process, start_train, tiny_rows,
                      write_config, write_jsonl)
from test_resume import assert_identical, weights
from test_seq2seq import pairs, tiny_t5_dir  # noqa: F401  (fixtures)

from tuneloop.run_files import complete_checkpoints
from tuneloop.train.checkpoint import CRASH_DURING_SAVE_ENV
from tuneloop.train.guards import SIGNAL_AT_STEP_ENV


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Raw text rows of very different lengths (a pass fills only a few steps, so passes wrap)."""
    rows = [{"text": f"{row['instruction']} {row['output']}"} for row in tiny_rows(10, seed=11)]
    return write_jsonl(tmp_path_factory.mktemp("texts") / "corpus.jsonl", rows)


def pretraining_keys(corpus, **keys) -> dict:
    return {"datasets": None, "pretraining_dataset": [{"path": str(corpus), "text_column": "text"}],
            "streaming": True, "sequence_len": 32, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
            "max_steps": 12, "learning_rate": 2e-3, "warmup_steps": 2, **keys}


def test_a_streamed_run_takes_the_planned_steps_of_full_rows_over_several_passes(tmp_path, tiny_model_dir, texts):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, texts,
                                                             **pretraining_keys(texts)))
    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "streamed, packed" in planned.stdout and "128 tokens per step (4 × 32)" in planned.stdout
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "out"
    plan, summary = json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text())
    lines = [line for line in read_metrics(out) if "loss" in line]
    assert [line["step"] for line in lines] == list(range(1, 13)) and summary["steps"] == plan["total_steps"] == 12
    assert summary["real_tokens"] == plan["total_real_tokens"] == 12 * 4 * 32  # every row full, every step
    assert 0 < lines[-1]["tokens"] < 12 * 4 * 32  # the targets: each piece's first token predicts nothing
    assert lines[-1]["epoch"] >= 2 and lines[0]["epoch"] == 0  # the data wrapped: passes 0, 1, 2, ...
    assert summary["stream"]["passes_started"] == lines[-1]["epoch"] + 1
    assert summary["stream"]["rows_read"] >= 10 * (summary["stream"]["passes_started"] - 1)


@pytest.mark.slow
def test_a_streamed_run_killed_mid_save_resumes_to_the_same_weights(tmp_path, tiny_model_dir, texts):
    keys = pretraining_keys(texts, save_steps=4, save_total_limit=3, auto_resume_from_checkpoints=True,
                            save_strategy=None)
    straight = write_config(tmp_path / "straight.yml", **base_config(tmp_path / "straight", tiny_model_dir, texts,
                                                                     **keys))
    assert run_in_process("train", str(straight)).returncode == 0
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path / "run", tiny_model_dir, texts, **keys))
    crashed = start_train(config, env={CRASH_DURING_SAVE_ENV: "8"})
    crashed.communicate(timeout=300)
    # killed while writing checkpoint-8: checkpoint-4, inside the second pass over the data, is the newest whole one
    assert crashed.returncode != 0 and [p.name for p in complete_checkpoints(tmp_path / "run" / "out")] == \
        ["checkpoint-4"]
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_identical(weights(tmp_path / "run" / "out"), weights(tmp_path / "straight" / "out"))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tiny_model_dir, texts) -> tuple:
    """This module's two-rank runs in one launch (conftest's run_in_one_launch): a stream stopped by a signal (its
    folder copied as it stopped), its resume, and a stream with a bad row in rank 1's share."""
    from conftest import run_in_one_launch

    root = tmp_path_factory.mktemp("streamed_two_ranks")
    (root / "stopped").mkdir()
    keys = pretraining_keys(texts, gradient_accumulation_steps=1, save_strategy=None, save_steps=100,
                            auto_resume_from_checkpoints=True)
    config = write_config(root / "stopped" / "run.yml", **base_config(root / "stopped", tiny_model_dir, texts, **keys))
    rows = tiny_rows(12, seed=2)
    del rows[5]["output"]  # row 5 is rank 1's (rows are dealt g % 2): rank 0 never reads it
    (root / "bad_row").mkdir()
    data = write_jsonl(root / "bad_row" / "rows.jsonl", rows)
    bad_row = write_config(root / "bad_row" / "run.yml", **base_config(root / "bad_row", tiny_model_dir, data,
                                                                       streaming=True, max_steps=4,
                                                                       micro_batch_size=2))
    stopped, resumed, bad = run_in_one_launch(
        {"args": ["train", config], "env": {SIGNAL_AT_STEP_ENV: "0:5"},
         "then_copy": (root / "stopped" / "out", root / "as_stopped" / "out")},
        ["train", config], ["train", bad_row])
    return root, {"stopped": stopped, "resumed": resumed, "bad_row": bad}


@pytest.mark.slow
def test_two_ranks_stream_their_own_shares_through_synchronised_passes_and_resume(two_rank_runs, tiny_model_dir,
                                                                                  texts):
    """Rank 0 is signalled after step 5: both ranks save step 6 (with their stream positions) and stop; a single
    process may not take the checkpoint over; two ranks resume it and finish the plan."""
    root, results = two_rank_runs
    assert results["stopped"].returncode == 75, results["stopped"].stderr[-3000:]
    as_stopped = root / "as_stopped"
    assert [path.name for path in complete_checkpoints(as_stopped / "out")] == ["checkpoint-6"]
    # another number of ranks would split the stream into other shares: refused even when forced
    keys = pretraining_keys(texts, gradient_accumulation_steps=1, save_strategy=None, save_steps=100,
                            auto_resume_from_checkpoints=True)
    config = write_config(as_stopped / "run.yml", **base_config(as_stopped, tiny_model_dir, texts, **keys))
    assert_user_error(run_in_process("train", str(config), "--force-resume"), "written by 2 ranks", "this run has 1")
    resumed = results["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out = root / "stopped" / "out"
    plan = json.loads((out / "plan.json").read_text())
    lines = [line for line in read_metrics(out) if "loss" in line]
    assert plan["world_size"] == 2 and [line["step"] for line in lines] == list(range(1, 13))
    assert lines[-1]["epoch"] >= 2  # several passes, each rank's share running out at its own time


def test_an_encoder_decoder_streams_source_target_rows(tmp_path, tiny_t5_dir, pairs):  # noqa: F811
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_t5_dir, pairs, datasets=[{"path": str(pairs), "type": "seq2seq"}], streaming=True,
        sequence_len=64, micro_batch_size=4, max_steps=30, test_datasets=[{"path": str(pairs), "type": "seq2seq"}],
        evals_per_epoch=1, eval_on_start=True))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "out"
    metrics = read_metrics(out)
    assert [line["step"] for line in metrics if "loss" in line] == list(range(1, 31))
    evals = [line["eval_loss"] for line in metrics if "eval_loss" in line]
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert [line for line in metrics if "loss" in line][-1]["epoch"] >= 1  # 96 rows, 4 a step: a second pass


def test_what_a_stream_cannot_do_is_refused(tmp_path, tiny_model_dir, texts):
    def refused(*fragments, **keys):
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, texts, **keys))
        assert_user_error(run_in_process("plan", str(config)), *fragments)

    refused("set `max_steps`", **pretraining_keys(texts, max_steps=None))
    refused("`val_set_size`", "test_datasets", **pretraining_keys(texts, val_set_size=0.1))
    refused("`group_by_length`", **pretraining_keys(texts, group_by_length=True))
    refused("`pretraining_dataset` replaces `datasets`",
            **pretraining_keys(texts, datasets=[{"path": str(texts), "type": "completion"}]))
    refused("skipping rows", **pretraining_keys(texts, pretraining_dataset=[{"path": str(texts), "skip": 5}]))


@pytest.mark.slow
def test_a_bad_row_in_one_ranks_share_stops_every_rank_with_its_message(two_rank_runs):
    """Rank 1 alone reads the bad row; both ranks stop with its one line and exit 2 (through the real launcher's
    exit codes: test_user_errors.py's two-rank test)."""
    _, results = two_rank_runs
    result = results["bad_row"]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("rows.jsonl:6: missing field `output`") == 2, result.stderr[-3000:]


def test_packed_rows_inside_untrained_prompts_are_skipped_not_a_division_by_zero(tmp_path, tiny_model_dir):
    rows = [dict(row, input=" ".join([row["instruction"]] * 6)) for row in tiny_rows(8, seed=4)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)  # long prompts (not trained), short replies
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, streaming=True,
                                                             sample_packing=True, sequence_len=16, max_steps=6,
                                                             micro_batch_size=1))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stream = json.loads((tmp_path / "out" / "summary.json").read_text())["stream"]
    assert stream["rows_without_targets"] > 0 and stream["rows_read"] > 0
    assert "packed rows without a trained token skipped" in result.stdout
    assert all(line["loss"] == line["loss"] for line in read_metrics(tmp_path / "out") if "loss" in line)  # no NaN


def test_a_tokenizer_trained_for_a_pretraining_stream_learns_from_its_text(tmp_path, texts):
    from transformers import AutoTokenizer

    keys = base_config(tmp_path, tmp_path, texts, **pretraining_keys(texts),
                       base_model_config="llama", overrides_of_model_config={
                           "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "num_key_value_heads": 1},
                       train_tokenizer={"type": "bpe", "vocab_size": 400, "min_frequency": 1})
    del keys["base_model"]
    config = write_config(tmp_path / "run.yml", **keys)
    assert run_in_process("plan", str(config)).returncode == 0
    folders = list((tmp_path / "prepared").glob("tokenizer-*"))
    tokenizer = AutoTokenizer.from_pretrained(folders[0])
    assert len(folders) == 1 and len(tokenizer) > 256 + 3  # merges learnt from the stream's text, not bytes alone
    words = open(texts).read().split('"text": "')[1].split()[:3]
    assert len(tokenizer(" ".join(words))["input_ids"]) < len(" ".join(words))  # whole words or pieces, not bytes
    # other text, another tokenizer (the key holds the data's bytes)
    write_jsonl(texts.parent / "other.jsonl", [{"text": "entirely different words here"}] * 20)
    other = dict(keys, pretraining_dataset=[{"path": str(texts.parent / "other.jsonl")}])
    assert run_in_process("plan", str(write_config(tmp_path / "other.yml", **other))).returncode == 0
    assert len(list((tmp_path / "prepared").glob("tokenizer-*"))) == 2
