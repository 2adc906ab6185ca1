"""Each axolotl key tuneloop implements changes what it should: named chat templates render their family's text
and train exactly the assistant turns, dataset mappings and role options do what they say, split slices,
quantized loading and hardware-bound options are planned (and refused at train time without the hardware),
model/tokenizer classes, config overrides, new tokens, partial unfreezing, bf16 weights, blank values."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config, \
    write_jsonl
from transformers import AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.prepare import prepare
from tuneloop.errors import UserError

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hi, how are you?"}, {"role": "user", "content": "Fine. Count."},
                {"role": "assistant", "content": "one two three"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def prepared(tmp_path, tokenizer, rows, entry: dict, **keys):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(data), **entry}],
                            "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 1024, **keys})
    result = prepare(cfg, tokenizer)
    return [result.train[i] for i in range(len(result.train))]


def trained_text(row, tokenizer) -> str:
    """The trained tokens' text, runs joined with | so separate spans show."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return "|".join(tokenizer.decode(run) for run in runs)


# ---- named chat templates ---------------------------------------------------------------------------------------

def test_llama3_renders_the_familys_text_and_trains_exactly_the_assistant_turns(tmp_path, tokenizer):
    tokenizer.bos_token = "<|endoftext|>"  # the family's <|begin_of_text|> role, in the tiny vocabulary
    try:
        rows = prepared(tmp_path, tokenizer, [{"messages": CONVERSATION}], {"type": "chat_template"},
                        chat_template="llama3")
    finally:
        tokenizer.bos_token = None
    text = tokenizer.decode(rows[0]["input_ids"])
    assert text == ("<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nHi, how are you?<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nFine. Count.<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\none two three<|eot_id|>")
    assert trained_text(rows[0], tokenizer) == "Hi, how are you?<|eot_id|>|one two three<|eot_id|>"


def test_gemma3_puts_the_system_message_in_the_first_user_turn_and_calls_the_assistant_model(tmp_path, tokenizer):
    rows = prepared(tmp_path, tokenizer, [{"messages": CONVERSATION[:3]}], {"type": "chat_template"},
                    chat_template="gemma3")
    assert tokenizer.decode(rows[0]["input_ids"]) == (
        "<start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n<start_of_turn>model\nHi, how are you?"
        "<end_of_turn>\n")
    assert trained_text(rows[0], tokenizer) == "Hi, how are you?<end_of_turn>"


def test_qwen3_trains_the_reasoning_of_a_turn_that_has_it(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "Add one and two."},
                {"role": "assistant", "content": "three", "thinking": "one plus two"}]
    rows = prepared(tmp_path, tokenizer, [{"messages": messages}],
                    {"type": "chat_template", "field_thinking": "thinking"}, chat_template="qwen3")
    assert trained_text(rows[0], tokenizer) == "<think>\none plus two\n</think>\n\nthree<|im_end|>"


def test_a_content_that_also_appears_earlier_in_the_turn_is_located_where_the_template_puts_it(tmp_path, tokenizer):
    """The answer also appears in the reasoning, and a user's message is the word of its own header: the trained
    span ends at the content the template wrote, not at an earlier copy of the same text."""
    messages = [{"role": "user", "content": "user"},
                {"role": "assistant", "content": "three", "thinking": "three, surely"}]
    entry = {"type": "chat_template", "field_thinking": "thinking", "roles_to_train": ["user", "assistant"],
             "train_on_eos": "none"}
    row = prepared(tmp_path, tokenizer, [{"messages": messages}], entry, chat_template="qwen3")[0]
    assert trained_text(row, tokenizer) == "user|<think>\nthree, surely\n</think>\n\nthree"


