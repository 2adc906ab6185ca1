"""bf16 compute weights with fp32 masters (engines/masters.py), through the real `tuneloop train`:

- the run holds bf16 weights and steps fp32 masters, as the plan says and counts;
- the products are autocast's (the same bf16 weights, the gradients added into fp32): after four AdamW steps its
  weights equal the autocast run's, while pure bf16 weights (`bfloat16: true`, no masters) lose the update;
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


def test_the_run_computes_with_bf16_weights_and_steps_fp32_masters_as_planned(runs, tiny_model_dir):
    out = runs["masters"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["resolved"]["precision"]["masters"] is True
    assert "bf16 compute weights and fp32 masters" in plan["precision"]
    held = json.loads((out / "summary.json").read_text())["held_bytes_per_rank"][0]
    parameters = plan["memory"]["parameters"]
    # the tiny LLaMA's q/k/v/o and MLP projections (its output head stays fp32 for the chunked loss)
    matmul_weights = sum(tensor.numel() for name, tensor in load_file(tiny_model_dir / "model.safetensors").items()
                         if name.endswith("proj.weight"))
    # the matmuls' weights in bf16, the rest (embeddings, norms) fp32; an fp32 master of each bf16 weight and two
    # fp32 AdamW states of every weight
    assert held["weights"] == parameters * 4 - matmul_weights * 2
    assert held["optimizer"] == pytest.approx(matmul_weights * 4 + parameters * 8, rel=1e-3)  # (and step counters)
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


def test_masters_compute_as_autocast_does_and_pure_bf16_does_not(runs, tiny_model_dir):
    """The same products in the same dtypes as under autocast, gradients added into fp32 in the same order and the
    norm clipped over the same sum: the weights equal autocast's (measured: bit-identical after 4 AdamW steps), while
    bf16 compute itself is 2.5e-2 from fp32 and pure bf16 weights (no fp32 copy) lose most of the update."""
    fp32 = change(runs["fp32"], tiny_model_dir)
    autocast = change(runs["autocast"], tiny_model_dir)
    masters = relative_difference(change(runs["masters"], tiny_model_dir), autocast)
    bf16_compute = relative_difference(autocast, fp32)
    pure = relative_difference(change(runs["pure_bf16"], tiny_model_dir), fp32)
    print(f"relative L2 of the weight change after 4 AdamW steps: masters against autocast {masters:.2e}; "
          f"autocast against fp32 {bf16_compute:.2e}; pure bf16 against fp32 {pure:.2e}")
    assert masters < 1e-6 < bf16_compute
    assert pure > 10 * bf16_compute


def test_an_adapters_frozen_base_is_held_in_bf16_and_trains_autocasts_adapter_to_the_bit(tmp_path, tiny_model_dir,
                                                                                          data):
    """LoRA under bf16: the frozen base's matmul weights are held in bf16 (autocast's cast of them, made once), so
    the adapter after four AdamW steps (gradient checkpointing on: the recompute reads them too) is the one an fp32
    base under autocast gives, bit for bit, and the base holds, as planned, half the bytes."""
    keys = {**FOUR_ADAMW_STEPS, "bf16": True, "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
            "lora_target_linear": True, "gradient_checkpointing": True}
    held_bf16 = train(tmp_path, tiny_model_dir, data, "frozen_bf16", **keys)
    autocast = train(tmp_path, tiny_model_dir, data, "autocast", master_weights=False, **keys)
    plan = json.loads((held_bf16 / "plan.json").read_text())
    assert plan["resolved"]["precision"]["frozen_bf16"] is True
    assert "the frozen base's matmul weights held in bf16" in plan["precision"]
    assert json.loads((autocast / "plan.json").read_text())["resolved"]["precision"]["frozen_bf16"] is False
    ours, theirs = (load_file(out / "adapter_model.safetensors") for out in (held_bf16, autocast))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    trained = {key: value for key, value in ours.items() if "lora_B" in key}
    assert any(bool(value.abs().sum()) for value in trained.values())  # (B starts at 0: the adapter moved)

    matmul_weights = sum(tensor.numel() for name, tensor in load_file(tiny_model_dir / "model.safetensors").items()
                         if name.endswith("proj.weight"))
    held = json.loads((held_bf16 / "summary.json").read_text())["held_bytes_per_rank"][0]["weights"]
    held_fp32 = json.loads((autocast / "summary.json").read_text())["held_bytes_per_rank"][0]["weights"]
    assert held == held_fp32 - matmul_weights * 2 == plan["memory"]["per_rank_bytes"]["weights"]


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


def test_master_weights_true_beside_refused_sharding_keys_names_the_sharding_problem(tmp_path, tiny_model_dir, data):
    """(The engine is not known when its keys were refused: the master_weights rule must not trip over that.)"""
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, data, master_weights=True, bf16=True, fsdp=["full_shard", "auto_wrap"],
        fsdp_config={"mixed_precision_policy": "bf16"}))
    assert_user_error(run_in_process("check", str(config)), "mixed_precision_policy")


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_fp32_gradients_exist_only_between_the_last_backward_and_the_optimizer_step(tiny_model_dir, micro_batches):
    """The step's first micro-batch leaves its gradients in bf16 (no fp32 buffer beside its activations); the fp32
    ones are made after the last backward (one micro-batch) or before the next micro-batch (two), hold exactly the
    bf16 gradients' fp32 sum, and are let go after the step."""
    from transformers import AutoModelForCausalLM

    from tuneloop.engines.masters import MasterWeights

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    masters = MasterWeights(model, world_size=1)
    batches = [torch.randint(0, model.config.vocab_size, (2, 12)) for _ in range(micro_batches)]
    bf16_grads = []  # each micro-batch's bf16 gradient of every bf16 weight, seen as the backward makes it
    for index, ids in enumerate(batches):
        masters.before_micro_batch()
        if index == 1:  # the first micro-batch's gradients moved into fp32 before this one's activations
            assert masters.grads and all(held is None for held in masters.held)
        seen = {}
        hooks = [param.register_hook(lambda grad, i=i: seen.__setitem__(i, grad.clone()))
                 for i, param in enumerate(masters.compute)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for hook in hooks:
            hook.remove()
        bf16_grads.append(seen)
        if index == 0:
            assert not masters.grads and masters.flat_grad is None  # no fp32 gradient beside the activations
            assert all(held is not None and held.dtype == torch.bfloat16 for held in masters.held)
            assert all(param.grad is None for param in masters.compute)  # a second backward cannot add in bf16
    masters.finish_gradients()
    for i, master in enumerate(masters.masters):
        expected = bf16_grads[0][i].float()
        for later in bf16_grads[1:]:
            expected = expected + later[i].float()  # bf16 into fp32, in the backward's order
        assert master.grad.dtype == torch.float32 and torch.equal(master.grad, expected)
    masters.zero_grad()
    assert all(master.grad is None for master in masters.masters) and not masters.grads


def test_the_plan_counts_bf16_gradients_in_a_lone_micro_batchs_backward(tmp_path, tiny_model_dir, data):
    """One micro-batch a step: the backward holds the bf16 weights' gradients in bf16 (2 bytes, not 4), and the fp32
    ones the optimizer steps are counted after it; with two micro-batches the fp32 ones are held throughout."""
    plans = {}
    for steps in (1, 2):
        run_dir = tmp_path / f"accumulate_{steps}"
        run_dir.mkdir()
        keys = {**FOUR_ADAMW_STEPS, "gradient_accumulation_steps": steps}
        config = write_config(run_dir / "run.yml", **base_config(run_dir, tiny_model_dir, data, bf16=True, **keys))
        result = run_in_process("plan", str(config), "--json")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        plans[steps] = json.loads(result.stdout)
    matmul_weights = sum(tensor.numel() for name, tensor in load_file(tiny_model_dir / "model.safetensors").items()
                         if name.endswith("proj.weight"))
    lone, accumulated = plans[1]["memory"], plans[2]["memory"]
    assert plans[1]["resolved"]["precision"]["masters"] is True
    assert accumulated["gradients_after_backward_gb"] == 0.0
    assert lone["gradients_after_backward_gb"] == accumulated["gradients_gb"]
    assert lone["per_rank_bytes"]["gradients"] == accumulated["per_rank_bytes"]["gradients"] - matmul_weights * 2
    assert accumulated["per_rank_bytes"]["gradients"] == plans[2]["memory"]["trainable_parameters"] * 4
