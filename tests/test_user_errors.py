"""The bad cases a new user met (issue "No traceback, no silent surprise, nothing lost"), one test each.

Every user error: exit 2, one message naming the key, file:line or path and the fix, no traceback, nothing
touched. In-process through the command line's code, except where a second rank is the point."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (CHATML, assert_every_rank_stopped_with, assert_user_error, base_config, read_metrics,
                      run_in_process, run_two_ranks, tiny_rows, write_config, write_jsonl)
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("user_errors") / "train.jsonl", tiny_rows(40, seed=12))


def config_file(tmp_path, model_dir, data_file, **keys) -> Path:
    return write_config(tmp_path / "run.yml", **base_config(tmp_path, model_dir, data_file, **keys))


def copy_of(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    return target


def file_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# ---- 1. data loss ---------------------------------------------------------------------------------------

def test_output_dir_equal_to_the_base_model_is_refused_and_nothing_is_deleted(tmp_path, tiny_model_dir, data):
    model = copy_of(tiny_model_dir, tmp_path / "model")
    before = file_bytes(model)
    config = config_file(tmp_path, model, data, output_dir=str(model))
    assert_user_error(run_in_process("train", str(config), "--overwrite"), f"`output_dir: {model}` is `base_model",
                      "apart from the run's inputs")
    assert file_bytes(model) == before


@pytest.mark.parametrize("where", ["inside the data folder", "holding the data file", "the prepared data"])
def test_output_dir_overlapping_the_data_or_the_prepared_cache_is_refused(tmp_path, tiny_model_dir, where):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data_file = write_jsonl(data_dir / "train.jsonl", tiny_rows(20))
    # a dataset given as a folder reads every .jsonl in it: a run writing its metrics.jsonl there would feed them
    # to the next run
    keys = {"inside the data folder": dict(output_dir=str(data_dir / "out"),
                                           datasets=[{"path": str(data_dir), "type": "alpaca"}]),
            "holding the data file": dict(output_dir=str(tmp_path),
                                          dataset_prepared_path=str(tmp_path.parent / f"{tmp_path.name}-prepared")),
            "the prepared data": dict(output_dir=str(tmp_path / "prep"), dataset_prepared_path=str(tmp_path / "prep"))}
    result = run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data_file, **keys[where])), "--overwrite")
    named = {"inside the data folder": "sits inside `datasets[0].path", "holding the data file": "holds `datasets[0].path",
             "the prepared data": "is `dataset_prepared_path"}[where]
    assert_user_error(result, "apart from the run's inputs", named)
    assert data_file.read_text() and sorted(p.name for p in data_dir.iterdir()) == ["train.jsonl"]


def test_overwrite_never_deletes_model_files_tuneloop_did_not_write(tmp_path, tiny_model_dir, data):
    someone_elses = copy_of(tiny_model_dir, tmp_path / "their-model")
    before = file_bytes(someone_elses)
    config = config_file(tmp_path, tiny_model_dir, data, output_dir=str(someone_elses), max_steps=1)
    assert_user_error(run_in_process("train", str(config), "--overwrite"), "files tuneloop did not write",
                      "config.json", "model.safetensors", "even with --overwrite")
    assert file_bytes(someone_elses) == before


# ---- 2. sequence_len beyond the model's positions -----------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_128_positions(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    target = tmp_path_factory.mktemp("gpt2")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def test_sequence_len_beyond_a_learned_position_table_is_refused(tmp_path, gpt2_128_positions, data):
    config = config_file(tmp_path, gpt2_128_positions, data, sequence_len=512)
    for command in ("plan", "train"):
        assert_user_error(run_in_process(command, str(config)), "`sequence_len: 512` is longer than the 128 positions",
                          "set sequence_len to 128 or less")
    assert not (tmp_path / "out" / "plan.json").exists()


def test_sequence_len_beyond_rotary_max_positions_is_a_warning(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, sequence_len=2048)  # the tiny LLaMA says 1024
    result = run_in_process("plan", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning: sequence_len=2048 is above the model's max_position_embeddings=1024" in result.stdout


# ---- 3-5. files ------------------------------------------------------------------------------------------

def test_a_latin1_byte_names_the_file_and_line(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n')
    assert_user_error(run_in_process("preprocess", str(config_file(tmp_path, tiny_model_dir, data))),
                      f"{data}:2: not valid UTF-8 (byte 0xe9 at column 21)")


def test_output_dir_that_is_a_file(tmp_path, tiny_model_dir, data):
    (tmp_path / "out").write_text("a file")
    assert_user_error(run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data))),
                      "`output_dir:", "is a file")


@contextlib.contextmanager
def unwritable_folder(tmp_path):
    """A folder nobody can write in, even root: immutable (chattr +i); /sys where chattr does not work here."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        yield Path("/sys/tuneloop-test")
        return
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=False)


