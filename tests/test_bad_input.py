"""The README's bad-input table, row by row (the config and data rows live in test_config.py and
test_data_formats.py): each gives exit code 2, one clear message, no traceback, and loses nothing."""

from __future__ import annotations

import contextlib
import shutil
import subprocess

import pytest
from conftest import (assert_every_rank_stopped_with, assert_user_error, base_config, read_metrics, run_in_process,
                      run_two_ranks, tiny_rows, write_config, write_jsonl)
from safetensors.torch import load_file

from tuneloop.run_files import complete_checkpoints


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bad_input_data") / "train.jsonl", tiny_rows(40, seed=2))


def test_empty_dataset_and_dataset_empty_after_filtering(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = write_config(tmp_path / "empty.yml", **base_config(tmp_path, tiny_model_dir, empty))
    assert_user_error(run_in_process("plan", str(config)), "no training rows left: read 0")
    long_rows = write_jsonl(tmp_path / "long.jsonl", [{"instruction": "Count. " * 100, "output": "one"}] * 3)
    config = write_config(tmp_path / "long.yml", **base_config(tmp_path, tiny_model_dir, long_rows, sequence_len=32))
    assert_user_error(run_in_process("plan", str(config)), "no training rows left: read 3, dropped 3 longer than "
                      "sequence_len=32")


def test_output_dir_with_another_runs_files_is_refused_unless_overwrite(tmp_path, tiny_model_dir, data):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=2))
    assert run_in_process("train", str(config)).returncode == 0
    before = load_file(tmp_path / "out" / "model.safetensors")
    again = run_in_process("train", str(config), "--set", "learning_rate=0.5")
    assert_user_error(again, "holds another run's files", "--overwrite", "auto_resume_from_checkpoints")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert all((before[k] == after[k]).all() for k in before)  # nothing was touched
    replaced = run_in_process("train", str(config), "--set", "learning_rate=0.5", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-1500:]
    assert max(m["step"] for m in read_metrics(tmp_path / "out")) == 2


def test_checkpoint_from_another_config_is_refused_naming_what_changed(tmp_path, tiny_model_dir, data):
    keys = dict(save_strategy=None, save_steps=2, max_steps=4, auto_resume_from_checkpoints=True)
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    assert run_in_process("train", str(config)).returncode == 0
    (tmp_path / "out" / "summary.json").unlink()  # as if the run had been killed after its last checkpoint
    changed = run_in_process("train", str(config), "--set", "micro_batch_size=2", "--set", "sequence_len=200")
    assert_user_error(changed, "different run", "micro_batch_size (4 → 2)", "the prepared data", "--force-resume")
    forced = run_in_process("train", str(config), "--set", "max_steps=6", "--force-resume")
    assert forced.returncode == 0, forced.stderr[-1500:]
    assert "resuming from" in forced.stdout
    steps = [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert steps == list(range(1, 7))


@contextlib.contextmanager
def small_disk(tmp_path, size: str = "2600k"):
    """A real full disk: a small tmpfs (by default it holds one checkpoint of the tiny model, about 1.6 MB,
    but not two)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)
        shutil.rmtree(disk, ignore_errors=True)


def assert_only_the_first_checkpoint_stays(out):
    kept = complete_checkpoints(out)
    assert [p.name for p in kept] == ["checkpoint-2"]
    assert load_file(kept[0] / "model.safetensors")  # readable, complete
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".rng-*"))


def test_a_full_disk_while_preparing_says_how_much_had_been_written(tmp_path, tiny_model_dir):
    """A real full disk under the prepared rows (a 24 KB tmpfs): the message says the disk is full and what had been
    written when it filled (a floor of what the rows need), and leaves nothing half-written. numpy's short write
    ("N requested and M written", no errno) counts as a full disk too."""
    from tuneloop.data.prepare import _looks_full

    rows = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(400, seed=3))
    with small_disk(tmp_path, "24k") as disk:
        keys = dict(dataset_prepared_path=str(disk / "prepared"), dataset_processes=1)
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, rows, **keys))
        result = run_in_process("preprocess", str(config))
        assert_user_error(result, "the disk is full while writing the prepared data", "it filled with",
                          "of prepared rows written and", "need more than that")
        assert not [path for path in (disk / "prepared").iterdir() if path.name.startswith(".tmp-")]
    assert _looks_full(OSError("4096 requested and 0 written")) and not _looks_full(OSError("Permission denied"))


@pytest.mark.slow
def test_full_disk_during_a_save_is_a_clear_error_and_the_old_checkpoint_stays(tmp_path, tiny_model_dir, data):
    with small_disk(tmp_path) as disk:
        keys = dict(save_strategy=None, save_steps=2, max_steps=6, output_dir=str(disk / "out"))
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
        # (past the check before step 1, which would refuse this disk: a disk can also fill during a run)
        result = run_in_process("train", str(config), "--ignore-disk-check")
        assert_user_error(result, "could not save step 4", "the disk is full", "newest complete checkpoint is "
                          "checkpoint-2")
        assert_only_the_first_checkpoint_stays(disk / "out")


@pytest.mark.slow
def test_full_disk_in_a_two_rank_run_stops_every_rank_with_the_message(tmp_path, tiny_model_dir, data):
    """Whichever rank's write fails, every rank stops with the message and exit code 2. Before, rank 0
    alone printed it and rank 1 died in the next barrier with gloo's 'Connection closed by peer' traceback."""
    with small_disk(tmp_path) as disk:
        keys = dict(save_strategy=None, save_steps=2, max_steps=6, micro_batch_size=1,
                    output_dir=str(disk / "out"))
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
        result = run_two_ranks("train", str(config), "--ignore-disk-check", timeout=240)
        assert_every_rank_stopped_with(result, "could not save step 4")  # torchrun prefixes nothing on CPU
        assert "the disk is full" in result.stderr and "newest complete checkpoint is checkpoint-2" in result.stderr
        assert_only_the_first_checkpoint_stays(disk / "out")


@pytest.mark.slow
def test_full_disk_during_the_final_save_leaves_no_torn_model(tmp_path, tiny_model_dir, data):
    with small_disk(tmp_path, size="400k") as disk:  # the tiny model's weights alone are about 0.5 MB
        out = disk / "out"
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=3,
                                                                   output_dir=str(out)))
        result = run_in_process("train", str(config), "--ignore-disk-check")
        assert_user_error(result, "could not save the final model", "the disk is full")
        # nothing that from_pretrained would pick up half-written, and the run is not marked finished
        assert not list(out.glob("*.safetensors")) and not (out / "config.json").exists()
        assert not (out / "summary.json").exists() and not list(out.glob(".tmp-*"))
        assert [m["step"] for m in read_metrics(out) if "loss" in m] == [1, 2, 3]


def test_base_model_folder_that_does_not_exist(tmp_path, data):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tmp_path / "no-such-model", data))
    assert_user_error(run_in_process("plan", str(config)), "`base_model:", "no-such-model` is not an existing folder")


def test_a_real_disk_too_small_for_the_model_is_refused_before_step_1(tmp_path, tiny_model_dir, data):
    with small_disk(tmp_path, size="400k") as disk:  # the tiny model's weights alone are about 0.5 MB
        out = disk / "out"
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=3,
                                                                   output_dir=str(out)))
        assert_user_error(run_in_process("train", str(config)), "GB free, and the run writes about",
                          "the final model", "--ignore-disk-check")
        assert not (out / "metrics.jsonl").exists() and not list(out.glob(".tmp-*"))
