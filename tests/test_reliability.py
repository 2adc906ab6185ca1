"""Nothing lost, no run mixed with another, every message right: the bad inputs of a new user (issue "40 more bad
inputs"), one test each, each of which failed before its fix.

Every user error: exit 2, one `error:` line naming the key, file:line or path and the fix, no traceback, nothing of
the user's changed; where the input is valid, the right behaviour. In-process through the command line's code,
except where a fresh process, a pipe or a second rank is the point."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import (assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config,
                      write_jsonl)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("reliability") / "train.jsonl", tiny_rows(40, seed=21))


def config_file(tmp_path, model_dir, data_file, name: str = "run.yml", **keys) -> Path:
    return write_config(tmp_path / name, **base_config(tmp_path, model_dir, data_file, **keys))


# ---- data lost or runs mixed ---------------------------------------------------------------------------------

def test_overwrite_keeps_the_users_own_tensorboard_logs_in_runs(tmp_path, tiny_model_dir, data):
    """The Trainer and axolotl leave TensorBoard logs in output_dir/runs/: a run records the event files it adds
    there, not the folder, and --overwrite removes those alone."""
    old = tmp_path / "out" / "runs" / "my-old-experiment"
    old.mkdir(parents=True)
    (old / "events.out.tfevents.1.host").write_bytes(b"theirs")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=1, use_tensorboard=True)
    assert run_in_process("train", str(config)).returncode == 0
    ours = [path for path in (tmp_path / "out" / "runs").iterdir() if path.name != "my-old-experiment"]
    assert ours  # the first run's event file
    result = run_in_process("train", str(config), "--overwrite")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (old / "events.out.tfevents.1.host").read_bytes() == b"theirs"
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert not any(path.exists() for path in ours)  # the first run's were removed, the second's are there
    assert len(list((tmp_path / "out" / "runs").iterdir())) == 2


def test_a_second_run_into_a_held_output_dir_stops_naming_the_run_that_holds_it(tmp_path, tiny_model_dir, data):
    """An OS lock on the folder (released by a crash too): the second run exits 2 naming the holder's pid and
    host, and writes nothing."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tuneloop-lock").write_text(json.dumps({"pid": 4242, "host": "gpu-node-7", "since": "2026-12-01"}))
    descriptor = os.open(out, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the other run's process holds it
    try:
        config = config_file(tmp_path, tiny_model_dir, data, max_steps=1)
        assert_user_error(run_in_process("train", str(config)), f"output_dir {out} is in use by another tuneloop run",
                          "pid 4242 on gpu-node-7", "choose another output_dir")
        assert sorted(path.name for path in out.iterdir()) == [".tuneloop-lock"]
    finally:
        os.close(descriptor)  # the other run ends: the folder is free
    assert run_in_process("train", str(config)).returncode == 0


def test_force_resume_never_loads_a_checkpoint_of_another_model_shape(tmp_path, tiny_model_dir, data, monkeypatch):
    """--force-resume overrides settings, never the model's shape; what it overrode is recorded."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tuneloop.train.guards import SIGNAL_AT_STEP_ENV

    wider = tmp_path / "wider"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)).save_pretrained(wider)
    tokenizer.save_pretrained(wider)
    keys = dict(max_steps=4, save_steps=100, save_strategy=None, auto_resume_from_checkpoints=True)
    first = config_file(tmp_path, tiny_model_dir, data, **keys)
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, "0:2")  # stopped by a signal after step 2: checkpoint-2
    assert run_in_process("train", str(first)).returncode == 75
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    other_model = config_file(tmp_path, wider, data, name="wider.yml", **keys)
    result = run_in_process("train", str(other_model), "--force-resume")
    assert_user_error(result, "the checkpoint holds a model of another shape", "--force-resume or not",
                      "start a fresh output_dir")
    # the same model with another learning rate: refused naming what --force-resume may override, then forced
    refused = run_in_process("train", str(first), "--set", "learning_rate=0.002")
    assert_user_error(refused, "learning_rate (0.001 → 0.002)", "--force-resume to continue",
                      "any setting but the model's shape")
    forced = run_in_process("train", str(first), "--set", "learning_rate=0.002", "--force-resume")
    assert forced.returncode == 0, forced.stderr[-2000:]
    resumes = [json.loads(line) for line in (tmp_path / "out" / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["forced"] and resumes[-1]["overridden"] == ["learning_rate (0.001 → 0.002)"]


def test_a_tilde_in_a_path_key_means_home_everywhere(tmp_path, tiny_model_dir, data, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=1, output_dir="~/runs/x",
                         dataset_prepared_path="~/prepared")
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (home / "runs" / "x" / "model.safetensors").is_file() and (home / "prepared").is_dir()
    assert not (tmp_path / "~").exists()
    assert f"model saved to {home / 'runs' / 'x'}" in result.stdout


@pytest.mark.parametrize("example", ["quickstart.yml", "dpo.yml", "t5_from_scratch.yml"])
def test_the_run_config_a_run_writes_reruns_as_the_same_config(example, monkeypatch):
    """`tuneloop train OUT/run_config.yml` reruns a run: the file holds every key with its value (defaults
    included, which a dataset of another type than chat must not take for keys set by hand). (Every config the
    suite writes is checked the same way: conftest.write_config.)"""
    from tuneloop.config import config_from_dict, load_config

    cfg = load_config(REPO / "examples" / example)
    written = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    assert config_from_dict(written).model_dump(mode="json") == cfg.model_dump(mode="json")


def test_rerunning_an_alpaca_runs_run_config_plans_the_same_run(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2)
    assert run_in_process("train", str(config)).returncode == 0
    rerun = run_in_process("plan", str(tmp_path / "out" / "run_config.yml"), "--json")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(rerun.stdout) == json.loads((tmp_path / "out" / "plan.json").read_text())


# ---- tracebacks ----------------------------------------------------------------------------------------------

def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_naming_special_tokens(tmp_path, tiny_model_dir, data):
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token, tokenizer.eos_token = None, None
    tokenizer.save_pretrained(model)
    assert AutoTokenizer.from_pretrained(model).eos_token is None
    config = config_file(tmp_path, model, data, max_steps=1)
    assert_user_error(run_in_process("plan", str(config)), "has neither a pad token nor an eos token",
                      "special_tokens: {pad_token:")


@pytest.mark.parametrize("text, fragments", [
    (b"# caf\xe9 au lait\nbase_model: m\n", ["run.yml:1: byte 0xe9 is not UTF-8", "save the file as UTF-8"]),
    (b"base_model: m\ndatasets:\n\t- path: x\n", ["run.yml:3: a tab where YAML takes spaces only",
                                                 "replace the tabs with spaces"]),
    (b"base_model: m\nlearning_rate: 1e-4\nbase_model: n\n", ["`base_model` is given twice (lines 1 and 3)",
                                                              "keep one of them"]),
])
def test_a_config_file_yaml_cannot_read_as_written_is_said_with_its_line(tmp_path, text, fragments):
    """A Latin-1 byte in a comment, a tab in the indentation, a key given twice (YAML would keep the later in
    silence)."""
    path = tmp_path / "run.yml"
    path.write_bytes(text)
    assert_user_error(run_in_process("check", str(path)), *fragments)


@pytest.mark.slow  # (a process of its own)
def test_check_into_a_closed_pipe_leaves_quietly(tmp_path):
    """`tuneloop check CONFIG | head -1`: the reader goes away before the report is written."""
    process = subprocess.Popen([sys.executable, "-m", "tuneloop", "check", str(REPO / "examples" / "quickstart.yml")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_ctrl_c_while_preparing_says_so_and_leaves_no_half_cache(tmp_path, tiny_model_dir, data, monkeypatch):
    from tuneloop.data import prepare

    def interrupted(self, job):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare.ChunkTokenizer, "__call__", interrupted)
    config = config_file(tmp_path, tiny_model_dir, data, dataset_processes=1)
    result = run_in_process("preprocess", str(config))
    assert result.returncode == 130 and "Traceback" not in result.stderr
    assert "error: interrupted (Ctrl-C)" in result.stderr and "run it again" in result.stderr
    assert [path.name for path in (tmp_path / "prepared").iterdir()] == [prepare.FILE_DIGESTS]


def test_a_full_disk_while_the_cache_is_written_is_a_message_and_no_half_cache(tmp_path, tiny_model_dir, data,
                                                                                monkeypatch):
    from tuneloop.data import prepare
    from tuneloop.data.token_store import TokenStoreWriter

    def full(self, chunk):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.folder / "input_ids.i32"))

    monkeypatch.setattr(TokenStoreWriter, "write", full)
    config = config_file(tmp_path, tiny_model_dir, data, dataset_processes=1)
    assert_user_error(run_in_process("preprocess", str(config)), "the disk is full while writing the prepared data",
                      f"dataset_prepared_path: {tmp_path / 'prepared'}", "Free space")
    assert [path.name for path in (tmp_path / "prepared").iterdir()] == [prepare.FILE_DIGESTS]


@pytest.mark.parametrize("value", ["-2", "0", "two"])
def test_plan_for_a_world_size_below_one_is_refused(tmp_path, tiny_model_dir, data, value):
    config = config_file(tmp_path, tiny_model_dir, data)
    result = run_in_process("plan", str(config), "--world-size", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --world-size" in result.stderr and ("at least 1 rank" in result.stderr
                                                         or "not a whole number" in result.stderr)


# ---- silently wrong ------------------------------------------------------------------------------------------

def test_a_global_batch_larger_than_the_data_is_said(tmp_path, tiny_model_dir):
    six = write_jsonl(tmp_path / "six.jsonl", tiny_rows(6))
    config = config_file(tmp_path, tiny_model_dir, six, micro_batch_size=64)
    plan = json.loads(run_in_process("plan", str(config), "--json").stdout)
    assert any("the global batch (64 rows) is larger than one epoch of data (6 rows" in w for w in plan["warnings"])


def test_embeddings_grown_for_added_tokens_are_said_and_refused_where_nothing_trains_them(tmp_path, tiny_model_dir,
                                                                                          data):
    config = config_file(tmp_path, tiny_model_dir, data, tokens=["<tool>", "</tool>"])
    plan = json.loads(run_in_process("plan", str(config), "--json").stdout)
    assert any("embeddings grow by 2 rows" in w and "<tool>" in w for w in plan["warnings"])
    frozen = config_file(tmp_path, tiny_model_dir, data, name="lora.yml", tokens=["<tool>"], adapter="lora",
                         lora_target_linear=True)
    assert_user_error(run_in_process("plan", str(frozen)), "the embeddings are frozen", "<tool>",
                      "lora_modules_to_save: [embed_tokens, lm_head]")
    trained = config_file(tmp_path, tiny_model_dir, data, name="saved.yml", tokens=["<tool>"], adapter="lora",
                          lora_target_linear=True, lora_modules_to_save=["embed_tokens", "lm_head"])
    assert run_in_process("plan", str(trained)).returncode == 0


def test_a_misspelt_fsdp_layer_class_is_refused_by_the_plan_too(tmp_path, tiny_model_dir, data):
    keys = {"fsdp": ["full_shard"], "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": "LlamaLayer"}}
    config = config_file(tmp_path, tiny_model_dir, data, **keys)
    assert_user_error(run_in_process("plan", str(config)), "no module of class LlamaLayer", "LlamaDecoderLayer")


def test_trackers_that_train_would_refuse_are_refused_by_the_plan(tmp_path, tiny_model_dir, data, monkeypatch):
    for variable in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no `wandb login`
    online = config_file(tmp_path, tiny_model_dir, data, wandb_project="p")
    assert_user_error(run_in_process("plan", str(online)), "an online run needs credentials",
                      "set WANDB_API_KEY or run `wandb login`")
    taken = tmp_path / "a-file"  # a store's folder cannot go where a file is
    taken.write_text("")
    store = config_file(tmp_path, tiny_model_dir, data, name="mlflow.yml", mlflow_tracking_uri=f"file:{taken}/store")
    assert_user_error(run_in_process("plan", str(store)), f"{taken} cannot be written", "names a local store")


# ---- unclear messages ----------------------------------------------------------------------------------------

def test_the_cache_never_goes_into_a_dataset_folder(tmp_path, tiny_model_dir):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "rows.jsonl", tiny_rows(20))
    before = sorted(path.name for path in folder.iterdir())
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, folder,
                                                              dataset_prepared_path=str(folder)))
    assert_user_error(run_in_process("preprocess", str(config)), f"`dataset_prepared_path: {folder}` is the folder",
                      "datasets[0].path", "a folder of its own")
    assert sorted(path.name for path in folder.iterdir()) == before


def test_an_unreachable_mlflow_server_is_told_to_be_reached_and_a_local_store_to_be_written():
    from tuneloop.trackers import _mlflow_hint

    assert "server must be reachable" in _mlflow_hint("http://host:5000")
    assert "check that its folder can be written" in _mlflow_hint("file:/data/mlruns")


# ---- from the field's bug trackers ---------------------------------------------------------------------------

def test_rows_that_never_train_an_end_token_are_said_in_the_plan(tmp_path, tiny_model_dir):
    rows = [{"messages": [{"role": "user", "content": "Hello there"},
                          {"role": "assistant", "content": "I am fine, thank you."}]}] * 8
    chat = write_jsonl(tmp_path / "chat.jsonl", rows)
    keys = dict(datasets=[{"path": str(chat), "type": "chat_template", "train_on_eos": "none"}], chat_template="chatml")
    plan = json.loads(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, chat, **keys)), "--json").stdout)
    assert any("8 of 8 training rows train no end-of-sequence or end-of-turn token" in w and "<|im_end|>" in w
               for w in plan["warnings"]), plan["warnings"]
    keys["datasets"][0]["train_on_eos"] = "turn"
    plan = json.loads(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, chat, name="turn.yml",
                                                             **keys)), "--json").stdout)
    assert not any("end-of-turn token" in w for w in plan["warnings"])


# ---- silently wrong, continued -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_in_bf16_saves_its_fp32_masters_as_ddp_saves_fp32(tmp_path, tiny_model_dir, data, stage):
    """DeepSpeed holds the model in bf16 (its fp32 masters in the optimizer): the final folder has the masters, in
    fp32, with a config that says so; the plan says the dtype, the same for every engine. (One process, as a first
    run before renting more ranks: ZeRO-3 then needs the LOCAL_RANK a launcher would set.)"""
    import torch
    from safetensors.torch import load_file

    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2, bf16=True, deepspeed=stage)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "saved                the model's weights in fp32" in result.stdout
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert {value.dtype for value in weights.values()} == {torch.float32}
    trained = weights["model.layers.0.mlp.down_proj.weight"]
    assert (trained != trained.to(torch.bfloat16).float()).any()  # not bf16 values cast up: the masters
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    # ZeRO-3 had replaced torch's functional linear for good; the run put it back for what runs next in the process
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_a_bf16_run_follows_an_accelerator_made_without_precision_in_the_same_process(tmp_path, tiny_model_dir,
                                                                                        data):
    """A notebook that ran the HF Trainer (or its own Accelerator) holds accelerate's process-wide state with
    another precision; accelerate refuses a second Accelerator that differs, so the run forgets that state."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)  # mixed_precision "no", as the Trainer's fp32 default
    try:
        config = config_file(tmp_path, tiny_model_dir, data, max_steps=1, bf16=True)
        result = run_in_process("train", str(config))
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_signal_after_the_last_step_says_the_final_model_is_being_saved_and_a_second_one_says_it_was_not(
        tmp_path):
    script = tmp_path / "signals.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from tuneloop.train.guards import StopRequests\n"
        "temp = Path(sys.argv[1]) / '.tmp-final'\n"
        "temp.mkdir(parents=True)\n"
        "with StopRequests() as stop:\n"
        "    stop.finishing(temp)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n")
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 128 + 2, result.stderr[-2000:]
    assert "its final model is being saved" in result.stdout and "saving a checkpoint" not in result.stdout
    assert "the final model was NOT written" in result.stdout
    assert not (tmp_path / "out" / ".tmp-final").exists()  # nothing torn left to block the next run