@pytest.mark.parametrize("key", ["output_dir", "dataset_prepared_path"])
def test_a_folder_that_cannot_be_written(tmp_path, tiny_model_dir, data, key):
    with unwritable_folder(tmp_path) as locked:
        config = config_file(tmp_path, tiny_model_dir, data, **{key: str(locked / "sub")})
        message = "cannot write in `output_dir:" if key == "output_dir" else "cannot write the prepared data"
        assert_user_error(run_in_process("train", str(config)), message, "choose a folder you can write to")


# ---- 6. damaged checkpoints ------------------------------------------------------------------------------

def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damaged_file", ["model.safetensors", "training_state.pt"])
def test_auto_resume_skips_a_damaged_newest_checkpoint_and_still_ends_identical(tmp_path, tiny_model_dir, data,
                                                                                 damaged_file):
    """Decision: with auto-resume, fall back to the newest sound checkpoint (a requeued job keeps going; the
    steps after it are trained again, exactly) and say so; a damaged checkpoint named explicitly is refused."""
    keys = dict(max_steps=6, save_strategy=None, save_steps=2, auto_resume_from_checkpoints=True, micro_batch_size=2)
    config = config_file(tmp_path, tiny_model_dir, data, **keys)
    assert run_in_process("train", str(config)).returncode == 0
    out = tmp_path / "out"
    straight = load_file(out / "model.safetensors")
    for name in ("summary.json", "model.safetensors"):  # as if killed after the checkpoint of step 4
        (out / name).unlink()
    truncate(out / "checkpoint-4" / damaged_file)
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"checkpoint-4 is damaged ({damaged_file}" in resumed.stderr and "resuming from" in resumed.stdout
    assert "checkpoint-2 (step 2)" in resumed.stdout
    again = load_file(out / "model.safetensors")
    assert all(torch.equal(straight[key], again[key]) for key in straight)


def test_a_damaged_checkpoint_named_in_resume_from_checkpoint_is_refused(tmp_path, tiny_model_dir, data):
    keys = dict(max_steps=4, save_strategy=None, save_steps=1, save_total_limit=3, micro_batch_size=2)
    config = config_file(tmp_path, tiny_model_dir, data, **keys)
    assert run_in_process("train", str(config)).returncode == 0
    truncate(tmp_path / "out" / "checkpoint-3" / "model.safetensors")
    result = run_in_process("train", str(config), "--set", f"resume_from_checkpoint={tmp_path / 'out' / 'checkpoint-3'}",
                            "--set", "output_dir=" + str(tmp_path / "out2"))
    assert_user_error(result, "checkpoint-3 is damaged: model.safetensors is damaged", "the one before it is checkpoint-2")
    # the run's folder itself, a common slip: its newest sound checkpoint is named (checkpoint-3 is the damaged one)
    result = run_in_process("train", str(config), "--set", f"resume_from_checkpoint={tmp_path / 'out'}",
                            "--set", "output_dir=" + str(tmp_path / "out2"))
    assert_user_error(result, f"{tmp_path / 'out'} is a run's output_dir, not a checkpoint",
                      f"its newest sound checkpoint is {tmp_path / 'out' / 'checkpoint-2'}")


# ---- 7. trust_remote_code ------------------------------------------------------------------------------------

