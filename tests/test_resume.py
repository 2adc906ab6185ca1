"""Checkpoints survive anything: a SIGKILL at a random point (also half-way through a save) and an
auto-resume end with weights bit-identical to an uninterrupted run, and metrics.jsonl has every
step once; a torn checkpoint is never chosen; SIGTERM saves and exits 75; a NaN stops the run."""

from __future__ import annotations

import json
import math
import random
import signal
from pathlib import Path

import pytest
import torch
from conftest import (base_config, killed_then_resumed, read_metrics, run_in_process, start_train, tiny_rows,
                      write_config, write_jsonl)
from safetensors.torch import load_file, save_file

from tuneloop.run_files import STATE, complete_checkpoints
from tuneloop.train.checkpoint import CRASH_DURING_SAVE_ENV
from tuneloop.train.guards import SIGNAL_AT_STEP_ENV

VARIANTS = {
    "padded_accum2": dict(micro_batch_size=2, gradient_accumulation_steps=2),
    "packed": dict(sample_packing=True, micro_batch_size=1, gradient_accumulation_steps=1),
    "grouped_accum3": dict(group_by_length=True, micro_batch_size=2, gradient_accumulation_steps=3),
    # bf16 compute weights with fp32 masters: the checkpoint holds the masters
    "masters": dict(bf16=True, master_weights=True, micro_batch_size=2, gradient_accumulation_steps=2),
}
RESUMABLE = dict(num_epochs=2, save_strategy=None, save_steps=3, save_total_limit=2, learning_rate=2e-3, warmup_steps=2,
                 val_set_size=0.1, evals_per_epoch=2, auto_resume_from_checkpoints=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("resume_data") / "train.jsonl", tiny_rows(60, seed=21))


