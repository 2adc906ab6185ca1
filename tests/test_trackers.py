"""Trackers through their real libraries, read back with their own readers: TensorBoard's event files, a wandb
offline run's transaction log, an MLflow local file store. One tiny run feeds all three."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.trackers import numbers_of, redacted, run_parameters


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model_dir):
    tmp_path = tmp_path_factory.mktemp("tracked")
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(40))
    store = tmp_path / "mlruns"
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, data, val_set_size=0.2, eval_steps=4, max_steps=8, logging_steps=2,
        use_tensorboard=True, wandb_project="tuneloop-tests", wandb_name="tiny", wandb_mode="offline",
        mlflow_tracking_uri=f"file:{store}", mlflow_experiment_name="tiny-experiment", mlflow_run_name="tiny"))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    output_dir = tmp_path / "out"
    return output_dir, read_metrics(output_dir), store, result


def train_and_eval_lines(metrics: list[dict]) -> tuple[list[dict], list[dict]]:
    return [m for m in metrics if "loss" in m], [m for m in metrics if "eval_loss" in m]


def test_the_run_says_where_each_tracker_writes(tracked_run):
    output_dir, _, _, result = tracked_run
    said = [line for line in result.stdout.splitlines() if line.startswith("tracking: ")]
    assert len(said) == 3, result.stdout[-3000:]
    assert any(str(output_dir / "runs") in line for line in said)
    assert any("wandb offline run" in line for line in said) and any("mlflow run" in line for line in said)


def test_tensorboard_event_files_hold_the_train_and_eval_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output_dir, metrics, _, _ = tracked_run
    events = EventAccumulator(str(output_dir / "runs"))
    events.Reload()
    train, evals = train_and_eval_lines(metrics)
    logged = events.Scalars("train/loss")
    assert [event.step for event in logged] == [m["step"] for m in train]
    assert [event.value for event in logged] == pytest.approx([m["loss"] for m in train], rel=1e-6)
    logged = events.Scalars("eval/loss")
    assert [event.step for event in logged] == [m["step"] for m in evals]
    assert [event.value for event in logged] == pytest.approx([m["eval_loss"] for m in evals], rel=1e-6)
    assert "train/lr" in events.Tags()["scalars"] and "eval/token_accuracy" in events.Tags()["scalars"]
    assert "summary/steps" in events.Tags()["scalars"]


def wandb_records(run_file: Path):
    """Every record of a wandb offline run's `.wandb` file: a 7-byte header, then LevelDB-log blocks of 32 KiB,
    each record cut into chunks with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        left_in_block = block - position % block
        if left_in_block < 7:  # the block's tail is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += left_in_block  # zero padding to the block's end
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_holds_the_metrics_and_the_plan(tracked_run):
    output_dir, metrics, _, _ = tracked_run
    run_files = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history, config = [], {}
    for record in wandb_records(run_files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":  # the run's first record carries the config it was started with
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    train, evals = train_and_eval_lines(metrics)
    logged = [row for row in history if "train/loss" in row]
    assert [row["_step"] for row in logged] == [m["step"] for m in train]
    assert [row["train/loss"] for row in logged] == pytest.approx([m["loss"] for m in train], rel=1e-9)
    assert [row["eval/loss"] for row in history if "eval/loss" in row] == pytest.approx(
        [m["eval_loss"] for m in evals], rel=1e-9)
    assert config["plan/total_steps"] == 8 and config["config/wandb_name"] == "tiny"


def test_mlflow_file_store_holds_the_metrics_and_the_plan_parameters(tracked_run):
    from mlflow.tracking import MlflowClient

    _, metrics, store, _ = tracked_run
    client = MlflowClient(f"file:{store}")
    experiment = client.get_experiment_by_name("tiny-experiment")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    train, evals = train_and_eval_lines(metrics)
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda metric: metric.step)
    assert [metric.step for metric in history] == [m["step"] for m in train]
    assert [metric.value for metric in history] == pytest.approx([m["loss"] for m in train])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")] == pytest.approx(
        [m["eval_loss"] for m in evals])
    assert run.data.params["plan/total_steps"] == "8" and run.data.params["config/max_steps"] == "8"
    assert run.data.metrics["summary/steps"] == 8


def test_a_tracker_that_cannot_start_stops_the_run_before_training_and_hides_credentials(
        tmp_path, tiny_model_dir, monkeypatch):
    # an MLflow server that is not there, with a password in its URI; no retries, so it fails at once
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(12))
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, data, max_steps=2, mlflow_tracking_uri="http://alice:s3cret@127.0.0.1:9/"))
    result = run_in_process("train", str(config))
    assert_user_error(result, "mlflow: could not start a run at http://***@127.0.0.1:9/", "mlflow_tracking_uri")
    assert "s3cret" not in result.stdout + result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_a_tracker_library_that_is_missing_is_named_with_its_install(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(12))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=2,
                                                              wandb_project="p", wandb_mode="offline"))
    result = run_in_process("train", str(config))
    assert_user_error(result, "config asks for wandb (use_wandb/wandb_project)", "pip install wandb")


def test_tracker_keys_are_switched_as_axolotl_switches_them(tmp_path):
    from tuneloop.config import load_config
    from tuneloop.trackers import wanted_trackers

    def wanted(**keys):
        path = write_config(tmp_path / "c.yml", base_model="x", datasets=[{"path": "d.jsonl", "type": "alpaca"}],
                            **keys)
        return wanted_trackers(load_config(path))

    assert wanted() == []
    assert wanted(wandb_project="p") == ["wandb"]
    assert wanted(wandb_project="p", wandb_mode="disabled") == []
    assert wanted(wandb_project="p", use_wandb=False) == []
    assert wanted(mlflow_experiment_name="e", use_tensorboard=True) == ["tensorboard", "mlflow"]
    assert wanted(use_mlflow=True) == ["mlflow"]


def test_metrics_lines_become_grouped_tracker_names_and_secrets_stay_out_of_parameters(tmp_path):
    from types import SimpleNamespace

    assert numbers_of({"step": 4, "epoch": 0.5, "loss": 1.5, "lr": 1e-3, "mfu": None}) == (
        4, {"train/epoch": 0.5, "train/loss": 1.5, "train/lr": 1e-3})
    assert numbers_of({"step": 4, "epoch": 0.5, "eval_loss": 2.0, "eval_tokens": 10}) == (
        4, {"eval/epoch": 0.5, "eval/loss": 2.0, "eval/tokens": 10})
    config = SimpleNamespace(model_dump=lambda mode: {"learning_rate": 1e-3, "hub_token": "hf_abc",
                                                      "comet_api_key": "k", "lora_r": None})
    plan = SimpleNamespace(to_json=lambda: {"total_steps": 8, "memory": {"weights_gb": 0.1}, "warnings": []})
    assert run_parameters(config, plan) == {"plan/total_steps": 8, "plan/memory/weights_gb": 0.1,
                                            "plan/warnings": "[]", "config/learning_rate": 1e-3}
    assert redacted("http://u:pw@host:5000/api and https://token@h/x") == "http://***@host:5000/api and https://***@h/x"


def test_an_online_wandb_run_without_credentials_is_refused_before_training(tmp_path, tiny_model_dir, monkeypatch):
    for variable in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(12))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=2,
                                                              wandb_project="p"))
    result = run_in_process("train", str(config))
    assert_user_error(result, "wandb: could not start the run", "set WANDB_API_KEY or run `wandb login`",
                      "`wandb_mode: offline`")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