def test_a_signal_during_the_last_step_is_told_that_the_final_model_is_saved_instead(capsys):
    import signal

    from tuneloop.train.guards import StopRequests

    with StopRequests() as stop:
        stop._handle(signal.SIGINT, None)  # during the last step: "saving a checkpoint at the end of this step"
        stop.finishing(Path("unused"))
    assert "it saves its final model rather than a checkpoint" in capsys.readouterr().out


def test_a_stream_entry_that_cannot_be_read_is_refused_by_the_plan(tmp_path, tiny_model_dir, data):
    keys = {"datasets": None, "pretraining_dataset": [{"path": str(data), "split": "validation"}],
            "max_steps": 2, "sequence_len": 32}
    assert_user_error(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, data, **keys))),
                      "`split: validation`", "local files hold one split")


def test_check_says_what_it_did_not_check(tmp_path, tiny_model_dir, data):
    result = run_in_process("check", str(config_file(tmp_path, tiny_model_dir, data)))
    assert result.returncode == 0 and "not checked here" in result.stdout and "`tuneloop plan CONFIG`" in result.stdout


# ---- unclear messages, continued -----------------------------------------------------------------------------

@pytest.mark.parametrize("epochs, steps", [(0.5, 3), (0.3, 2), (1.5, 8)])
def test_a_fraction_of_an_epoch_runs_that_share_of_its_steps_rounded_up(tmp_path, tiny_model_dir, data, epochs,
                                                                         steps):
    """40 rows, 4 a step: 10 steps an epoch (as the Trainer: the steps of a fraction round up, on the decimal
    written: 0.3 × ... is not a float's 3.0000000000000004)."""
    rows = write_jsonl(tmp_path / "twenty.jsonl", tiny_rows(20, seed=3))  # 5 steps an epoch
    config = config_file(tmp_path, tiny_model_dir, rows, num_epochs=epochs, save_strategy="no")
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["steps_per_epoch"] == 5 and plan["total_steps"] == steps
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == list(range(1, steps + 1))
    if epochs % 1:
        assert "its steps rounded up" in result.stdout


