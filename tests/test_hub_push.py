"""Pushing to the Hugging Face Hub (use/hub.py), without the network: this machine cannot reach the hub, so the
push itself was never tried against it. What is shown: a run that cannot push stops before it trains (no token, the
hub unreachable, a malformed repo id); a push that fails after a finished run leaves its exit code 0, its files intact
and a warning with the `tuneloop push` command; which files each hub_strategy uploads, and where; `tuneloop push`
refusing a folder that is no finished run, or a hub it cannot reach.

The failures are huggingface_hub's own: under HF_HUB_OFFLINE=1 (set for the whole suite by conftest.py) its calls
raise OfflineModeIsEnabled, and with an endpoint nobody listens on (http://127.0.0.1:9) its HTTP client's connection
error. The one thing replaced is `reach_repo` (create_repo and create_branch) in the test of the end-of-run failure,
so that the run gets past the start-up check and the uploads themselves meet the offline error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from conftest import assert_user_error, base_config, run_in_process, tiny_rows, write_config, write_jsonl
from huggingface_hub.utils import filter_repo_objects

from tuneloop.config import config_from_dict
from tuneloop.use import hub

REPO_ID = "tuneloop-tests/tiny-run"


@pytest.fixture
def a_token(monkeypatch):
    """A token that looks like one (never sent anywhere: the hub is unreachable in every test)."""
    monkeypatch.setenv("HF_TOKEN", "hf_tuneloopTestTokenThatIsNotReal")


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """No token anywhere huggingface_hub looks: the environment, and a token file in an empty HF home."""
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "empty-hf-home" / "token"))


def pushed_config(tmp_path: Path, model_dir: Path, repo_id: str = REPO_ID, **keys) -> Path:
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(16))
    return write_config(tmp_path / "run.yml", **base_config(tmp_path, model_dir, data, hub_model_id=repo_id, **keys))


# ---- start-up: no training without a way to push ------------------------------------------------------------------

def test_train_with_the_hub_offline_stops_before_step_1(tmp_path, tiny_model_dir, a_token):
    assert huggingface_hub.constants.is_offline_mode()  # (conftest.py: HF_HUB_OFFLINE=1)
    config = pushed_config(tmp_path, tiny_model_dir, max_steps=2, save_steps=1, save_strategy="steps")
    result = run_in_process("train", str(config))
    assert_user_error(result, "hub_model_id", REPO_ID, "HF_HUB_OFFLINE", "remove hub_model_id")
    assert "step 1" not in result.stdout and not (tmp_path / "out").exists()  # nothing trained, nothing written


@pytest.mark.slow  # (a process of its own)
def test_train_with_an_unreachable_hub_stops_before_step_1(tmp_path, tiny_model_dir):
    """A fresh process, as a user runs it: the hub's endpoint refuses connections (nothing listens on port 9)."""
    config = pushed_config(tmp_path, tiny_model_dir, max_steps=2, save_steps=1, save_strategy="steps")
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9",
               HF_TOKEN="hf_tuneloopTestTokenThatIsNotReal")
    result = subprocess.run([sys.executable, "-m", "tuneloop", "train", str(config)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert_user_error(result, "hub_model_id", REPO_ID, "cannot reach http://127.0.0.1:9", "ConnectError")
    assert not (tmp_path / "out").exists()


def test_train_without_a_token_stops_naming_it(tmp_path, tiny_model_dir, no_token):
    config = pushed_config(tmp_path, tiny_model_dir, max_steps=2)
    result = run_in_process("train", str(config))
    assert_user_error(result, "hub_model_id", "token", "hf auth login", "HF_TOKEN", "remove hub_model_id")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("repo_id", ["my org/my model", "<your-hub-model-id>"])
def test_a_malformed_repo_id_is_refused_by_check_and_train_alike(tmp_path, tiny_model_dir, a_token, repo_id):
    """check used to accept it with a warning, and train refused it: the same rule now gives one verdict (axolotl's
    example placeholder included, which its own train stops at too, when the Trainer makes the repo)."""
    config = pushed_config(tmp_path, tiny_model_dir, repo_id=repo_id, max_steps=2)
    fragments = (f"`hub_model_id` got {repo_id!r}: not a Hub repo id", "write NAME or OWNER/NAME",
                 "remove hub_model_id to train without pushing")
    assert_user_error(run_in_process("check", str(config)), *fragments)
    assert_user_error(run_in_process("train", str(config)), *fragments)
    assert not (tmp_path / "out").exists()


# ---- after the run: a failed push is a warning, never the run's failure -------------------------------------------

def test_a_push_that_fails_after_the_run_keeps_exit_0_the_files_and_says_the_command(
        tmp_path, tiny_model_dir, a_token, monkeypatch):
    monkeypatch.setattr(hub, "reach_repo", lambda api, repo_id, revision: repo_id)  # the start-up check passes
    config = pushed_config(tmp_path, tiny_model_dir, max_steps=5, save_steps=2, save_strategy="steps",
                           hub_strategy="all_checkpoints", hub_revision="tuneloop-run")
    result = run_in_process("train", str(config))
    out = tmp_path / "out"

    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "error:" not in result.stderr
    # the plan said where the run goes
    assert (f"  push                 to the Hugging Face Hub, {REPO_ID}, branch tuneloop-run: the model and each "
            "checkpoint (as checkpoint-STEP/) at each save (2), and the final model at the end (hub_strategy: "
            "all_checkpoints)") in result.stdout
    # each save's pushes were tried in the background and failed with the library's offline error, said as warnings
    for step in (2, 4):
        for where in ("the repo's root", f"checkpoint-{step}/"):
            assert (f"warning: hub: pushing {out / f'checkpoint-{step}'} to {where} of {REPO_ID} failed "
                    "(HF_HUB_OFFLINE is set") in result.stderr, result.stderr[-3000:]
    # the final push failed: a warning with the exact command that pushes the folder later
    command = f"tuneloop push {out} --hub-model-id {REPO_ID} --revision tuneloop-run"
    assert (f"warning: hub: the run finished, but pushing {out} to {REPO_ID} failed: HF_HUB_OFFLINE is set"
            in result.stderr), result.stderr[-3000:]
    assert f"`{command}`" in result.stderr
    # the output folder is whole: the final model, the records, both checkpoints
    for name in ("model.safetensors", "config.json", "tokenizer.json", "summary.json", "metrics.jsonl",
                 "checkpoint-2/model.safetensors", "checkpoint-4/tuneloop_state.json"):
        assert (out / name).is_file(), name

    # the command the warning gives, run now: the hub is still unreachable, so it exits 2 with one line
    monkeypatch.undo()
    monkeypatch.setenv("HF_TOKEN", "hf_tuneloopTestTokenThatIsNotReal")
    pushed = run_in_process(*command.split()[1:])
    assert_user_error(pushed, "push: --hub-model-id", REPO_ID, "HF_HUB_OFFLINE")
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-4").is_dir()


# ---- what each hub_strategy uploads, and where (no network) -------------------------------------------------------

CHECKPOINT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja", "training_state.pt", "rng_state_0.pt",
                    "metrics.jsonl", "tuneloop_state.json"]
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja"]


def sent(upload: hub.Upload, files: list[str]) -> list[str]:
    """The files upload_folder sends, chosen by huggingface_hub's own filter over the folder's files."""
    return sorted(filter_repo_objects(files, allow_patterns=upload.patterns))


@pytest.mark.parametrize("strategy, expected", [
    ("end", []),
    ("every_save", [("", MODEL_FILES)]),
    ("checkpoint", [("", MODEL_FILES), ("last-checkpoint", CHECKPOINT_FILES)]),
    ("all_checkpoints", [("", MODEL_FILES), ("checkpoint-6", CHECKPOINT_FILES)]),
])
def test_each_hub_strategy_pushes_these_folders_at_a_save(strategy, expected):
    checkpoint = Path("out/checkpoint-6")
    uploads = hub.uploads_at_save(strategy, checkpoint)
    assert [(item.folder, item.path_in_repo, sent(item, CHECKPOINT_FILES)) for item in uploads] == \
        [(checkpoint, where, sorted(files)) for where, files in expected]


def test_the_end_of_a_run_pushes_the_model_and_the_records_and_leaves_checkpoints_local():
    files = MODEL_FILES + ["adapter_model.safetensors", "adapter_config.json", "README.md", "plan.json",
                           "run_config.yml", "metrics.jsonl", "summary.json", "report.md", "report.png",
                           "checkpoint-6/model.safetensors", "checkpoint-6/training_state.pt", ".tuneloop-written",
                           ".tuneloop-lock", "runs/events.out", "model-q8_0.gguf", "merged/model.safetensors",
                           "best/model.safetensors"]
    [upload] = hub.uploads_at_end(Path("out"))
    assert (upload.folder, upload.path_in_repo) == (Path("out"), "")
    assert sent(upload, files) == sorted(MODEL_FILES + [
        "adapter_model.safetensors", "adapter_config.json", "README.md", "plan.json", "run_config.yml",
        "metrics.jsonl", "summary.json", "report.md", "report.png"])


# ---- the config, `check` and `tuneloop push` ----------------------------------------------------------------------

def test_the_hub_keys_are_fields_and_check_says_where_the_run_goes_without_the_network(tmp_path, tiny_model_dir):
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                            "hub_model_id": REPO_ID, "hub_strategy": "checkpoint"})
    assert (cfg.hub_model_id, cfg.hub_strategy, cfg.hub_revision) == (REPO_ID, "checkpoint", None)
    checked = run_in_process("check", str(pushed_config(tmp_path, tiny_model_dir)))
    assert checked.returncode == 0
    assert (f"  push                 to the Hugging Face Hub, {REPO_ID}: the model at each save, and the final model "
            "at the end (hub_strategy: every_save); the token and the hub are checked when `train` starts"
            in checked.stdout), checked.stdout


