"""Using what a run trained: `tuneloop infer`, `tuneloop eval` and `tuneloop merge-lora`, on two tiny runs trained
once for the module (full weights and LoRA, both fp32 with an eval set evaluated at the last step)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.errors import UserError
from tuneloop.use.generate import GenerationSettings, chat, generate_all, read_prompts

PROMPTS = [
    "Hello",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 6),
    "Name three colours.",
    "Translate the sentence into French. Count: one two three four five six seven.",
    "What is your name?",
]
GREEDY = GenerationSettings(max_new_tokens=10, batch_size=4)


def train(folder: Path, model_dir: Path, data: Path, **keys) -> Path:
    folder.mkdir()
    config = write_config(folder / "run.yml", **base_config(folder, model_dir, data, val_set_size=0.1,
                                                            evals_per_epoch=1, **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict:
    """{"full": run.yml, "lora": run.yml}; each run's model is in out/ beside its config."""
    root = tmp_path_factory.mktemp("use_model")
    data = write_jsonl(root / "train.jsonl", tiny_rows(32, seed=3))
    return {"full": train(root / "full", tiny_model_dir, data, learning_rate=3e-3),
            "lora": train(root / "lora", tiny_model_dir, data, learning_rate=1e-2, adapter="lora", lora_r=4,
                          lora_alpha=8, lora_target_linear=True)}


def out_of(config: Path) -> Path:
    return config.parent / "out"


@pytest.fixture(scope="module")
def full_model(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = out_of(runs["full"])
    return AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def lora_model(runs, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's own deprecation notice
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                         out_of(runs["lora"])).eval()


def jsonl_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


# ---- infer ---------------------------------------------------------------------------------------

def test_infer_answers_every_prompt_in_input_order(runs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": text} for text in PROMPTS[:4]]
                + [{"messages": [{"role": "user", "content": PROMPTS[4]}]}])
    result = run_in_process("infer", str(runs["full"]), "--prompts", str(prompts), "--max-new-tokens", "8",
                            "--batch-size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = jsonl_rows(result.stdout)
    assert [row["index"] for row in rows] == list(range(5))
    assert [row["prompt"] for row in rows[:4]] == PROMPTS[:4]
    assert rows[4]["prompt"] == [{"role": "user", "content": PROMPTS[4]}]
    assert all(isinstance(row["completion"], str) for row in rows)
    # each row's completion is that prompt's own: the same as generating it alone
    alone = run_in_process("infer", "--model", str(out_of(runs["full"])), "--prompts", str(prompts),
                           "--max-new-tokens", "8", "--batch-size", "1")
    assert [row["completion"] for row in jsonl_rows(alone.stdout)] == [row["completion"] for row in rows]
    assert len({row["completion"] for row in rows}) > 1  # not one answer for all


def test_batch_sizes_1_and_4_give_the_same_greedy_text(full_model):
    model, tokenizer = full_model
    one = generate_all(model, tokenizer, PROMPTS, GenerationSettings(max_new_tokens=10, batch_size=1))
    four = generate_all(model, tokenizer, PROMPTS, GREEDY)
    assert one == four
    assert any(text.strip() for text in one)


def raise_once(error: Exception):
    calls = []

    def hook(module, inputs, output):
        if not calls:
            calls.append(1)
            raise error
    return hook


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory"),
    RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 123 bytes"),
], ids=["cuda", "cpu"])
def test_out_of_memory_halves_the_batch_and_answers_every_prompt(full_model, error):
    model, tokenizer = full_model
    expected = generate_all(model, tokenizer, PROMPTS, GREEDY)
    said = []
    handle = model.register_forward_hook(raise_once(error))
    try:
        got = generate_all(model, tokenizer, PROMPTS, GREEDY, say=said.append)
    finally:
        handle.remove()
    assert got == expected
    assert said == ["out of memory at batch size 4; retrying at 2"]


def test_out_of_memory_at_one_prompt_is_a_user_error_and_other_errors_propagate(full_model):
    model, tokenizer = full_model

    def always(error):
        return model.register_forward_hook(lambda *_: (_ for _ in ()).throw(error))

    handle = always(torch.OutOfMemoryError("CUDA out of memory"))
    try:
        with pytest.raises(UserError, match="out of memory generating a single prompt"):
            generate_all(model, tokenizer, PROMPTS[:3], GREEDY, say=lambda _: None)
    finally:
        handle.remove()
    handle = always(RuntimeError("shape mismatch"))
    try:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            generate_all(model, tokenizer, PROMPTS[:2], GREEDY)
    finally:
        handle.remove()


def test_prompts_from_text_and_stdin(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\n  {not json in a .txt file}\nlast\n")
    assert read_prompts(str(text)) == ["first prompt", "  {not json in a .txt file}", "last"]
    stdin = ["plain line\n", "\n", '{"prompt": "from json"}\n', '{"messages": [{"role": "user", "content": "hi"}]}\n']
    assert read_prompts(None, stdin) == ["plain line", "from json", [{"role": "user", "content": "hi"}]]
    with pytest.raises(UserError, match="<stdin>:2"):
        read_prompts(None, ["ok\n", '{"prompt": 3}\n'])


def test_chat_keeps_the_conversation(full_model):
    model, tokenizer = full_model
    replies = []
    chat(model, tokenizer, GREEDY, ["Hello", "What is your name?", "", "never read"], replies.append)
    assert len(replies) == 2
    # the second turn saw the first: its reply is the continuation of the whole conversation
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": replies[0]},
                    {"role": "user", "content": "What is your name?"}]
    assert generate_all(model, tokenizer, [conversation], GREEDY) == [replies[1]]