def test_a_base_folder_without_tokenizer_files_is_said_as_that(tmp_path, tiny_model_dir, data):
    import shutil

    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, bare / name)
    assert_user_error(run_in_process("plan", str(config_file(tmp_path, bare, data))), "holds no tokenizer",
                      "point `tokenizer_config` at the folder")


def test_infer_takes_a_checkpoint_folder_as_it_is(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=3, save_steps=2, save_strategy=None)
    assert run_in_process("train", str(config)).returncode == 0
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "tokenizer.json").is_file()  # a checkpoint is a model folder, tokenizer included
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n")
    result = run_in_process("infer", "--model", str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[0])["prompt"] == "Hello there"


def test_a_stream_says_the_rows_it_trained_apart_from_those_it_read_ahead(tmp_path, tiny_model_dir):
    texts = write_jsonl(tmp_path / "corpus.jsonl", [{"text": row["output"]} for row in tiny_rows(600, seed=2)])
    keys = {"datasets": None, "pretraining_dataset": [{"path": str(texts)}], "max_steps": 2, "sequence_len": 32,
            "micro_batch_size": 2}
    result = run_in_process("train", str(config_file(tmp_path, tiny_model_dir, texts, **keys)))
    assert result.returncode == 0, result.stderr[-2000:]
    stream = json.loads((tmp_path / "out" / "summary.json").read_text())["stream"]
    assert stream["rows_trained"] == 2 * 2 < stream["rows_read"]  # 2 steps of 2 full rows; a chunk read ahead
    assert f"{stream['rows_trained']} rows trained, {stream['rows_read']} source rows tokenized" in result.stdout


