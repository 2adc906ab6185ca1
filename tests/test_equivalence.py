"""Correctness by equivalence, through the real `tuneloop train`:

- 4 micro-batches of 2 (accumulated) give the same update as one batch of 8, and the
  mean-of-micro-batch-means alternative would not;
- two DDP ranks (real processes, gloo) give the same update as one process.
Each run takes one SGD step with lr 1 and no clipping, so the weight change is the gradient.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from conftest import base_config, run_in_process, run_two_ranks, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.batching import epoch_micro_batches
from tuneloop.data.collate import Collator
from tuneloop.data.prepare import prepare
from tuneloop.plan.build import train_spec
from tuneloop.resolved import resolve_config
from tuneloop.train.objectives import summed_token_loss

ONE_SGD_STEP = {"optimizer": "sgd", "learning_rate": 1.0, "max_grad_norm": 0, "max_steps": 1,
                "lr_scheduler": "constant", "num_epochs": 1}


def one_step_update(tmp_path, model_dir, data, name, launcher: str | None = None, **keys) -> dict:
    """The weight change of one step: `tuneloop train` in this process, or on 2 ranks started by `launcher`
    (torchrun or accelerate)."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = write_config(run_dir / "run.yml", **base_config(run_dir, model_dir, data, **ONE_SGD_STEP, **keys))
    if launcher:
        result = run_two_ranks("train", str(config), kind=launcher)
    else:
        result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    after = load_file(run_dir / "out" / "model.safetensors")
    before = load_file(model_dir / "model.safetensors")
    return {key: after[key] - before[key] for key in before}


def relative_difference(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(a[k].pow(2).sum()) for k in a)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def uneven_data(tmp_path_factory):
    # lengths vary a lot between rows, so per-micro-batch token counts differ
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", tiny_rows(64, seed=3))


@pytest.fixture(scope="module")
def accumulated_update(tmp_path_factory, tiny_model_dir, uneven_data) -> dict:
    """One process, 4 micro-batches of 2: the reference the one-batch and the two-rank updates must equal."""
    return one_step_update(tmp_path_factory.mktemp("accum"), tiny_model_dir, uneven_data, "accum",
                           micro_batch_size=2, gradient_accumulation_steps=4)


def test_accumulating_4_micro_batches_of_2_equals_one_batch_of_8(tmp_path, tiny_model_dir, uneven_data,
                                                                accumulated_update):
    accumulated = accumulated_update
    one_batch = one_step_update(tmp_path, tiny_model_dir, uneven_data, "batch",
                                micro_batch_size=8, gradient_accumulation_steps=1)
    assert relative_difference(accumulated, one_batch) < 1e-5

    # the alternative most loops use — mean of micro-batch means — gives a different gradient
    cfg = config_from_dict(base_config(tmp_path / "accum", tiny_model_dir, uneven_data, **ONE_SGD_STEP,
                                       micro_batch_size=2))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prepared = prepare(cfg, tokenizer)
    micro = epoch_micro_batches(np.asarray(prepared.train["length"]), train_spec(cfg, resolve_config(cfg), 1), 0)[0][:4]
    collate = Collator(prepared.train, tokenizer.pad_token_id, packed=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    counts = []
    for rows in micro:
        batch = collate(rows)
        counts.append(batch.n_targets)
        loss = summed_token_loss(model(**batch.inputs).logits, batch.targets) / batch.n_targets / len(micro)
        loss.backward()
    assert len(set(counts)) > 1, "the micro-batches should hold different numbers of tokens"
    mean_of_means = {name: -param.grad for name, param in model.named_parameters()}
    difference = relative_difference(one_batch, {k: mean_of_means[k] for k in one_batch if k in mean_of_means})
    assert difference > 1e-2


@pytest.mark.slow
def test_two_ddp_ranks_started_by_accelerate_launch_equal_one_process(tmp_path, tiny_model_dir, uneven_data,
                                                                     accumulated_update):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU: two real gloo ranks (the same through torchrun, with
    every other feature's two-rank equality: test_ddp_equals_one_process.py)."""
    one_process = accumulated_update  # 4 micro-batches of 2 in one process
    two_ranks = one_step_update(tmp_path, tiny_model_dir, uneven_data, "ddp", launcher="accelerate",
                                micro_batch_size=2, gradient_accumulation_steps=2)
    plan = (tmp_path / "ddp" / "out" / "plan.json").read_text()
    assert '"world_size": 2' in plan and '"global_batch_size": 8' in plan
    assert relative_difference(two_ranks, one_process) < 1e-5