def test_tokenizer_default_fallback_uses_the_named_template_only_without_the_tokenizers_own(tmp_path, tokenizer):
    no_template = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    no_template.chat_template = None
    rows = prepared(tmp_path, no_template, [{"messages": CONVERSATION[1:3]}], {"type": "chat_template"},
                    chat_template="tokenizer_default_fallback_llama3")
    assert "<|start_header_id|>" in no_template.decode(rows[0]["input_ids"])
    rows = prepared(tmp_path / "own", tokenizer, [{"messages": CONVERSATION[1:3]}], {"type": "chat_template"},
                    chat_template="tokenizer_default_fallback_llama3")
    assert tokenizer.decode(rows[0]["input_ids"]).startswith("<|im_start|>user")  # the tokenizer's ChatML


# ---- chat dataset options ------------------------------------------------------------------------------------------

SHAREGPT = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello there"},
                               {"from": "gpt", "value": "Hi, how are you?"}]}]


def test_message_property_mappings_roles_and_drop_system_message(tmp_path, tokenizer):
    rows = [{"chat": [{"speaker": "boss", "text": "Be brief."}, {"speaker": "me", "text": "Hello there"},
                      {"speaker": "bot", "text": "Hi, how are you?"}]}]
    entry = {"type": "chat_template", "field_messages": "chat",
             "message_property_mappings": {"role": "speaker", "content": "text"},
             "roles": {"system": ["boss"], "user": ["me"], "assistant": ["bot"]}, "drop_system_message": True}
    row = prepared(tmp_path, tokenizer, rows, entry)[0]
    assert tokenizer.decode(row["input_ids"]) == ("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
                                                  "Hi, how are you?<|im_end|>\n")
    assert trained_text(row, tokenizer) == "Hi, how are you?<|im_end|>"


def test_roles_to_train_assistant_and_user_trains_both(tmp_path, tokenizer):
    row = prepared(tmp_path, tokenizer, SHAREGPT, {"type": "chat_template", "field_messages": "conversations",
                                                   "roles_to_train": ["assistant", "user"]})[0]
    assert trained_text(row, tokenizer) == "Hello there<|im_end|>|Hi, how are you?<|im_end|>"


@pytest.mark.parametrize("option, expected", [
    ("turn", "Hi, how are you?<|im_end|>|one two three<|im_end|>"),
    ("none", "Hi, how are you?|one two three"),
    ("last", "Hi, how are you?|one two three<|im_end|>"),
    ("all", "<|im_end|>|<|im_end|>|Hi, how are you?<|im_end|>|<|im_end|>|one two three<|im_end|>"),
])
def test_train_on_eos_says_whose_end_of_turn_marker_is_trained(tmp_path, tokenizer, option, expected):
    row = prepared(tmp_path, tokenizer, [{"messages": CONVERSATION}], {"type": "chat_template",
                                                                       "train_on_eos": option})[0]
    assert trained_text(row, tokenizer) == expected


def test_eot_tokens_name_the_trained_end_marker_and_a_wrong_one_is_an_error(tmp_path, tokenizer):
    row = prepared(tmp_path, tokenizer, [{"messages": CONVERSATION[1:3]}], {"type": "chat_template"},
                   eot_tokens=["<|im_end|>"])[0]
    assert trained_text(row, tokenizer) == "Hi, how are you?<|im_end|>"
    with pytest.raises(UserError, match=r"rows\.jsonl:1: turn 2 does not end with any of eot_tokens \['<\|eot_id\|>'\]"):
        prepared(tmp_path / "wrong", tokenizer, [{"messages": CONVERSATION[1:3]}], {"type": "chat_template"},
                 eot_tokens=["<|eot_id|>"])


def test_alpaca_chat_renders_axolotls_chat_style(tmp_path, tokenizer):
    row = prepared(tmp_path, tokenizer, [{"instruction": "Add two numbers.", "input": "one two", "output": "three"}],
                   {"type": "alpaca:chat"})[0]
    assert tokenizer.decode(row["input_ids"]) == (
        "SYSTEM: Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\nUSER: Add two numbers.\none two\nASSISTANT:three"
        "<|endoftext|>")
    assert trained_text(row, tokenizer) == "three<|endoftext|>"