CUSTOM_CONFIG = '''from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny-custom"
'''
CUSTOM_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
'''


def test_a_custom_code_model_plans_and_trains_with_trust_remote_code(tmp_path, tiny_model_dir, data):
    model = copy_of(tiny_model_dir, tmp_path / "custom")
    (model / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (model / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    settings = json.loads((model / "config.json").read_text())
    settings.update(model_type="tiny-custom", architectures=["TinyCustomForCausalLM"],
                    auto_map={"AutoConfig": "configuration_tiny.TinyCustomConfig",
                              "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"})
    (model / "config.json").write_text(json.dumps(settings))
    config = config_file(tmp_path, model, data, trust_remote_code=True, max_steps=1)
    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "parameters trained" in planned.stdout
    trained = run_in_process("train", str(config))
    assert trained.returncode == 0, trained.stderr[-2000:]


# ---- 8. LoRA target that matches nothing ---------------------------------------------------------------------

def test_lora_target_modules_that_match_nothing_name_the_layers_that_exist(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, adapter="lora", lora_target_modules=["qq_proj"])
    assert_user_error(run_in_process("train", str(config)), "`lora_target_modules: ['qq_proj']` matches no module",
                      "q_proj", "v_proj", "lora_target_linear")


def test_lora_target_parameters_that_match_nothing_name_that_key(tmp_path, tiny_model_dir, data):
    """axolotl's MiniMax config adapts expert parameters alone: on a model without them the message names
    `lora_target_parameters` (it named `lora_target_modules: None`, which the config never set)."""
    config = config_file(tmp_path, tiny_model_dir, data, adapter="lora",
                         lora_target_parameters=["mlp.experts.gate_up_proj"])
    assert_user_error(run_in_process("plan", str(config)),
                      "`lora_target_parameters: ['mlp.experts.gate_up_proj']` names no parameter of this "
                      "LlamaForCausalLM", "q_proj", "`lora_target_modules` takes")


def _unknown_normalizer(tokenizer: dict) -> None:
    tokenizer["normalizer"] = {"type": "NoSuchNormalizer"}


def _vocabulary_of_a_number(tokenizer: dict) -> None:
    tokenizer["model"]["vocab"] = 5


@pytest.mark.parametrize("breaks, tokenizer_type, first_line", [
    (_unknown_normalizer, None, "Exception: data did not match any variant of untagged enum NormalizerUntagged"),
    (lambda tokenizer: tokenizer.pop("added_tokens"), None, "KeyError: 'added_tokens'"),
    # (a Code Llama config names its class; this error runs on over several lines: the first is kept)
    (_vocabulary_of_a_number, "CodeLlamaTokenizer", "TypeError: failed to extract enum PyVocab ('Vocab | Filename')"),
])
def test_a_tokenizer_that_does_not_load_is_one_line_naming_its_source_and_the_error(tmp_path, tiny_model_dir, data,
                                                                                    breaks, tokenizer_type,
                                                                                    first_line):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    breaks(tokenizer)
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    keys = {"tokenizer_type": tokenizer_type} if tokenizer_type else {}
    result = run_in_process("plan", str(config_file(tmp_path, model, data, **keys)))
    assert_user_error(result, f"model: cannot load a tokenizer from `base_model: {model}`", first_line)
    message = result.stderr[result.stderr.index("error: "):].rstrip("\n")
    assert "\n" not in message, message


@pytest.mark.parametrize("breaks, first_line", [
    (_unknown_normalizer, "Exception: data did not match any variant of untagged enum NormalizerUntagged"),
    (lambda tokenizer: tokenizer.pop("added_tokens"), "KeyError: 'added_tokens'"),
])
def test_a_saved_tokenizer_that_does_not_load_is_one_line_for_the_model_commands(tmp_path, tiny_model_dir, breaks,
                                                                                  first_line):
    """merge/export/quantize/infer load a model folder's tokenizer (use/folders.py): a damaged one is said, naming
    the folder, not a traceback and not passed over for another folder's."""
    from tuneloop.errors import UserError
    from tuneloop.use.folders import find_model_folder, load_tokenizer_of

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    breaks(tokenizer)
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(UserError) as raised:
        load_tokenizer_of(find_model_folder(model, "--model"))
    message = str(raised.value)
    assert f"cannot load the tokenizer saved in {model}" in message and first_line in message and "\n" not in message


# ---- 9. a user error on rank 0 under torchrun ----------------------------------------------------------------

@pytest.mark.slow
def test_a_user_error_on_the_main_rank_stops_every_rank_with_one_line_each(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=1)
    assert run_in_process("train", str(config)).returncode == 0  # output_dir now holds a run
    assert_every_rank_stopped_with(run_two_ranks("train", str(config), timeout=240), "holds another run's files")


# ---- 10. a run far too big for the machine ---------------------------------------------------------------------

def test_a_run_far_above_the_devices_memory_is_refused_unless_told_to_start(tmp_path, tiny_tokenizer_dir, data):
    from transformers import AutoTokenizer, LlamaConfig

    big = tmp_path / "big"  # a 7B-shaped config: the estimate reads configs only, no weights are needed
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32).save_pretrained(big)
    tokenizer.save_pretrained(big)
    config = config_file(tmp_path, big, data, micro_batch_size=8)
    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0 and "warning: estimated memory" in planned.stdout
    assert_user_error(run_in_process("train", str(config)), "the run needs about", "--ignore-memory-estimate")
    # the 7B's output (26 GB) may not fit this machine's disk either: that check is another test's (test_bad_input)
    anyway = run_in_process("train", str(config), "--ignore-memory-estimate", "--ignore-disk-check")
    assert_user_error(anyway, "model: cannot load")  # it went on to load the (missing) weights


# ---- 11. misspelled chat roles and rows without a trained token ---------------------------------------------------

def chat_config(tmp_path, model_dir, rows, **keys) -> Path:
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    return config_file(tmp_path, model_dir, data, datasets=[{"path": str(data), "type": "chat_template"}], **keys)


def test_a_misspelled_role_names_the_row_and_the_roles_seen(tmp_path, tiny_model_dir):
    rows = [{"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}]}] * 3
    rows.append({"messages": [{"role": "user", "content": "Hello"}, {"role": "asistant", "content": "Hi"}]})
    assert_user_error(run_in_process("plan", str(chat_config(tmp_path, tiny_model_dir, rows))),
                      "chat.jsonl:4: role 'asistant' is not a chat role", "roles in this row: user, asistant")


def test_rows_without_a_trained_token_are_counted_in_the_plan(tmp_path, tiny_model_dir):
    rows = [{"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}]}] * 8
    rows += [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}] * 2
    result = run_in_process("plan", str(chat_config(tmp_path, tiny_model_dir, rows, micro_batch_size=2)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dropped rows         2 with no trained token" in result.stdout
    assert "2 of 10 rows have no trained token" in result.stdout


# ---- 12-13. resuming with other settings --------------------------------------------------------------------------

def test_a_finished_run_with_other_settings_is_refused_not_skipped(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2, auto_resume_from_checkpoints=True)
    assert run_in_process("train", str(config)).returncode == 0
    same = run_in_process("train", str(config))
    assert same.returncode == 0 and "holds a finished run (summary.json); nothing to resume" in same.stdout
    assert_user_error(run_in_process("train", str(config), "--set", "learning_rate=0.0005"),
                      "holds a finished run with other settings: learning_rate (0.001 → 0.0005)", "--overwrite")


def test_resuming_with_another_learning_rate_is_refused_and_a_longer_run_is_allowed(tmp_path, tiny_model_dir, data):
    keys = dict(max_steps=4, save_strategy=None, save_steps=2, auto_resume_from_checkpoints=True, micro_batch_size=2)
    config = config_file(tmp_path, tiny_model_dir, data, **keys)
    assert run_in_process("train", str(config)).returncode == 0
    (tmp_path / "out" / "summary.json").unlink()  # as if killed after the checkpoint of step 2
    assert_user_error(run_in_process("train", str(config), "--set", "learning_rate=0.0005"),
                      "learning_rate (0.001 → 0.0005)", "--force-resume")
    longer = run_in_process("train", str(config), "--set", "max_steps=6")
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "the run is now 6 steps long (it was 4): from step 2 on" in longer.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == list(range(1, 7))
    assert_user_error(run_in_process("train", str(config), "--set", "max_steps=2", "--set",
                                     f"resume_from_checkpoint={tmp_path / 'out' / 'checkpoint-2'}",
                                     "--set", f"output_dir={tmp_path / 'other'}"),
                      "the run's length (4 → 2 steps, but the checkpoint is at step 2)")


# ---- 14-15, 17. values -----------------------------------------------------------------------------------------------

def test_val_set_size_larger_than_the_data_or_leaving_less_than_a_batch(tmp_path, tiny_model_dir, data):
    assert_user_error(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, data, val_set_size=500))),
                      "`val_set_size: 500` asks for 500 eval rows, but the data has 40")
    assert_user_error(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, data, val_set_size=38))),
                      "`val_set_size: 38` leaves 2 train rows, fewer than one global batch (4 rows)")


@pytest.mark.parametrize("key, value, message", [
    ("warmup_steps", -1, "`warmup_steps` must be 0 or more"),
    ("lora_dropout", 1.5, "`lora_dropout` must be in [0, 1)"),
    ("max_grad_norm", -1, "`max_grad_norm` must be 0 (no clipping) or more"),
])
def test_negative_or_out_of_range_values_are_refused(tmp_path, tiny_model_dir, data, key, value, message):
    assert_user_error(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, data, **{key: value}))), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is real on a GPU")
def test_fp16_on_a_machine_without_a_gpu_is_refused(tmp_path, tiny_model_dir, data):
    assert_user_error(run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data, fp16=True))),
                      "`fp16: true` needs a CUDA GPU", "silently train in fp32")


# ---- 16. message content given as parts --------------------------------------------------------------------------------

def test_content_as_text_parts_is_joined_and_other_parts_are_refused(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from tuneloop.config import config_from_dict
    from tuneloop.data.labels import IGNORE_INDEX
    from tuneloop.data.prepare import prepare
    from tuneloop.errors import UserError

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    rows = [{"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [
        {"type": "text", "text": "Fine, thank you."}]}]}]
    data = write_jsonl(tmp_path / "parts.jsonl", rows)
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(data), "type": "chat_template"}],
                            "dataset_prepared_path": str(tmp_path / "prepared")})
    row = prepare(cfg, tokenizer).train[0]
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Fine, thank you."}],
        tokenize=False, chat_template=CHATML)
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "Fine, thank you.<|im_end|>"
    rows[0]["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    write_jsonl(tmp_path / "parts.jsonl", rows)
    with pytest.raises(UserError, match=r"parts\.jsonl:1: message 1 has a content part of type 'image_url'"):
        prepare(cfg, tokenizer)


# ---- 18-19. what the plan and the last line say -------------------------------------------------------------------------

def test_the_plan_shows_the_optimizer_schedule_precision_attention_and_real_lora_counts(tmp_path, tiny_model_dir,
                                                                                       data):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = config_file(tmp_path, tiny_model_dir, data, adapter="lora", lora_r=4, lora_alpha=8,
                         lora_target_modules=["q_proj", "v_proj"], learning_rate=2e-4, warmup_steps=1)
    result = run_in_process("plan", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "optimizer            adamw_torch_fused, learning rate 0.0002, cosine schedule, warm-up 1 step" in \
        result.stdout
    assert "precision            fp32 (bf16: false); attention sdpa" in result.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's own deprecation notice, outside tuneloop
        adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                 LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    real = sum(p.numel() for p in adapter.parameters() if p.requires_grad)
    planned = json.loads(run_in_process("plan", str(config), "--json").stdout)
    assert planned["memory"]["trainable_parameters"] == real and f"{real:,} of" in result.stdout


def test_the_last_line_rounds_eval_losses_and_counts_in_words(tmp_path, tiny_model_dir, data):
    one_step = run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data, max_steps=1,
                                                       val_set_size=0.2)))
    assert one_step.returncode == 0, one_step.stderr[-2000:]
    last = one_step.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 1 step in ") and "; eval loss " in last and "(step 1);" in last
    assert "→" not in last and len(last.split("eval loss ")[1].split(" ")[0]) == 6  # 4 decimals
    (tmp_path / "b").mkdir()
    no_eval = run_in_process("train", str(config_file(tmp_path / "b", tiny_model_dir, data, max_steps=2)))
    assert "None" not in no_eval.stdout and "eval loss" not in no_eval.stdout.splitlines()[-1]
    assert "= 0.2 epochs" in no_eval.stdout or "epoch" in no_eval.stdout


# ---- 20. file modes -------------------------------------------------------------------------------------------------------

def test_the_model_checkpoints_and_cache_are_readable_by_others(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2, save_strategy=None, save_steps=1)
    assert run_in_process("train", str(config)).returncode == 0
    out = tmp_path / "out"
    mask = os.umask(0)
    os.umask(mask)
    for path in [out / "model.safetensors", out / "checkpoint-1" / "model.safetensors",
                 out / "checkpoint-1" / "training_state.pt"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path
    caches = [p for p in (tmp_path / "prepared").iterdir() if p.is_dir()]
    assert caches and all(stat.S_IMODE(p.stat().st_mode) == 0o777 & ~mask for p in caches)


# ---- 21. leftovers of a failed start, --version, warnings ----------------------------------------------------------------

def test_a_run_that_failed_before_its_first_step_does_not_block_the_next(tmp_path, tiny_model_dir, data):
    model = copy_of(tiny_model_dir, tmp_path / "model")
    weights = (model / "model.safetensors").read_bytes()
    truncate(model / "model.safetensors")
    config = config_file(tmp_path, model, data, max_steps=1)
    assert_user_error(run_in_process("train", str(config)), "model: cannot load")
    assert (tmp_path / "out" / "plan.json").is_file()  # it got that far
    (model / "model.safetensors").write_bytes(weights)
    again = run_in_process("train", str(config))
    assert again.returncode == 0, again.stderr[-2000:]


def test_version_and_no_leaked_warnings_on_a_lora_run(tmp_path, tiny_model_dir, data):
    from tuneloop import __version__

    assert run_in_process("--version").stdout.strip() == f"tuneloop {__version__}"
    config = config_file(tmp_path, tiny_model_dir, data, adapter="lora", lora_target_linear=True, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_in_process("train", str(config)).returncode == 0
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


# ---- found by a second reading ------------------------------------------------------------------------------------

def test_resuming_another_folders_checkpoint_into_a_folder_with_someone_elses_model_is_refused(tmp_path,
                                                                                             tiny_model_dir, data):
    keys = dict(max_steps=2, save_strategy=None, save_steps=1, micro_batch_size=2)
    assert run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data, **keys))).returncode == 0
    theirs = copy_of(tiny_model_dir, tmp_path / "theirs")
    before = file_bytes(theirs)
    result = run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data, **keys)), "--set",
                            f"resume_from_checkpoint={tmp_path / 'out' / 'checkpoint-1'}", "--set",
                            f"output_dir={theirs}")
    assert_user_error(result, "files tuneloop did not write")
    assert file_bytes(theirs) == before


def test_overwrite_starts_a_finished_auto_resume_run_over_as_the_refusal_advises(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=2, save_strategy=None, save_steps=1,
                         auto_resume_from_checkpoints=True)
    assert run_in_process("train", str(config)).returncode == 0
    changed = run_in_process("train", str(config), "--set", "learning_rate=0.0005")
    assert_user_error(changed, "pass --overwrite to replace that run")
    again = run_in_process("train", str(config), "--set", "learning_rate=0.0005", "--overwrite")
    assert again.returncode == 0 and "resuming from" not in again.stdout, again.stderr[-2000:]
    assert read_metrics(tmp_path / "out")[0]["lr"] == pytest.approx(0.0005)


def test_auto_resume_with_every_checkpoint_damaged_is_refused_and_deletes_nothing(tmp_path, tiny_model_dir, data):
    config = config_file(tmp_path, tiny_model_dir, data, max_steps=3, save_strategy=None, save_steps=1,
                         auto_resume_from_checkpoints=True)
    assert run_in_process("train", str(config)).returncode == 0
    out = tmp_path / "out"
    (out / "summary.json").unlink()
    for step in (1, 2):
        truncate(out / f"checkpoint-{step}" / "model.safetensors")
    names = sorted(p.name for p in out.iterdir())
    assert_user_error(run_in_process("train", str(config)), "every checkpoint in", "is damaged", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == names


def test_bad_regexes_and_out_of_vocabulary_token_ids_are_messages_not_tracebacks(tmp_path, tiny_model_dir, data):
    for keys, message in ((dict(unfrozen_parameters=["model.(layers"]), "'model.(layers' is not a valid regular"),
                          (dict(adapter="lora", lora_target_modules="q_proj(("), "'q_proj((' is not a valid regular")):
        assert_user_error(run_in_process("plan", str(config_file(tmp_path, tiny_model_dir, data, **keys))), message)
    rows = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 100000, 7]}])
    config = config_file(tmp_path, tiny_model_dir, rows, datasets=[{"path": str(rows)}])
    assert_user_error(run_in_process("plan", str(config)), "tokens.jsonl:2: token id 100000 is outside the "
                      "tokenizer's vocabulary")


def test_a_dataset_read_through_a_builder_name_is_hashed_like_a_local_file(tmp_path, tiny_model_dir):
    """`path: json` with `data_files` (axolotl's way to name a local file): an edit changes the cache."""
    data = write_jsonl(tmp_path / "d.jsonl", tiny_rows(20, seed=1))
    config = config_file(tmp_path, tiny_model_dir, data, datasets=[{"path": "json", "data_files": str(data),
                                                                    "type": "alpaca"}])
    first = run_in_process("preprocess", str(config))
    assert first.returncode == 0, first.stderr[-2000:]
    write_jsonl(data, tiny_rows(30, seed=2))
    second = run_in_process("preprocess", str(config))
    assert "prepared 30 train" in second.stdout and first.stdout.split(" into ")[1] != second.stdout.split(" into ")[1]


def test_one_cycle_with_a_warmup_as_long_as_the_run_still_runs(tmp_path, tiny_model_dir, data):
    result = run_in_process("train", str(config_file(tmp_path, tiny_model_dir, data, lr_scheduler="one_cycle",
                                                     max_steps=1, warmup_steps=3)))
    assert result.returncode == 0, result.stderr[-2000:]
