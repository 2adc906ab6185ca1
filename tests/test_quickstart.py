"""The quickstart config, on the embedded SmolLM2 and chatterbot data, end to end (two steps in CI: each step of
the 135M model takes ~15 s on 2 CPU cores, and two already lower the eval loss from 3.31 to 2.14)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_in_process

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yml"


@pytest.mark.slow
def test_quickstart_trains_the_embedded_model_and_lowers_eval_loss(tmp_path):
    out = tmp_path / "out"
    result = run_in_process("train", str(QUICKSTART), "--set", "max_steps=2", "--set", f"output_dir={out}",
                            "--set", f"dataset_prepared_path={tmp_path / 'prepared'}", "--set", "evals_per_epoch=1")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    metrics = read_metrics(out)
    evals = [m for m in metrics if "eval_loss" in m]
    assert plan["batching"] == "packed" and plan["total_steps"] == 2
    assert max(m["step"] for m in metrics if "loss" in m) == 2
    assert [m["step"] for m in evals] == [0, 2]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.use_cache is True and tokenizer.chat_template

    # the run taken to llama.cpp: `tuneloop export CONFIG` writes OUTPUT_DIR/model-q8_0.gguf. Read back by
    # transformers' GGUF loader, its 16 greedy tokens are the HF folder's for some prompts, and wherever they part
    # it is at a near-tie that q8_0's own logit error can flip. How many of the 4 part depends on the CPU's kernels
    # (1 where this test was written; 2 on an Intel AMX machine, 2026-12-02): the near-tie is what is asserted.
    exported = run_in_process("export", str(QUICKSTART), "--set", f"output_dir={out}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    gguf_model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model-q8_0.gguf", dtype=torch.float32).eval()
    model.eval()
    greedy = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    identical = 0
    for question in ("What is your favourite book?", "What is the capital of France?", "Do you like music?",
                     "Tell me a joke."):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            ours, theirs = model.generate(prompt, **greedy)[0], gguf_model.generate(prompt, **greedy)[0]
            if torch.equal(ours, theirs):
                identical += 1
                continue
            parted = int((ours != theirs).nonzero()[0])
            expected, got = model(ours[None, :parted]).logits[0, -1], gguf_model(ours[None, :parted]).logits[0, -1]
        error = (expected - got).abs().max()
        assert expected[ours[parted]] - expected[theirs[parted]] <= 2 * error, question
    assert identical >= 1