def test_alpaca_phi_and_chatml_render_axolotls_styles(tmp_path, tokenizer):
    rows = [{"instruction": "Add two numbers.", "input": "one two", "output": "three"},
            {"instruction": "Name a colour.", "output": "red"}]
    phi = prepared(tmp_path / "phi", tokenizer, rows, {"type": "alpaca:phi"})
    system = "Below is an instruction that describes a task"
    assert tokenizer.decode(phi[0]["input_ids"]) == (
        f"<|system|>\n{system}, paired with an input that provides further context. Write a response that "
        "appropriately completes the request.<|end|>\n<|user|>\nAdd two numbers.<|end|>one two<|assistant|>three"
        "<|endoftext|>")
    assert tokenizer.decode(phi[1]["input_ids"]) == (
        f"<|system|>\n{system}. Write a response that appropriately completes the request.<|end|>\n<|user|>\n"
        "Name a colour.<|end|>\n<|assistant|>\nred<|endoftext|>")
    assert [trained_text(row, tokenizer) for row in phi] == ["three<|endoftext|>", "red<|endoftext|>"]
    chatml = prepared(tmp_path / "chatml", tokenizer, rows[1:], {"type": "alpaca:chatml"})[0]
    assert tokenizer.decode(chatml["input_ids"]).endswith(
        "<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nred<|endoftext|>")


def test_jeopardy_rows_are_alpaca_prompts_answered_in_the_games_form(tmp_path, tokenizer):
    """axolotl's jeopardy: the clue as instruction, its category as input, "what is" before the answer."""
    row = prepared(tmp_path, tokenizer, [{"question": "It orbits the Earth", "category": "SPACE", "answer": "the Moon"}],
                   {"type": "jeopardy"})[0]
    assert tokenizer.decode(row["input_ids"]) == (
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\nIt orbits the Earth\n\n### Input:\n"
        "SPACE\n\n### Response:\nwhat is the Moon<|endoftext|>")
    assert trained_text(row, tokenizer) == "what is the Moon<|endoftext|>"
    with pytest.raises(UserError, match="missing field `category`"):
        prepared(tmp_path / "bad", tokenizer, [{"question": "q", "answer": "a"}], {"type": "jeopardy"})


def test_chat_template_default_is_chat_template(tmp_path, tokenizer):
    a = prepared(tmp_path / "a", tokenizer, SHAREGPT, {"type": "chat_template.default"})[0]
    b = prepared(tmp_path / "b", tokenizer, SHAREGPT, {"type": "chat_template"})[0]
    assert a == b


def test_a_dataset_without_type_is_pretokenized(tmp_path, tokenizer):
    rows = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [5, 6, 7], "labels": [-100, -100, 7]}]
    prepared_rows = prepared(tmp_path, tokenizer, rows, {})
    assert [row["input_ids"] for row in prepared_rows] == [[5, 6, 7, 8], [5, 6, 7]]
    assert [row["n_targets"] for row in prepared_rows] == [3, 1]


# ---- split slices and hub datasets ------------------------------------------------------------------------------------

def test_split_slices_take_the_rows_they_name(tmp_path, tokenizer):
    rows = tiny_rows(50)
    assert len(prepared(tmp_path / "a", tokenizer, rows, {"type": "alpaca", "split": "train[:20%]"})) == 10
    assert len(prepared(tmp_path / "b", tokenizer, rows, {"type": "alpaca", "split": "train[45:]"})) == 5
    with pytest.raises(UserError, match="local files hold one split, `train`"):
        prepared(tmp_path / "c", tokenizer, rows, {"type": "alpaca", "split": "validation"})
    with pytest.raises(UserError, match="`datasets.0.split` got 'train\\[::2\\]'"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x", "split": "train[::2]"}]})


def test_a_hub_dataset_without_network_is_a_clear_error(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": "nobody/no-such-dataset", "type": "alpaca",
                                                                  "split": "train[:1%]"}],
                            "dataset_prepared_path": str(tmp_path / "prepared")})
    with pytest.raises(UserError, match="cannot load the dataset 'nobody/no-such-dataset' .* from the Hugging Face hub"):
        prepare(cfg, tokenizer)