def weights(output_dir: Path) -> dict:
    return load_file(output_dir / "model.safetensors")


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def uninterrupted(tmp_path, model_dir, data, keys) -> tuple[dict, list[dict]]:
    config = write_config(tmp_path / "straight.yml", **base_config(tmp_path / "straight", model_dir, data, **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    return weights(tmp_path / "straight" / "out"), read_metrics(tmp_path / "straight" / "out")


# a true kill -9 for one variant; the others stopped in this process by the signal-at-step hook (conftest's
# killed_then_resumed): what they add is their batching and precision across a resume, not another kind of stop
STOPPED_BY = {"padded_accum2": "sigkill", "packed": "signal", "grouped_accum3": "signal", "masters": "signal"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_sigkill_at_a_random_point_then_auto_resume_is_bit_identical(tmp_path, tiny_model_dir, data, variant):
    keys = {**RESUMABLE, **VARIANTS[variant]}
    expected_weights, expected_metrics = uninterrupted(tmp_path, tiny_model_dir, data, keys)
    total = max(m["step"] for m in expected_metrics if "loss" in m)

    run_dir = tmp_path / "killed"
    config = write_config(tmp_path / "killed.yml", **base_config(run_dir, tiny_model_dir, data, **keys))
    seed = random.randrange(10**6)
    stop_after = random.Random(seed).randint(4, total - 4)
    print(f"stopped ({STOPPED_BY[variant]}) after step {stop_after} of {total} (seed {seed})")
    killed_then_resumed(config, run_dir / "out", stop_after, how=STOPPED_BY[variant])

    assert_identical(weights(run_dir / "out"), expected_weights)
    plan = json.loads((run_dir / "out" / "plan.json").read_text())
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["targets_collated"] == plan["total_trainable_tokens"]  # counted across the kill
    metrics = read_metrics(run_dir / "out")
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, total + 1)), f"seed {seed}"
    assert [m["loss"] for m in metrics if "loss" in m] == [m["loss"] for m in expected_metrics if "loss" in m]
    assert [m["eval_loss"] for m in metrics if "eval_loss" in m] == \
        [m["eval_loss"] for m in expected_metrics if "eval_loss" in m]


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_no_checkpoint_that_is_resumed(tmp_path, tiny_model_dir, data):
    # logging every 4 steps, saving every 3: saves log too, so the resumed run's lines equal the straight run's
    keys = {**RESUMABLE, **VARIANTS["padded_accum2"], "logging_steps": 4}
    expected_weights, expected_metrics = uninterrupted(tmp_path, tiny_model_dir, data, keys)
    run_dir = tmp_path / "torn"
    config = write_config(tmp_path / "torn.yml", **base_config(run_dir, tiny_model_dir, data, **keys))
    crashed = start_train(config, env={CRASH_DURING_SAVE_ENV: "6"})
    crashed.communicate(timeout=300)
    assert crashed.returncode == -signal.SIGKILL
    out = run_dir / "out"
    assert (out / ".tmp-checkpoint-6").is_dir()  # the torn save is there …
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-3"]  # … and not a checkpoint
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "checkpoint-3" in resumed.stdout
    assert_identical(weights(out), expected_weights)
    assert not (out / ".tmp-checkpoint-6").exists()
    assert read_metrics(out) and [untimed(m) for m in read_metrics(out)] == [untimed(m) for m in expected_metrics]


def untimed(metrics: dict) -> dict:
    """A metrics line without what the clock decides (throughput and the MFU taken from it)."""
    return {k: v for k, v in metrics.items() if "per_second" not in k and k != "mfu"}


def test_overwrite_clears_what_tuneloop_wrote_and_nothing_else(tmp_path):
    """Only names tuneloop recorded writing (and its saves in progress) go, even where a user's file has a name
    tuneloop also uses (README.md is peft's adapter card too; checkpoint-notes.txt looks like a checkpoint)."""
    from tuneloop.run_files import clear_run_files, record

    out = tmp_path / "out"
    for name in ("checkpoint-3", ".tmp-checkpoint-6", "best", ".old-best", ".tmp-final"):
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(b"x")
    for name in ("plan.json", "model.safetensors", "README.md", "checkpoint-notes.txt", "notes.txt"):
        (out / name).write_text("{}")
    record(out, "plan.json", "model.safetensors", "checkpoint-3", "best")
    clear_run_files(out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "checkpoint-notes.txt", "notes.txt"]


def test_a_run_of_an_older_tuneloop_without_the_record_loses_only_its_own_kinds_of_files(tmp_path):
    from tuneloop.run_files import STATE, clear_run_files

    out = tmp_path / "out"
    for name, marked in (("checkpoint-3", True), ("checkpoint-backup", False)):
        (out / name).mkdir(parents=True)
        if marked:
            (out / name / STATE).write_text("{}")
    for name in ("plan.json", "metrics.jsonl", "notes.txt"):
        (out / name).write_text("{}")
    clear_run_files(out)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-backup", "notes.txt"]


def test_auto_resume_picks_the_newest_complete_checkpoint(tmp_path):
    from tuneloop.config import config_from_dict
    from tuneloop.train.resume import choose_checkpoint

    out = tmp_path / "out"
    for step, complete in ((3, True), (6, True), (9, False)):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"weight": torch.zeros(2)}, folder / "model.safetensors")
        torch.save({}, folder / "training_state.pt")
        if complete:
            (folder / STATE).write_text("{}")
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "auto_resume_from_checkpoints": True})
    notices = []
    assert choose_checkpoint(cfg, out, False, notices).name == "checkpoint-6" and notices == []


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_resumes_exactly(tmp_path, tiny_model_dir, data):
    """SIGTERM (raised in this process after step 5 by the signal-at-step hook; torchrun's real exit code 75 is in the
    two-rank test below): one checkpoint where none was scheduled, exit 75, and the resume ends bit-identical."""
    keys = {**RESUMABLE, **VARIANTS["padded_accum2"], "save_steps": 100}  # no scheduled save before the signal
    expected_weights, _ = uninterrupted(tmp_path, tiny_model_dir, data, keys)
    run_dir = tmp_path / "term"
    config = write_config(tmp_path / "term.yml", **base_config(run_dir, tiny_model_dir, data, **keys))
    saved, _ = killed_then_resumed(config, run_dir / "out", 5, how="signal")
    assert saved.name == "checkpoint-5"
    assert_identical(weights(run_dir / "out"), expected_weights)