# ---- from the field's bug trackers, continued ----------------------------------------------------------------

@pytest.mark.slow
def test_ranks_wait_for_a_slow_preparation_on_rank_0_without_timing_out(tmp_path, tiny_model_dir, data):
    """ddp_timeout is honoured (no longer warned about as ignored), and the ranks that wait while rank 0
    prepares wait without a timed collective: rank 0 takes twice the timeout, and the run goes on (axolotl #2684)."""
    from conftest import run_two_ranks

    from tuneloop.run import SLOW_PREPARE_ENV

    # (a 4 s timeout failed once in the full suite: on 2 loaded cores an ordinary collective of the run itself can
    # take that long)
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2, ddp_timeout=10)
    result = run_two_ranks("train", str(config), env={SLOW_PREPARE_ENV: "21"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ddp_timeout" not in result.stderr  # read, not warned about as ignored


def test_a_disk_too_small_for_the_model_and_a_checkpoint_is_refused_before_step_1(tmp_path, tiny_model_dir, data,
                                                                                   monkeypatch):
    import shutil
    from collections import namedtuple

    config = config_file(tmp_path, tiny_model_dir, data, max_steps=4, save_steps=2, save_strategy=None)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    assert_user_error(run_in_process("train", str(config)), "GB free, and the run writes about",
                      "a checkpoint", "--ignore-disk-check")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert run_in_process("train", str(config), "--ignore-disk-check").returncode == 0


def test_a_quota_the_free_space_does_not_show_is_met_by_the_probe(tmp_path, tiny_model_dir, data, monkeypatch):
    def quota(descriptor, offset, length):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "posix_fallocate", quota)
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=4, save_steps=2, save_strategy=None)
    assert_user_error(run_in_process("train", str(config)), "cannot hold a checkpoint", "Disk quota exceeded")
    assert not list((tmp_path / "out").glob(".tmp-disk-probe"))