# ---- model and tokenizer keys --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("keys") / "train.jsonl", tiny_rows(24, seed=4))


def train(tmp_path, model_dir, data, **keys):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, model_dir, data, max_steps=2, **keys))
    return run_in_process("train", str(config)), tmp_path / "out"


def test_model_type_and_tokenizer_type_load_with_those_classes_and_a_mismatch_is_refused(tmp_path, tiny_model_dir,
                                                                                          data):
    result, _ = train(tmp_path / "a", tiny_model_dir, data, model_type="LlamaForCausalLM",
                      tokenizer_type="PreTrainedTokenizerFast")
    assert result.returncode == 0, result.stderr[-2000:]
    assert_user_error(train(tmp_path / "b", tiny_model_dir, data, model_type="MistralForCausalLM")[0],
                      "`model_type: MistralForCausalLM` does not match", "LlamaForCausalLM")
    assert_user_error(train(tmp_path / "c", tiny_model_dir, data, model_type="NoSuchForCausalLM")[0],
                      "not a class transformers has")


def test_overrides_of_model_config_reach_the_trained_model(tmp_path, tiny_model_dir, data):
    result, out = train(tmp_path, tiny_model_dir, data, model_config={"rms_norm_eps": 1e-3})  # axolotl's old name
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-3


def test_tokens_are_added_and_the_embeddings_grow(tmp_path, tiny_model_dir, data):
    result, out = train(tmp_path, tiny_model_dir, data, tokens=["<|tool_call|>", "<|tool_result|>"])
    assert result.returncode == 0, result.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("<|tool_call|>") != tokenizer.unk_token_id
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(tokenizer)


def test_unfrozen_parameters_train_only_the_matching_weights(tmp_path, tiny_model_dir, data):
    from safetensors.torch import load_file

    result, out = train(tmp_path, tiny_model_dir, data, unfrozen_parameters=["^model.layers.1.mlp.*"],
                        learning_rate=1e-2)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith("model.layers.1.mlp.") for name in changed)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["memory"]["trainable_parameters"] == sum(before[name].numel() for name in before
                                                         if name.startswith("model.layers.1.mlp."))


def test_bfloat16_loads_and_saves_bf16_weights(tmp_path, tiny_model_dir, data):
    from safetensors.torch import load_file

    result, out = train(tmp_path, tiny_model_dir, data, bfloat16=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert {tensor.dtype for tensor in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "plan.json").read_text())["memory"]["weights_gb"] == pytest.approx(
        json.loads((out / "plan.json").read_text())["memory"]["parameters"] * 2 / 1e9, abs=1e-3)


def test_lora_target_modules_as_a_regex(tmp_path, tiny_model_dir, data):
    from safetensors.torch import load_file

    result, out = train(tmp_path, tiny_model_dir, data, adapter="lora", lora_target_modules=r".*layers\.0\..*_proj")
    assert result.returncode == 0, result.stderr[-2000:]
    names = set(load_file(out / "adapter_model.safetensors"))
    assert names and all(".layers.0." in name for name in names)
    assert {name.split(".")[-3] for name in names} >= {"q_proj", "gate_proj"}