@pytest.mark.slow
def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, tiny_model_dir, data):
    keys = dict(optimizer="sgd", learning_rate=1e4, max_grad_norm=0, lr_scheduler="constant", save_steps=1,
                save_strategy=None,
                num_epochs=3, micro_batch_size=2)
    config = write_config(tmp_path / "nan.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "not finite at step" in result.stderr and "Traceback" not in result.stderr
    bad_step = int(result.stderr.split("not finite at step ")[1].split()[0])
    metrics = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    logged = {m["step"]: m for m in metrics}
    assert not (math.isfinite(logged[bad_step]["loss"]) and math.isfinite(logged[bad_step]["grad_norm"]))
    kept = complete_checkpoints(tmp_path / "out")
    assert kept and int(kept[-1].name.split("-")[1]) < bad_step
    assert all(torch.isfinite(t).all() for t in load_file(kept[-1] / "model.safetensors").values())


@pytest.mark.slow
def test_loss_watchdog_threshold_stops_after_patience(tmp_path, tiny_model_dir, data):
    config = write_config(tmp_path / "high.yml", **base_config(
        tmp_path, tiny_model_dir, data, loss_watchdog_threshold=0.5, loss_watchdog_patience=2, max_steps=6))
    result = run_in_process("train", str(config))
    assert result.returncode == 3 and "loss_watchdog_threshold=0.5 for 2 steps in a row, reaching step 2" \
        in result.stderr


def test_a_high_loss_streak_carries_on_across_a_resume(tmp_path, tiny_model_dir, data, monkeypatch):
    """Patience 3, stopped (SIGTERM) and checkpointed after 2 high steps: the resumed run trips at its first
    step, the third in a row, not 3 steps after the resume."""
    keys = dict(loss_watchdog_threshold=0.5, loss_watchdog_patience=3, max_steps=8, save_steps=1, save_strategy=None,
                auto_resume_from_checkpoints=True)
    config = write_config(tmp_path / "high.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, "0:2")
    stopped = run_in_process("train", str(config))
    assert stopped.returncode != 3 and [c.name for c in complete_checkpoints(tmp_path / "out")][-1] == "checkpoint-2", \
        stopped.stdout[-2000:] + stopped.stderr[-2000:]
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 3 and "for 3 steps in a row, reaching step 3" in resumed.stderr, resumed.stderr[-2000:]


@pytest.mark.slow
def test_early_stopping_keeps_the_best_model(tmp_path, tiny_model_dir, data):
    keys = dict(val_set_size=0.2, eval_steps=1, early_stopping_patience=2, learning_rate=0.05,
                lr_scheduler="constant", num_epochs=4, max_grad_norm=0)
    config = write_config(tmp_path / "early.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert summary["stopped_by"] == "early_stopping" and summary["steps"] < plan["total_steps"]
    evals = [m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m]
    best = evals.index(min(evals))
    assert len(evals) == best + 3  # two evals without improvement after the best, then stop
    assert_identical(weights(out), weights(out / "best"))


@pytest.mark.slow
def test_resuming_from_the_checkpoint_where_early_stopping_fired_stops_again(tmp_path, tiny_model_dir, data):
    """The final save failed after early stopping (say, a full disk): resuming from the checkpoint of the
    stop step must not train on past the stop."""
    keys = dict(val_set_size=0.2, eval_steps=1, save_steps=1, save_strategy=None, save_total_limit=2,
                early_stopping_patience=2, learning_rate=0.05, lr_scheduler="constant", num_epochs=4,
                max_grad_norm=0, auto_resume_from_checkpoints=True)
    config = write_config(tmp_path / "early.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    first = run_in_process("train", str(config))
    assert first.returncode == 0, first.stderr[-2000:]
    out = tmp_path / "out"
    stop_step = json.loads((out / "summary.json").read_text())["steps"]
    assert complete_checkpoints(out)[-1].name == f"checkpoint-{stop_step}"
    best = weights(out / "best")
    for name in ("summary.json", "model.safetensors"):  # as if the final save had failed …
        (out / name).unlink()
    for torn in (".tmp-final", ".tmp-best"):  # … half-way, and an earlier best-model save too
        (out / torn).mkdir()
        (out / torn / "model.safetensors").write_bytes(b"torn")
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "early_stopping" and summary["steps"] == stop_step
    assert max(m["step"] for m in read_metrics(out)) == stop_step
    assert_identical(weights(out), best)
    assert not list(out.glob(".tmp-*"))


SIGNALLED = dict(micro_batch_size=2, max_steps=6, logging_steps=50, save_strategy=None, save_steps=100,
                 learning_rate=1e-2, auto_resume_from_checkpoints=True)
DROPOUT = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.2, lora_target_modules=["q_proj", "v_proj"],
               micro_batch_size=2, gradient_accumulation_steps=1, max_steps=10, save_strategy=None, save_steps=3,
               learning_rate=1e-2, auto_resume_from_checkpoints=True)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tiny_model_dir, data) -> tuple[Path, dict]:
    """This module's two-rank runs in two torchrun launches (conftest's run_in_one_launch): the signalled run
    between its uninterrupted twin and its resume, and the dropout run's twin, then its kill inside a save (which
    ends the launch); the second launch resumes it. The killed folder is copied as the kill left it."""
    import shutil

    from conftest import run_in_one_launch

    root = tmp_path_factory.mktemp("two_ranks")

    def config(name: str, keys: dict) -> str:
        return str(write_config(root / f"{name}.yml", **base_config(root / name, tiny_model_dir, data, **keys)))

    names = ["straight", "stopped", "resumed", "dropout_straight", "dropout_crash"]
    results = dict(zip(names, run_in_one_launch(
        ["train", config("straight", SIGNALLED)], (["train", config("stopped", SIGNALLED)], {SIGNAL_AT_STEP_ENV: "1:3"}),
        ["train", config("stopped", SIGNALLED)], ["train", config("dropout_straight", DROPOUT)],
        (["train", config("dropout_crashed", DROPOUT)], {CRASH_DURING_SAVE_ENV: "6"}))))
    shutil.copytree(root / "dropout_crashed" / "out", root / "dropout_as_killed" / "out")
    results["dropout_resumed"], = run_in_one_launch(["train", config("dropout_crashed", DROPOUT)])
    return root, results


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_the_next_step_and_resumes_exactly(two_rank_runs):
    """Between logging steps too: rank 1 alone gets SIGTERM after step 3; both ranks checkpoint step 4
    (the flag is agreed one step later, without a sync) and exit 75; the resumed run ends bit-identical."""
    root, results = two_rank_runs
    assert results["straight"].returncode == 0, results["straight"].stderr[-3000:]
    stopped = results["stopped"]
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "SIGTERM received" in stopped.stdout and "stopped by a signal after step 4" in stopped.stdout
    assert results["resumed"].returncode == 0, results["resumed"].stderr[-3000:]
    assert "resuming from" in results["resumed"].stdout and "checkpoint-4" in results["resumed"].stdout
    assert_identical(weights(root / "stopped" / "out"), weights(root / "straight" / "out"))


@pytest.mark.slow
def test_two_rank_run_killed_mid_save_resumes_bit_identical_with_dropout(two_rank_runs):
    """Each rank draws its own dropout masks; a resume must give every rank back its own RNG state."""
    root, results = two_rank_runs
    assert results["dropout_straight"].returncode == 0, results["dropout_straight"].stderr[-3000:]
    assert results["dropout_crash"].returncode != 0
    as_killed = root / "dropout_as_killed" / "out"
    assert [p.name for p in complete_checkpoints(as_killed)] == ["checkpoint-3"]
    assert sorted(p.name for p in (as_killed / "checkpoint-3").glob("rng_state_*.pt")) == ["rng_state_0.pt",
                                                                                          "rng_state_1.pt"]
    assert results["dropout_resumed"].returncode == 0, results["dropout_resumed"].stderr[-3000:]
    expected = load_file(root / "dropout_straight" / "out" / "adapter_model.safetensors")
    assert_identical(load_file(root / "dropout_crashed" / "out" / "adapter_model.safetensors"), expected)
