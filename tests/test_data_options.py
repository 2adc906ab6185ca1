"""axolotl's data options that change what is trained: `dataset_exact_deduplication` and `min_sample_len` filter
rows at preparation (the plan counts each), `curriculum_sampling` keeps the data's order and
`sample_packing_sequentially` packs next-fit in order (data/batching.py); the plan's step count stays the steps
run."""

from __future__ import annotations

import json

import numpy as np
from conftest import CORPUS, assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, \
    write_config, write_jsonl

from tuneloop.data.batching import BatchingSpec, epoch_batches, epoch_rng


def spec(mode: str, **order) -> BatchingSpec:
    return BatchingSpec(mode, micro_batch_size=2, sequence_len=10, world_size=1, seed=3, **order)


LENGTHS = np.array([4, 5, 3, 6, 2, 7, 1, 8, 4, 4])


def test_curriculum_keeps_the_datas_order_in_every_epoch():
    for epoch in (0, 1):
        assert epoch_batches(LENGTHS, spec("random", ordered=True), epoch) == [[[0], [1]], [[2], [3]], [[4], [5]],
                                                                                 [[6], [7]], [[8], [9]]]
    shuffled = [row for micro in epoch_batches(LENGTHS, spec("random"), 0) for row in micro]
    assert shuffled != [[i] for i in range(10)]  # (the default shuffles)


def test_sequential_packing_fills_each_row_in_order_before_opening_the_next():
    rows = [row for micro in epoch_batches(LENGTHS, spec("packed", ordered=True, sequential=True), 0) for row in micro]
    # 4+5 | 3+6 | 2+7+1 | 8 | 4+4: next-fit in the data's order (best-fit-decreasing would pair 8 with 2)
    assert rows == [[0, 1], [2, 3], [4, 5, 6], [7], [8, 9]]


def test_curriculum_packing_keeps_the_datas_order():
    """Best fit would take the longest sequence first; curriculum packs next-fit in the data's order."""
    rows = [row for micro in epoch_batches(LENGTHS, spec("packed", ordered=True), 0) for row in micro]
    assert [index for row in rows for index in row] == list(range(10))


def test_sequential_packing_without_curriculum_packs_one_shuffled_order_for_the_whole_run():
    """The packed rows are the same each epoch (so the plan's count holds) and reshuffled each epoch."""
    epochs = [[row for micro in epoch_batches(LENGTHS, spec("packed", sequential=True), epoch) for row in micro]
              for epoch in (0, 1, 2)]
    assert all(sorted(rows) == sorted(epochs[0]) for rows in epochs)
    assert len({json.dumps(rows) for rows in epochs}) > 1
    run_order = epoch_rng(3, 0).permutation(10).tolist()  # the one shuffle the run packs (seed 3, as spec())
    rows = sorted(epochs[0], key=lambda row: run_order.index(row[0]))
    assert [index for row in rows for index in row] == run_order  # each row a run of that order, none skipped
    for row, following in zip(rows, rows[1:]):  # next-fit: a row closes only when the next sequence does not fit
        assert sum(LENGTHS[row]) <= 10 < sum(LENGTHS[row]) + LENGTHS[following[0]]
    assert sorted(index for rows in epochs[0] for index in rows) == list(range(10))


def test_deduplication_and_min_sample_len_drop_rows_and_the_plan_counts_each(tmp_path, tiny_model_dir):
    words = " ".join(CORPUS).split()
    texts = [" ".join(words[i:i + 25]) for i in range(20)]  # 20 distinct rows of 25 words
    data = [{"text": text} for text in [*texts, *texts[3:8], "red fox", "blue dog", "red fox"]]
    path = write_jsonl(tmp_path / "rows.jsonl", data)
    keys = dict(datasets=[{"path": str(path), "type": "completion"}])
    plain = json.loads(run_in_process("plan", str(write_config(tmp_path / "plain.yml", **base_config(
        tmp_path / "a", tiny_model_dir, path, **keys))), "--json").stdout)
    assert (plain["train_rows"], plain["dropped_duplicates"], plain["dropped_too_short"]) == (28, 0, 0)
    config = write_config(tmp_path / "filtered.yml", **base_config(tmp_path / "b", tiny_model_dir, path, **keys,
                                                                    dataset_exact_deduplication=True,
                                                                    min_sample_len=12))
    result = run_in_process("plan", str(config), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    # the short rows go first (a short repeat counts as short), then the five repeats of earlier rows
    assert (plan["train_rows"], plan["dropped_too_short"], plan["dropped_duplicates"]) == (20, 3, 5)
    text = run_in_process("plan", str(config))
    assert "3 shorter than min_sample_len" in text.stdout and "5 repeating an earlier row" in text.stdout


def test_an_ordered_sequentially_packed_run_runs_the_steps_its_plan_counts(tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(48))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, path, sample_packing=True,
                                                              sample_packing_sequentially=True,
                                                              curriculum_sampling=True, num_epochs=2))
    plan = json.loads(run_in_process("plan", str(config), "--json").stdout)
    trained = run_in_process("train", str(config))
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == list(range(1, plan["total_steps"] + 1))


def test_sequential_packing_on_a_run_that_does_not_pack_is_refused(tmp_path, tiny_model_dir):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, tmp_path / "rows.jsonl",
                                                              sample_packing_sequentially=True))
    assert_user_error(run_in_process("check", str(config)), "`sample_packing_sequentially` chooses how rows are "
                                                             "packed", "`sample_packing: true`")


def test_a_stream_refuses_the_options_that_need_every_row(tmp_path, tiny_model_dir):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, tmp_path / "rows.jsonl",
                                                              streaming=True, max_steps=3,
                                                              dataset_exact_deduplication=True))
    assert_user_error(run_in_process("check", str(config)), "`dataset_exact_deduplication` cannot be used with a "
                                                             "streamed dataset")