def test_quantized_loading_is_planned_and_a_gpu_only_optimizer_refused_at_train_time_without_cuda(tmp_path,
                                                                                               tiny_model_dir, data):
    """QLoRA itself runs here (bitsandbytes' CPU backend: tests/test_qlora.py); torchao's 8-bit AdamW needs CUDA."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    keys = dict(adapter="qlora", load_in_4bit=True, lora_target_linear=True, optimizer="adamw_torch_8bit")
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    planned = run_in_process("plan", str(config), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    memory = json.loads(planned.stdout)["memory"]
    assert memory["weights_gb"] == pytest.approx(memory["parameters"] * 0.5 / 1e9, abs=1e-3)  # NF4
    result = run_in_process("train", str(config))
    assert_user_error(result, "this machine cannot run this config", "`optimizer: adamw_torch_8bit` needs a CUDA GPU")
    assert "quantized loading" not in result.stderr  # bitsandbytes quantizes on this CPU
    checked = run_in_process("check", str(config))
    assert checked.returncode == 0
    assert "needs                4bit quantized loading (`adapter: qlora`, load_in_4bit): bitsandbytes" \
        in checked.stdout


def test_flash_attention_on_a_machine_without_it_plans_and_trains_with_sdpa(tmp_path, tiny_model_dir, data):
    if torch.cuda.is_available():
        pytest.skip("this machine may run flash-attention")
    result, out = train(tmp_path, tiny_model_dir, data, attn_implementation="flash_attention_2")
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["attention"] == "sdpa_per_sequence"  # SDPA, each padded row's real tokens apart on a CPU
    assert any("`flash_attention_2` needs a CUDA GPU: using sdpa" in warning for warning in plan["warnings"])


# ---- schedule, evals, blanks, plugins ------------------------------------------------------------------------------------

def test_evals_per_epoch_zero_and_eval_strategy_no_turn_evaluation_off(tmp_path, tiny_model_dir, data):
    for name, keys in (("zero", dict(evals_per_epoch=0)), ("no", dict(eval_strategy="no"))):
        result, out = train(tmp_path / name, tiny_model_dir, data, val_set_size=0.2, **keys)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads((out / "plan.json").read_text())["eval_steps_at"] == []
        assert not [m for m in read_metrics(out) if "eval_loss" in m]


def test_constant_with_warmup_is_axolotls_name_for_constant(tmp_path, tiny_model_dir, data):
    result, out = train(tmp_path, tiny_model_dir, data, lr_scheduler="constant_with_warmup", warmup_steps=1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [m["lr"] for m in read_metrics(out) if "loss" in m] == [pytest.approx(5e-4), pytest.approx(1e-3)]


def test_blank_values_mean_unset_at_every_depth():
    cfg = config_from_dict({"base_model": "m", "lora_r": None, "special_tokens": None, "fp16": None,
                            "datasets": [{"path": "x", "type": "alpaca", "split": None, "roles_to_train": None}],
                            "fsdp_config": None, "rl": None, "local_rank": None})
    assert cfg.lora_r == 8 and cfg.special_tokens == {} and cfg.datasets[0].split == "train"
    assert cfg.datasets[0].roles_to_train == ["assistant"]


def test_plugins_that_only_change_speed_are_accepted_with_a_warning_and_others_refused():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}],
                          "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]})
    assert any("CutCrossEntropy" in str(w.message) for w in caught)
    with pytest.raises(UserError, match="is an axolotl plugin tuneloop does not have"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}],
                          "plugins": ["axolotl.integrations.diffusion.DiffusionPlugin"]})


def test_check_reports_every_problem_at_once_in_well_under_a_second(tmp_path):
    import subprocess
    import sys
    import time

    config = write_config(tmp_path / "bad.yml", base_model="m", datasets=[{"path": "x", "shards": 4}], rl="kto_pair",
                          deepcompile=True, micro_batch_size="two", learning_rat=1e-4)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", "import sys; from tuneloop.cli import main; "
                             "import tuneloop; sys.exit(main(['check', sys.argv[1]])) if 'torch' not in sys.modules "
                             "else None", str(config)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    assert_user_error(result, "`rl` asks for this preference/RL training",
                      "`deepcompile: True` asks for DeepSpeed's deepcompile",
                      "datasets[0].`shards: 4` asks for a dataset option", "`micro_batch_size` got 'two'",
                      "unknown key `learning_rat`. Did you mean `learning_rate`?")
    assert result.stderr.count("\n  ") == 4  # five problems, one line each
    assert seconds < 5  # a fresh interpreter included; the check itself imports no torch (asserted in the script)


def test_check_reports_problems_of_different_features_at_once_field_errors_and_rules_alike(tmp_path):
    """A refused value (an unknown chat template) does not hide the cross-key rules of other features: the
    sharding, schedule and preference problems are reported in the same pass."""
    config = write_config(tmp_path / "bad.yml", base_model="m", chat_template="qwen9", rl="dpo", simpo_gamma=0.5,
                          datasets=[{"path": "x", "type": "chat_template"}], warmup_steps=10, warmup_ratio=0.1,
                          adapter="lora", load_in_8bit=True, lora_target_linear=True, fsdp=["full_shard"],
                          fsdp_version=2)
    result = run_in_process("check", str(config))
    assert_user_error(result, "`chat_template` got 'qwen9'",
                      "`load_in_8bit` with `fsdp` asks for 8-bit weights under FSDP2",
                      "`warmup_steps` and `warmup_ratio` cannot both be set",
                      "`simpo_gamma` shapes SimPO's loss, and this run is `rl: dpo`")
    assert result.stderr.count("\n  ") == 3  # four problems, one line each


def test_a_rule_that_reads_a_refused_value_waits_for_it_instead_of_guessing(tmp_path):
    """`rl: kto_pair` is refused; the preference rule, which would judge the datasets against `rl`, says nothing
    (it would otherwise call the preference data a mistake for a run without `rl`)."""
    config = write_config(tmp_path / "bad.yml", base_model="m", rl="kto_pair",
                          datasets=[{"path": "x", "type": "chat_template.argilla"}])
    result = run_in_process("check", str(config))
    assert_user_error(result, "`rl` asks for this preference/RL training")
    assert "is preference data" not in result.stderr and result.stderr.count("\n  ") == 0


def test_gradient_checkpointing_and_its_offload_give_the_same_weights_as_none(tmp_path, tiny_model_dir, data):
    """axolotl's `gradient_checkpointing: offload` (and kwargs) are honoured, and change only memory."""
    from safetensors.torch import load_file

    weights = {}
    for name, value in (("none", False), ("checkpointed", True), ("offload", "offload")):
        result, out = train(tmp_path / name, tiny_model_dir, data, gradient_checkpointing=value,
                            gradient_checkpointing_kwargs={"use_reentrant": False})
        assert result.returncode == 0, result.stderr[-2000:]
        weights[name] = load_file(out / "model.safetensors")
    for name in ("checkpointed", "offload"):
        assert all(torch.allclose(weights[name][key], weights["none"][key], atol=1e-6) for key in weights["none"])


