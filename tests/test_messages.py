"""Every message true (issue "every message true"): each names what is really the matter, one test each, each of
which failed before its fix. User errors: exit 2, one `error:` line naming the key or path and the fix, no
traceback. In-process (`check`, `plan`) or pure functions."""

from __future__ import annotations

import json

import pytest
from conftest import assert_user_error, base_config, run_in_process, tiny_rows, write_config, write_jsonl


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("messages") / "train.jsonl", tiny_rows(24, seed=53))


def config_file(tmp_path, model_dir, data_file, name: str = "run.yml", **keys):
    return write_config(tmp_path / name, **base_config(tmp_path, model_dir, data_file, **keys))


@pytest.mark.parametrize("key, value, fix", [
    ("model_type", "AutoModelForImageTextToText", "remove model_type, or set `model_type: AutoModelForCausalLM`"),
    ("processor_type", "AutoProcessor", "remove it")])
def test_a_text_model_under_a_vision_key_is_called_a_text_model(tmp_path, tiny_model_dir, data, key, value, fix):
    """A text-only LLaMA is no vision-language family: the key that asks for images is what is wrong."""
    config = config_file(tmp_path, tiny_model_dir, data, **{key: value})
    result = run_in_process("check", str(config))
    assert_user_error(result, f"`{key}: {value}` asks for a vision-language model",
                      f"is a text model (llama, by {tiny_model_dir / 'config.json'}", fix)
    assert "vision-language model (by" not in result.stderr


def test_a_stream_is_refused_for_its_own_reason_and_supervised_chat_rows_stream(tmp_path, tiny_model_dir):
    """A vision-language config with `streaming` was refused as "preference data (`rl:`)"; `type: chat_template`
    (a preference type too, under `rl:`) is supervised without it, and streams."""
    stream = {"streaming": True, "max_steps": 2}
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "hello"}]}] * 8)
    chat_rows = [{"path": str(chats), "type": "chat_template"}]
    vision = config_file(tmp_path, "Qwen/Qwen2.5-VL-7B-Instruct", chats, "vision.yml", processor_type="AutoProcessor",
                         datasets=chat_rows, **stream)
    result = run_in_process("check", str(vision))
    assert_user_error(result, "`streaming` reads the training rows as a stream", "`processor_type: AutoProcessor` "
                      "trains a vision-language model, whose rows are prepared whole", "remove `streaming`")
    assert "rl:" not in result.stderr
    supervised = config_file(tmp_path, tiny_model_dir, chats, "chats.yml", chat_template="chatml", datasets=chat_rows,
                             **stream)
    result = run_in_process("check", str(supervised))
    assert result.returncode == 0, result.stderr


def test_a_config_path_that_is_a_folder_is_said_to_be_one_and_its_one_yaml_file_named(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    assert_user_error(run_in_process("check", str(folder)), f"config: {folder} is a folder, not a config file",
                      "holds none")
    (folder / "run.yml").write_text("base_model: x\n")
    assert_user_error(run_in_process("check", str(folder)), f"give the file, {folder / 'run.yml'}")
    (folder / "other.yaml").write_text("base_model: y\n")
    assert_user_error(run_in_process("check", str(folder)), "one of its 2 YAML files (other.yaml, run.yml)")


def test_a_byte_order_mark_in_a_deepspeed_file_or_a_data_file_is_read_as_nothing(tmp_path, tiny_model_dir, data):
    """Windows editors start UTF-8 files with a byte-order mark; YAML reads it as nothing, and so does the rest:
    the DeepSpeed JSON, a JSON-lines file and a JSON array file (it was Python's "decode using utf-8-sig")."""
    import codecs

    from tuneloop.config import config_from_dict
    from tuneloop.data.load import read_rows

    (tmp_path / "ds.json").write_bytes(codecs.BOM_UTF8 + b'{"zero_optimization": {"stage": 2}}')
    config = config_file(tmp_path, tiny_model_dir, data, deepspeed="ds.json")
    result = run_in_process("check", str(config))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    lines, array = tmp_path / "bom.jsonl", tmp_path / "bom.json"
    lines.write_bytes(codecs.BOM_UTF8 + data.read_bytes())
    array.write_bytes(codecs.BOM_UTF8 + json.dumps(rows).encode())
    for path in (lines, array):
        entry = config_from_dict(base_config(tmp_path, tiny_model_dir, path)).datasets[0]
        assert [row.values for row in read_rows(entry)] == rows


def test_a_lora_adapter_as_base_model_is_said_to_be_one_naming_its_base(tmp_path, tiny_model_dir, data):
    adapter = tmp_path / "adapter"
    adapter.mkdir()  # what peft's save_pretrained writes beside the weights
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                             "base_model_name_or_path": str(tiny_model_dir)}))
    config = config_file(tmp_path, adapter, data)
    assert_user_error(run_in_process("check", str(config)), f"`base_model: {adapter}` is a LoRA adapter",
                      f"set `base_model: {tiny_model_dir}`", "base_model_name_or_path",
                      f"`lora_model_dir: {adapter}` with `adapter: lora`")


