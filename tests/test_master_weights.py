"""bf16 compute weights with fp32 masters (engines/masters.py), through the real `tuneloop train`:

- the run holds bf16 weights and steps fp32 masters, as the plan says and counts;
- its weights after four AdamW steps are as close to the fp32 run's as the autocast path's are (both compute in
  bf16), and far closer than pure bf16 weights (`bfloat16: true`, no masters) get;
- two DDP ranks give one process's update (the masters' fp32 gradients are averaged once per step);
- the saved model is the fp32 masters; a kill -9 and resume is bit-identical (test_resume.py's `masters` variant).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (assert_user_error, base_config, run_in_process, run_two_ranks, tiny_rows, write_config,
                      write_jsonl)
from safetensors.torch import load_file

FOUR_ADAMW_STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-4, "max_steps": 4, "lr_scheduler": "constant",
                    "num_epochs": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("masters_data") / "train.jsonl", tiny_rows(48, seed=5))


def train(tmp_path, model_dir, data, name: str, ranks: int = 1, **keys):
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = write_config(run_dir / "run.yml", **base_config(run_dir, model_dir, data, **keys))
    result = run_two_ranks("train", str(config)) if ranks == 2 else run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir / "out"


def change(out, model_dir) -> dict:
    after, before = load_file(out / "model.safetensors"), load_file(model_dir / "model.safetensors")
    return {key: after[key].double() - before[key].double() for key in before}


def relative_difference(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(b[k].pow(2).sum()) for k in b)) ** 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, data):
    """One process, four AdamW steps of 2 × 2 rows: fp32, bf16 with masters, bf16 autocast over fp32 weights, and
    pure bf16 weights."""
    tmp_path = tmp_path_factory.mktemp("masters_runs")
    return {"fp32": train(tmp_path, tiny_model_dir, data, "fp32", **FOUR_ADAMW_STEPS),
            "masters": train(tmp_path, tiny_model_dir, data, "masters", bf16=True, **FOUR_ADAMW_STEPS),
            "autocast": train(tmp_path, tiny_model_dir, data, "autocast", bf16=True, master_weights=False,
                              **FOUR_ADAMW_STEPS),
            "pure_bf16": train(tmp_path, tiny_model_dir, data, "pure", bf16=True, bfloat16=True,
                               **FOUR_ADAMW_STEPS)}


def test_the_run_computes_with_bf16_weights_and_steps_fp32_masters_as_planned(runs):
    out = runs["masters"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["resolved"]["precision"]["masters"] is True
    assert "bf16 compute weights and fp32 masters" in plan["precision"]
    held = json.loads((out / "summary.json").read_text())["held_bytes_per_rank"][0]
    parameters = plan["memory"]["parameters"]
    # every weight of the tiny model is trained: bf16 for the model, an fp32 master and two fp32 AdamW states
    assert held["weights"] == parameters * 2
    assert held["optimizer"] == pytest.approx(parameters * (4 + 8), rel=1e-3)  # (and AdamW's step counters)
    planned = plan["memory"]["per_rank_bytes"]
    assert held["weights"] == planned["weights"]
    assert held["optimizer"] == pytest.approx(planned["optimizer"], rel=1e-3)
    autocast = json.loads((runs["autocast"] / "plan.json").read_text())
    assert autocast["resolved"]["precision"]["masters"] is False
    assert json.loads((runs["autocast"] / "summary.json").read_text())["held_bytes_per_rank"][0]["weights"] == \
        parameters * 4


def test_the_saved_model_is_the_fp32_masters(runs, tiny_model_dir):
    saved = load_file(runs["masters"] / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
    assert json.loads((runs["masters"] / "config.json").read_text())["dtype"] == "float32"
    # the masters moved by updates a bf16 weight could not hold: some weights changed by less than its spacing
    before = load_file(tiny_model_dir / "model.safetensors")
    moved = [(saved[key] - before[key]).abs() for key in before]
    spacing = [before[key].abs() * 2 ** -8 for key in before]
    assert any(bool(((m > 0) & (m < s)).any()) for m, s in zip(moved, spacing))


def test_masters_stay_as_close_to_the_fp32_run_as_autocast_does_and_pure_bf16_does_not(runs, tiny_model_dir):
    fp32 = change(runs["fp32"], tiny_model_dir)
    masters = relative_difference(change(runs["masters"], tiny_model_dir), fp32)
    autocast = relative_difference(change(runs["autocast"], tiny_model_dir), fp32)
    pure = relative_difference(change(runs["pure_bf16"], tiny_model_dir), fp32)
    print(f"relative L2 of the weight change against fp32's: masters {masters:.2e}, autocast {autocast:.2e}, "
          f"pure bf16 {pure:.2e}")
    assert masters < 0.05 and masters < 2 * autocast
    assert pure > 3 * masters


@pytest.mark.slow
def test_two_ddp_ranks_with_masters_equal_one_process(tmp_path, tiny_model_dir, data, runs):
    """2 ranks × 1 micro-batch of 2 × 2 accumulation = one process's 2 × 2 × 2 rows: same micro-batches, so the same
    bf16 gradients; only the order of the fp32 sums differs (and sums of a few bf16 values are exact in fp32: the
    difference measured 0)."""
    keys = {**FOUR_ADAMW_STEPS, "gradient_accumulation_steps": 4}
    one = train(tmp_path, tiny_model_dir, data, "one", bf16=True, **keys)
    two = train(tmp_path, tiny_model_dir, data, "two", ranks=2, bf16=True, **FOUR_ADAMW_STEPS)
    plan = json.loads((two / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["resolved"]["precision"]["masters"] is True
    difference = relative_difference(change(two, tiny_model_dir), change(one, tiny_model_dir))
    print(f"relative L2 of 2 ranks' weight change against one process's: {difference:.2e}")
    assert difference < 1e-4


@pytest.mark.parametrize("keys, named", [
    ({"bf16": False}, "needs bf16 mixed precision"),
    ({"bf16": True, "adapter": "lora", "lora_r": 4, "lora_target_linear": True}, "needs a full fine-tune"),
    ({"bf16": True, "bfloat16": True}, "bfloat16"),
])
def test_master_weights_true_where_the_run_cannot_have_them_is_refused_naming_why(tmp_path, tiny_model_dir, data,
                                                                                  keys, named):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, master_weights=True,
                                                              **keys))
    assert_user_error(run_in_process("check", str(config)), "master_weights: true", named)
