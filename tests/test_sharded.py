"""Beyond one device's memory, exactly: FSDP2 and DeepSpeed ZeRO over real gloo ranks (torchrun) end with the same
weights as one process on the same global batch, resume exactly after a SIGKILL, and leave a folder that loads with
`from_pretrained` alone. Equality is asserted in fp32 (`bf16: false`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import base_config, free_port, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file

STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-2, "max_grad_norm": 1.0, "max_steps": 3,
         "lr_scheduler": "cosine", "warmup_steps": 1, "num_epochs": 1}
FSDP = {"fsdp": ["full_shard", "auto_wrap"],
        "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                        "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}


def torchrun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "tuneloop", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def trained(tmp_path, model_dir, data, name, ranks: int, **keys) -> dict:
    """The weights after STEPS: one process (micro-batch 2 × 4 accumulated) or 2 ranks (2 × 2 each). The plan and
    the summary are checked on the way: the plan's memory per rank against what each rank held."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    accumulation = 4 // ranks
    config = write_config(run_dir / "run.yml", **base_config(run_dir, model_dir, data, **STEPS, micro_batch_size=2,
                                                             gradient_accumulation_steps=accumulation, **keys))
    result = torchrun("train", str(config)) if ranks == 2 else run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    plan = json.loads((run_dir / "out" / "plan.json").read_text())
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["steps"] == plan["total_steps"] == STEPS["max_steps"]
    held, planned = summary["held_bytes_per_rank"], plan["memory"]["per_rank_bytes"]
    assert len(held) == ranks
    for rank in held:  # the plan's bytes per rank are the engine's own, within the padding of uneven shards
        for part in ("weights", "optimizer"):
            assert rank[part] == pytest.approx(planned[part], rel=0.03), (part, held, planned)
    return load_file(run_dir / "out" / "model.safetensors")


def relative_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", tiny_rows(64, seed=3))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, data) -> dict:
    return {packed: trained(tmp_path_factory.mktemp("one"), tiny_model_dir, data, "one", 1, sample_packing=packed)
            for packed in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_two_fsdp2_ranks_equal_one_process(tmp_path, tiny_model_dir, data, one_process, packed):
    two = trained(tmp_path, tiny_model_dir, data, "fsdp", 2, sample_packing=packed, **FSDP)
    plan = json.loads((tmp_path / "fsdp" / "out" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["global_batch_size"] == 8
    assert relative_difference(two, one_process[packed]) < 1e-5


def deepspeed_keys(stage: int) -> dict:
    return {"deepspeed": f"zero{stage}"}  # a config shipped with tuneloop, by name


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_deepspeed_zero_ranks_equal_one_process(tmp_path, tiny_model_dir, data, one_process, stage):
    two = trained(tmp_path, tiny_model_dir, data, "zero", 2, sample_packing=False, **deepspeed_keys(stage))
    assert relative_difference(two, one_process[False]) < 1e-5


RESUMABLE = dict(micro_batch_size=2, max_steps=8, save_strategy=None, save_steps=3, learning_rate=1e-2,
                 warmup_steps=2, val_set_size=0.15, eval_steps=8, auto_resume_from_checkpoints=True,
                 optimizer="adamw_torch")
ENGINE_KEYS = {"fsdp2": FSDP, "zero2": deepspeed_keys(2), "zero3": deepspeed_keys(3)}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINE_KEYS)
def test_a_sharded_run_killed_mid_save_resumes_bit_identical_and_leaves_a_plain_hf_folder(
        tmp_path, tiny_model_dir, data, engine):
    """Rank 0 is SIGKILLed while writing checkpoint-6 (its shards already in); the resume from checkpoint-3 ends
    with the weights of the uninterrupted run, bit for bit. The final folder loads with from_pretrained alone and
    gives the eval loss the sharded model gave at the last step."""
    from tuneloop.run_files import complete_checkpoints
    from tuneloop.train.checkpoint import CRASH_DURING_SAVE_ENV
    from tuneloop.train.engines import SHARDS

    def run(name: str, env: dict | None = None) -> subprocess.CompletedProcess:
        run_dir = tmp_path / name
        run_dir.mkdir(exist_ok=True)
        config = write_config(run_dir / "run.yml",
                              **base_config(run_dir, tiny_model_dir, data, **RESUMABLE, **ENGINE_KEYS[engine]))
        return torchrun("train", str(config), env=env)

    straight = run("straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = run("crashed", env={CRASH_DURING_SAVE_ENV: "6"})
    assert crashed.returncode != 0
    out = tmp_path / "crashed" / "out"
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-3"]
    assert (out / "checkpoint-3" / SHARDS).is_dir()  # each rank's piece of the weights and optimizer state
    resumed = run("crashed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    expected = load_file(tmp_path / "straight" / "out" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    # the gathered folder is a plain Hugging Face model: `tuneloop eval` loads it with from_pretrained alone
    last_eval = [m for m in read_metrics(out) if "eval_loss" in m][-1]
    assert last_eval["step"] == RESUMABLE["max_steps"]
    evaluated = run_in_process("eval", str(tmp_path / "crashed" / "run.yml"))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(
        last_eval["eval_loss"], rel=1e-6)