def test_lora_target_parameters_put_the_adapter_on_those_parameters_only(tmp_path, tiny_model_dir, data):
    from safetensors.torch import load_file

    result, out = train(tmp_path, tiny_model_dir, data, adapter="lora", lora_target_parameters=["mlp.down_proj.weight"])
    assert result.returncode == 0, result.stderr[-2000:]
    names = set(load_file(out / "adapter_model.safetensors"))
    assert names and all("down_proj" in name for name in names)


def test_revision_of_model_with_a_local_folder_is_refused_not_ignored(tmp_path, tiny_model_dir, data):
    assert_user_error(train(tmp_path, tiny_model_dir, data, model_revision="main")[0],
                      "`revision_of_model: main` applies to hub models")


def test_a_dataset_can_have_its_own_chat_template(tmp_path, tokenizer):
    row = prepared(tmp_path, tokenizer, [{"messages": CONVERSATION[1:3]}],
                   {"type": "chat_template", "chat_template": "phi_3"}, chat_template="llama3")[0]
    assert tokenizer.decode(row["input_ids"]).startswith("<|user|>\nHello there<|end|>")


def test_eval_strategy_steps_evaluates_every_eval_steps(tmp_path, tiny_model_dir, data):
    result, out = train(tmp_path, tiny_model_dir, data, val_set_size=0.2, eval_strategy="steps", eval_steps=1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "plan.json").read_text())["eval_steps_at"] == [1, 2]