def test_a_metrics_line_a_full_disk_kept_out_is_written_later_never_lost_or_doubled(tmp_path, tiny_model_dir, data,
                                                                                    monkeypatch):
    import builtins

    from tuneloop.train import track

    calls = {"n": 0}

    def flaky_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            calls["n"] += 1
            if calls["n"] in (2, 3):  # the second and third lines meet a full disk
                raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(track, "open", flaky_open, raising=False)
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=5)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "could not write" in result.stderr and "metrics.jsonl" in result.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("argument, value", [("--max-new-tokens", "-1"), ("--batch-size", "0"),
                                             ("--temperature", "-0.5"), ("--top-p", "1.5")])
def test_infer_refuses_values_out_of_range_as_it_reads_them(tmp_path, argument, value):
    result = run_in_process("infer", "--model", str(tmp_path), argument, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr and f"argument {argument}" in result.stderr


# ---- found by a second reader: the same classes, other cases -------------------------------------------------

def test_yaml_merge_keys_are_read_and_an_unhashable_key_is_said(tmp_path):
    merged = tmp_path / "merged.yml"
    merged.write_text("base_model: m\ndatasets:\n  - &e {path: x, type: alpaca}\n  - {<<: *e, split: train}\n")
    assert run_in_process("check", str(merged)).returncode == 0  # `<<: *anchor` is no key given twice
    odd = tmp_path / "odd.yml"
    odd.write_text("base_model: m\n[a, b]: 1\n")
    assert_user_error(run_in_process("check", str(odd)), "line 2: a key must be a name")
    number = tmp_path / "number.yml"
    number.write_text("base_model: m\n1: 2\ndatasets: [{path: x, 3: 4}]\n")
    assert_user_error(run_in_process("check", str(number)), "unknown key `1`", "unknown key datasets[0].`3`")


@pytest.mark.parametrize("setting, fragment", [("num_epochs=.inf", "`num_epochs` must be more than 0"),
                                               ("num_epochs=.nan", "`num_epochs` must be more than 0"),
                                               ("seed=-1", "`seed` must be a whole number from 0 to 4294967295")])
def test_numbers_the_config_cannot_run_with_are_refused_by_check(tmp_path, tiny_model_dir, data, setting,
                                                                 fragment):
    assert_user_error(run_in_process("check", str(config_file(tmp_path, tiny_model_dir, data)), "--set", setting),
                      fragment)


def test_a_damaged_checkpoint_marker_is_a_message(tmp_path, tiny_model_dir, data):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "tuneloop_state.json").write_text('{"step": 1}')
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=1, resume_from_checkpoint=str(folder))
    assert_user_error(run_in_process("train", str(config)), "tuneloop_state.json is damaged",
                      "point resume_from_checkpoint at another checkpoint")


@pytest.mark.slow  # (a process of its own)
def test_training_goes_on_when_the_reader_of_its_output_goes_away(tmp_path, tiny_model_dir, data):
    """`tuneloop train CONFIG | head -1`: the log goes nowhere, the run finishes and saves its model."""
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2)
    process = subprocess.Popen([sys.executable, "-m", "tuneloop", "train", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == 0, stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and "Traceback" not in stderr