@pytest.mark.parametrize("setting, fragment", [
    ("datasets.0.type.name=x", "`datasets.0.type` is a string ('alpaca'), which has no `name`: set `datasets.0.type` "
                               "itself"),
    ("datasets.2.type=x", "`datasets` is a list of 1 entry, and `2` is not an index of it (0 to 0)")])
def test_a_set_into_a_value_that_is_not_a_mapping_names_that_value(tmp_path, tiny_model_dir, data, setting, fragment):
    config = config_file(tmp_path, tiny_model_dir, data)
    result = run_in_process("check", str(config), "--set", setting)
    assert_user_error(result, f"--set {setting!r}", fragment)


def test_a_set_into_a_blank_key_sets_it():
    """`trl:` with nothing after it is not set (axolotl's meaning): `--set trl.beta=0.1` makes the mapping."""
    from tuneloop.config.load import apply_overrides

    assert apply_overrides({"trl": None}, ["trl.beta=0.1"]) == {"trl": {"beta": 0.1}}


def plan_lines(config, *extra) -> dict[str, str]:
    """`tuneloop plan`'s lines by their label (model, adapter, objective, ...)."""
    result = run_in_process("plan", str(config), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return {line[:23].strip(): line[23:] for line in result.stdout.splitlines() if line.startswith("  ")}


@pytest.mark.parametrize("keys, model_words, adapter_words", [
    ({"adapter": "qlora", "peft_use_dora": True, "peft_use_rslora": True, "loraplus_lr_ratio": 16},
     ["loaded in 4-bit by bitsandbytes (NF4, double-quantized, computed in float32: QLoRA)"],  # bf16: false
     [f"scale alpha/√r = {8 / 4 ** 0.5:.3g} (rsLoRA)", "DoRA: each weight's magnitude trained apart",
      f"LoRA+: the B matrices learn 16× faster (learning rate {1e-3 * 16:g})"]),
    ({"adapter": "lora", "load_in_8bit": True}, ["loaded in 8-bit by bitsandbytes (LLM.int8)"],
     [f"scale alpha/r = {8 / 4:.3g}"])])
def test_the_plan_names_a_quantized_base_and_the_lora_variants(tmp_path, tiny_model_dir, data, keys, model_words,
                                                               adapter_words):
    """QLoRA's 4-bit base, an 8-bit one, DoRA, rsLoRA and LoRA+ change what trains; the plan said none of them."""
    config = config_file(tmp_path, tiny_model_dir, data, lora_r=4, lora_alpha=8, lora_target_linear=True, **keys)
    lines = plan_lines(config)
    assert lines["model"].startswith("Llama, ") and all(words in lines["model"] for words in model_words), lines
    assert lines["adapter"].startswith("LoRA r 4, alpha 8, ") and "on every linear layer" in lines["adapter"]
    assert all(words in lines["adapter"] for words in adapter_words), lines["adapter"]
    for absent in ("DoRA", "rsLoRA", "LoRA+") if "peft_use_dora" not in keys else ():
        assert absent not in lines["adapter"]


def test_a_process_reward_models_plan_describes_its_own_loss(tmp_path, tiny_model_dir):
    """Its objective line said "each row's reply and its mismatched reply for the KL estimate" (KTO's)."""
    rows = [{"prompt": "Count the cats.", "completions": ["one cat", "so seven"], "labels": [True, False]}] * 8
    steps = write_jsonl(tmp_path / "steps.jsonl", rows)
    config = config_file(tmp_path, tiny_model_dir, steps, process_reward_model=True,
                         model_type="AutoModelForTokenClassification",
                         datasets=[{"path": str(steps), "type": "stepwise_supervised", "step_separator": "\n"}])
    objective = plan_lines(config)["objective"]
    assert objective.startswith("token_classification: each reasoning step's end token classified correct or "
                                "incorrect (2 labels)"), objective
    assert "averaged over the labelled step ends" in objective and "KL" not in objective
    assert "reference" in objective and "mismatched" not in objective


def test_check_says_which_files_it_reads(tmp_path, tiny_model_dir, data):
    """It said it "reads no file but the config", and reads a local base model's config.json (its vision family),
    its adapter_config.json and a DeepSpeed file."""
    result = run_in_process("check", str(config_file(tmp_path, tiny_model_dir, data)))
    line = next(line for line in result.stdout.splitlines() if "not checked here" in line)
    assert "reads no file but the config" not in line
    assert all(name in line for name in ("DeepSpeed JSON", "config.json", "adapter_config.json", "never data or weights"))