@pytest.mark.parametrize("raw, message", [
    ({"adapter": "qlora", "load_in_8bit": True, "lora_target_linear": True}, "`adapter: qlora` loads the weights in 4-bit"),
    ({"lr_scheduler": "constant", "cosine_min_lr_ratio": 0.1}, "`cosine_min_lr_ratio` sets where a decay ends"),
    ({"lr_scheduler": "linear", "cosine_constant_lr_ratio": 0.5}, "`cosine_constant_lr_ratio` ends a cosine decay"),
    ({"lr_scheduler": "one_cycle", "lr_quadratic_warmup": True}, "`lr_quadratic_warmup` shapes a warm-up"),
    ({"flash_attention": True, "attn_implementation": "sdpa"}, "the attention settings disagree"),
    ({"chat_template": "llama3", "chat_template_jinja": "{{ x }}"}, "name two templates"),
    ({"datasets": [{"path": "x", "type": "alpaca", "roles_to_train": ["user"]}]}, "`roles_to_train` applies to chat"),
    ({"datasets": [{"path": "x", "type": "alpaca", "field": "text"}]}, "`field` names the text of a `type: completion`"),
    ({"datasets": [{"path": "x", "type": "chat_template", "trust_remote_code": True}]}, "asks for a dataset option"),
])
def test_combinations_that_would_leave_a_key_unused_are_refused(raw, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], **raw})


def test_a_jinja_template_without_chat_template_jinja_is_that_template(tmp_path, tokenizer):
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x", "type": "chat_template",
                                                             "chat_template_jinja": "{{ 'x' }}"}],
                            "chat_template_jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    assert cfg.chat_template == "jinja" and cfg.datasets[0].chat_template == "jinja"


def test_lora_target_linear_with_extra_modules_trains_their_union(tmp_path, tiny_model_dir, data):
    from safetensors.torch import load_file

    result, out = train(tmp_path, tiny_model_dir, data, adapter="lora", lora_target_linear=True,
                        lora_target_modules=["lm_head"])
    assert result.returncode == 0, result.stderr[-2000:]
    modules = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in load_file(out / "adapter_model.safetensors")}
    assert {"lm_head", "q_proj", "down_proj"} <= modules


def test_a_dataset_asking_for_the_tokenizers_own_template_gets_it_while_the_run_saves_its_named_one(
        tmp_path, tiny_model_dir):
    rows = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]}] * 12)
    result, out = train(tmp_path, tiny_model_dir, rows, chat_template="llama3",
                        datasets=[{"path": str(rows), "type": "chat_template", "chat_template": "tokenizer_default"}])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "<|start_header_id|>" in AutoTokenizer.from_pretrained(out).chat_template  # the run's, saved
    shown = run_in_process("preprocess", str(tmp_path / "run.yml"), "--show", "1").stdout
    assert "<|im_start|>user" in shown and "start_header_id" not in shown  # the rows used the tokenizer's ChatML


def test_evals_asked_for_without_an_eval_set_are_a_plan_warning(tmp_path, tiny_model_dir, data):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, eval_steps=2,
                                                              early_stopping_patience=2))
    result = run_in_process("plan", str(config))
    assert "warning: eval_steps, early_stopping_patience set, but there is no eval set" in result.stdout


def test_an_optimizer_axolotl_has_and_tuneloop_does_not_is_refused_naming_it_and_the_feature():
    with pytest.raises(UserError, match=r"`optimizer` got 'dion': Dion asks for an optimizer option, which "
                                        r"tuneloop does not do yet; use 'adamw_torch'"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "optimizer": "dion"})
    with pytest.raises(UserError, match=r"got 'adamw_nonsense', which is not an optimizer tuneloop knows"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "optimizer": "adamw_nonsense"})


def test_a_fractional_warmup_steps_points_to_warmup_ratio():
    with pytest.raises(UserError, match=r"`warmup_steps` got 0.1, and it counts whole steps; a share of the run is "
                                        r"`warmup_ratio: 0.1`"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "warmup_steps": 0.1})
    assert config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "warmup_steps": 10.0}).warmup_steps == 10