def test_a_hub_strategy_the_trainer_does_not_have_is_refused(tmp_path, tiny_model_dir):
    result = run_in_process("check", str(pushed_config(tmp_path, tiny_model_dir, hub_strategy="hourly")))
    assert_user_error(result, "hub_strategy", "every_save", "all_checkpoints")


def test_hub_strategy_without_hub_model_id_is_warned_about(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(4))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, hub_strategy="end"))
    checked = run_in_process("check", str(config))
    assert checked.returncode == 0
    assert "`hub_strategy` say how the run is pushed to the Hugging Face Hub, and without `hub_model_id`" in \
        checked.stdout
    assert "  push " not in checked.stdout


def test_push_refuses_a_folder_that_is_not_a_finished_run(tmp_path):
    assert_user_error(run_in_process("push", str(tmp_path / "missing"), "--hub-model-id", REPO_ID),
                      "push:", "is not a folder")
    (tmp_path / "plan.json").write_text("{}")  # a run that never finished: no summary, no model
    assert_user_error(run_in_process("push", str(tmp_path), "--hub-model-id", REPO_ID),
                      "push:", "not a finished tuneloop run", "summary.json")
    (tmp_path / "summary.json").write_text("{}")  # a summary without a final model
    assert_user_error(run_in_process("push", str(tmp_path), "--hub-model-id", REPO_ID),
                      "push:", "holds no final model")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plan.json", "summary.json"]  # nothing removed
