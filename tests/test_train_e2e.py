"""End to end through the real CLI on a tiny LLaMA built from a config: plan == run, the saved
folder reloads, and training lowers eval loss."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl


@pytest.fixture
def alpaca_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", tiny_rows(120))


def test_train_runs_exactly_the_planned_steps_and_saves_a_loadable_model(tmp_path, tiny_model_dir, alpaca_file):
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, alpaca_file, val_set_size=0.1, gradient_accumulation_steps=2, num_epochs=3,
        learning_rate=3e-3, eval_on_start=True, evals_per_epoch=1, warmup_steps=2))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    plan = json.loads((out / "plan.json").read_text())
    metrics = read_metrics(out)
    train_lines = [m for m in metrics if "loss" in m]
    eval_lines = [m for m in metrics if "eval_loss" in m]

    assert [m["step"] for m in train_lines] == list(range(1, plan["total_steps"] + 1))
    assert plan["total_steps"] == 3 * plan["steps_per_epoch"]
    assert train_lines[-1]["tokens"] == plan["total_trainable_tokens"]
    assert [m["step"] for m in eval_lines] == plan["eval_steps_at"]
    assert eval_lines[-1]["eval_loss"] < eval_lines[0]["eval_loss"] - 0.3
    for key in ("epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_second"):
        assert key in train_lines[0]
    for key in ("eval_perplexity", "eval_token_accuracy"):
        assert key in eval_lines[0]

    report = (out / "report.md").read_text()
    assert f"{eval_lines[0]['eval_loss']:.4f} (step 0) → {eval_lines[-1]['eval_loss']:.4f}" in report
    # the train loss at either end: the mean of a fifth of the lines each (one line's loss swings with its batch)
    count = len(train_lines) // 5
    assert count >= 2
    first, last = (sum(m["loss"] for m in lines) / count for lines in (train_lines[:count], train_lines[-count:]))
    assert f"(each the mean of {count} of the {len(train_lines)} train lines) | {first:.4f} → {last:.4f} |" in report
    from matplotlib.image import imread

    assert imread(out / "report.png").shape[:2] == (600, 800)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (out / "model.safetensors").is_file()
    with torch.no_grad():
        logits = reloaded(**tokenizer("### Instruction:\nAdd two numbers.", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(initial.model.embed_tokens.weight, reloaded.model.embed_tokens.weight)


def test_plan_command_prints_the_same_numbers_as_train_writes(tmp_path, tiny_model_dir, alpaca_file):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, alpaca_file, max_steps=5,
                                                              num_epochs=2))
    result = run_in_process("plan", str(config), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    for key in ("world_size", "micro_batch_size", "gradient_accumulation_steps", "global_batch_size", "train_rows",
                "train_tokens", "trainable_tokens", "steps_per_epoch", "total_steps", "warmup_steps",
                "eval_count", "save_count", "warnings"):
        assert key in plan
    assert plan["total_steps"] == 5
    assert any("max_steps=5" in warning for warning in plan["warnings"])
    human = run_in_process("plan", str(config))
    assert "5 in total" in human.stdout and "warning: max_steps=5" in human.stdout

    assert run_in_process("train", str(config)).returncode == 0
    assert json.loads((tmp_path / "out" / "plan.json").read_text()) == plan
    assert max(m["step"] for m in read_metrics(tmp_path / "out")) == 5


def test_lora_trains_only_the_adapter_and_saves_a_loadable_adapter(tmp_path, tiny_model_dir, alpaca_file):
    config = write_config(tmp_path / "lora.yml", **base_config(
        tmp_path, tiny_model_dir, alpaca_file, adapter="lora", lora_r=4, lora_alpha=8,
        lora_target_modules=["q_proj", "v_proj"], max_steps=4, learning_rate=1e-2))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    assert any(float(t.abs().sum()) > 0 for k, t in adapter.items() if "lora_B" in k)  # B starts at 0: it trained
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's own deprecation notice, outside tuneloop
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, tuned(ids).logits)