def test_infer_refuses_a_bad_prompts_row_and_a_folder_without_a_model(runs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    assert_user_error(run_in_process("infer", str(runs["full"]), "--prompts", str(prompts)),
                      f"{prompts}:2", "`prompt`", "`messages`")
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "Hello"}])
    assert_user_error(run_in_process("infer", "--model", str(empty), "--prompts", str(good)),
                      str(empty), "holds no model")
    assert_user_error(run_in_process("infer", str(runs["full"]), "--model", str(empty)), "CONFIG or --model")


def test_infer_names_an_adapters_missing_base(runs, tmp_path):
    adapter = shutil.copytree(out_of(runs["lora"]), tmp_path / "adapter",
                              ignore=shutil.ignore_patterns("checkpoint-*", "merged"))
    settings = json.loads((adapter / "adapter_config.json").read_text())
    settings["base_model_name_or_path"] = str(tmp_path / "moved_away")
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello"}])
    assert_user_error(run_in_process("infer", "--model", str(adapter), "--prompts", str(prompts)),
                      str(tmp_path / "moved_away"), "--base DIR")


# ---- eval ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", ["full", "lora"])
def test_eval_reproduces_the_runs_last_eval(runs, tiny_model_dir, tmp_path, run):
    config = runs[run]
    last = [m for m in read_metrics(out_of(config)) if "eval_loss" in m][-1]
    written = tmp_path / "eval.json"
    result = run_in_process("eval", str(config), "--output", str(written))
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout)
    assert measured == json.loads(written.read_text())
    assert measured["model"] == str(out_of(config))
    assert measured["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    assert measured["eval_perplexity"] == pytest.approx(last["eval_perplexity"], rel=1e-6)
    assert (measured["eval_token_accuracy"], measured["eval_tokens"]) == (last["eval_token_accuracy"],
                                                                         last["eval_tokens"])
    base = run_in_process("eval", str(config), "--model", str(tiny_model_dir))
    assert base.returncode == 0, base.stderr[-3000:]
    untrained = json.loads(base.stdout)
    assert untrained["eval_tokens"] == last["eval_tokens"]
    assert untrained["eval_loss"] > measured["eval_loss"] + 0.05  # measured: +0.73 full, +0.13 LoRA


def test_eval_without_an_eval_set_says_which_keys_give_one(runs, tmp_path):
    settings = json.loads(json.dumps(__import__("yaml").safe_load(runs["full"].read_text())))
    settings.pop("val_set_size")
    config = write_config(tmp_path / "no_eval.yml", **settings)
    assert_user_error(run_in_process("eval", str(config)), "val_set_size", "test_datasets")


# ---- merge-lora ----------------------------------------------------------------------------------

def test_merged_model_computes_what_the_adapter_does_and_loads_without_peft(runs, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = runs["lora"]
    merged_dir = tmp_path / "merged"
    result = run_in_process("merge-lora", str(config), "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(merged_dir) in result.stdout
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "adapter_config.json").exists()
    assert (merged_dir / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # the temp folder was renamed

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()  # transformers alone
    assert not any("lora" in name for name, _ in merged.named_parameters())
    adapter = lora_model(runs, tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
    with torch.no_grad():
        merged_logits, adapter_logits = merged(ids).logits, adapter(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
    assert (merged_logits - adapter_logits).abs().max() < 1e-5  # fp32: W + BA·s folded, the same sums reordered
    assert (base_logits - adapter_logits).abs().max() > 1e-3  # the adapter changed something to fold in

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": text} for text in PROMPTS])
    texts = {}
    for name, folder in (("adapter", out_of(config)), ("merged", merged_dir)):
        answer = run_in_process("infer", "--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "10")
        assert answer.returncode == 0, answer.stderr[-3000:]
        texts[name] = [row["completion"] for row in jsonl_rows(answer.stdout)]
    assert texts["adapter"] == texts["merged"]


def test_merge_lora_refuses_a_full_model_and_a_filled_output(runs, tmp_path):
    assert_user_error(run_in_process("merge-lora", str(runs["full"])), "already a full model")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    assert_user_error(run_in_process("merge-lora", "--adapter", str(out_of(runs["lora"])), "--output", str(taken)),
                      str(taken), "--output")
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---- export --------------------------------------------------------------------------------------

def test_export_of_a_lora_run_from_its_config_holds_the_adapter_merged_and_is_the_runs_own(runs, tiny_model_dir,
                                                                                           tmp_path):
    """`tuneloop export CONFIG` on a LoRA run: OUTPUT_DIR/model-f32.gguf holds base + adapter (transformers' GGUF
    loader gives the adapter's logits within 1e-5) and is recorded as the run's, as merge-lora's folder is."""
    from transformers import AutoModelForCausalLM

    from tuneloop import run_files

    out = tmp_path / "out"
    shutil.copytree(out_of(runs["lora"]), out)  # the module's run stays as the other tests see it
    result = run_in_process("export", str(runs["lora"]), "--set", f"output_dir={out}", "--quant", "f32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LoRA adapter merged into" in result.stdout and "model-f32.gguf" in result.stdout
    assert {"model-f32.gguf", "model-f32.Modelfile"} <= run_files.written_names(out)
    read_here = tmp_path / "read"  # transformers takes a folder with adapter_config.json for peft's
    read_here.mkdir()
    (read_here / "model.gguf").hardlink_to(out / "model-f32.gguf")
    exported = AutoModelForCausalLM.from_pretrained(read_here, gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        assert (exported(ids).logits - lora_model(runs, tiny_model_dir)(ids).logits).abs().max() < 1e-5
