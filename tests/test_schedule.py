"""The learning-rate schedules follow the plan's warm-up and total steps."""

from __future__ import annotations

import math

import pytest
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.optim import lr_multiplier


class Plan:
    def __init__(self, warmup_steps, total_steps):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps


def test_warmup_rises_linearly_to_the_peak_then_cosine_decays_to_the_floor():
    plan = Plan(warmup_steps=4, total_steps=24)
    values = [lr_multiplier(step, plan, "cosine", 0.1) for step in range(24)]
    assert values[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))  # non-increasing after warm-up
    assert values[14] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(24, plan, "cosine", 0.1) == pytest.approx(0.1)


def test_linear_and_constant():
    plan = Plan(warmup_steps=0, total_steps=10)
    assert [lr_multiplier(s, plan, "linear", 0.0) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert {lr_multiplier(s, plan, "constant", 0.0) for s in range(10)} == {1.0}


# ---- one_cycle: axolotl's OneCycleLR schedule, through the real run -------------------------------

def test_one_cycle_rises_from_lr_over_div_factor_through_the_warmup_then_anneals_far_below(tmp_path,
                                                                                            tiny_model_dir):
    keys = dict(lr_scheduler="one_cycle", lr_div_factor=4, warmup_steps=3, max_steps=10, learning_rate=1e-3,
                micro_batch_size=2)
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data_file(tmp_path), **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    rates = [m["lr"] for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert len(rates) == 10
    assert rates[0] == pytest.approx(1e-3 / 4)  # the first update runs at learning_rate / lr_div_factor
    # the peak is the last of the 3 warm-up updates (torch's OneCycleLR ends its rise at step
    # pct_start * total - 1), then the rate only falls
    assert rates[2] == pytest.approx(1e-3)
    assert rates[0] < rates[1] < rates[2] and all(a > b for a, b in zip(rates[2:], rates[3:]))
    assert rates[-1] < 1e-3 / 4 / 10  # annealed far below where it started (to 1e4 times less at the end)


def test_one_cycle_defaults_to_axolotls_div_factor_and_cycles_adams_beta1():
    import torch

    from tuneloop.config import config_from_dict
    from tuneloop.optim import build_scheduler

    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "lr_scheduler": "one_cycle",
                            "learning_rate": 6e-4})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.learning_rate)
    scheduler = build_scheduler(cfg, Plan(warmup_steps=2, total_steps=8), optimizer)
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4)  # 6e-4 / 6
    betas = []
    for _ in range(8):
        betas.append(optimizer.param_groups[0]["betas"][0])
        optimizer.step()
        scheduler.step()
    assert betas[0] == pytest.approx(0.95) and betas[1] == pytest.approx(0.85) and betas[-1] > betas[1]


def test_lr_div_factor_with_another_scheduler_is_refused():
    from tuneloop.config import config_from_dict
    from tuneloop.errors import UserError

    with pytest.raises(UserError, match="`lr_div_factor` only shapes `lr_scheduler: one_cycle`"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "lr_div_factor": 10})


def test_one_cycle_resumes_exactly_from_a_checkpoint(tmp_path, tiny_model_dir):
    """Its state (the step in the cycle) goes into the checkpoint: a run resumed from step 3 ends with the
    weights of the uninterrupted run."""
    from safetensors.torch import load_file

    keys = dict(lr_scheduler="one_cycle", warmup_steps=2, max_steps=6, learning_rate=1e-2, micro_batch_size=2,
                save_strategy=None, save_steps=3, auto_resume_from_checkpoints=True)
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data_file(tmp_path), **keys))
    assert run_in_process("train", str(config)).returncode == 0
    out = tmp_path / "out"
    straight = load_file(out / "model.safetensors")
    for name in ("summary.json", "model.safetensors"):  # as if killed after the checkpoint of step 3
        (out / name).unlink()
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout and "checkpoint-3" in resumed.stdout
    again = load_file(out / "model.safetensors")
    assert all(torch_equal(straight[k], again[k]) for k in straight)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def data_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", tiny_rows(40, seed=4))


def test_quadratic_warmup_rises_as_the_square_of_the_linear_one():
    plan = Plan(warmup_steps=4, total_steps=24)
    linear = [lr_multiplier(step, plan, "cosine", 0.0) for step in range(24)]
    quadratic = [lr_multiplier(step, plan, "cosine", 0.0, quadratic_warmup=True) for step in range(24)]
    assert quadratic[:4] == pytest.approx([0.04, 0.16, 0.36, 0.64])
    assert quadratic[4:] == linear[4:]  # the decay is untouched


def test_cosine_constant_lr_ratio_ends_the_decay_early_then_holds_the_floor():
    """axolotl's warm-up, decay, constant: the floor is reached at int(total × ratio) and held."""
    plan = Plan(warmup_steps=2, total_steps=20)
    values = [lr_multiplier(step, plan, "cosine", 0.1, decay_end_ratio=0.5) for step in range(20)]
    assert values[2] == pytest.approx(1.0)
    assert values[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway from 2 to 10
    assert values[10:] == pytest.approx([0.1] * 10)
    assert values[9] > 0.1


def test_the_plan_names_the_schedules_shape_and_the_run_follows_it(tmp_path, tiny_model_dir):
    keys = dict(lr_scheduler="cosine", warmup_steps=2, max_steps=8, learning_rate=1e-3, micro_batch_size=2,
                lr_quadratic_warmup=True, cosine_constant_lr_ratio=0.5, cosine_min_lr_ratio=0.2, save_strategy="no")
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data_file(tmp_path), **keys))
    planned = run_in_process("plan", str(config))
    assert "cosine (quadratic warm-up; decay to 0.2× by 50% of the run, then constant) schedule" in planned.stdout
    assert run_in_process("train", str(config)).returncode == 0
    rates = [m["lr"] for m in read_metrics(tmp_path / "out") if "lr" in m]
    expected = [1e-3 * lr_multiplier(step, Plan(2, 8), "cosine", 0.2, True, 0.5) for step in range(8)]
    assert rates == pytest.approx(expected)
    assert rates[0] == pytest.approx(1e-3 / 9) and rates[4:] == pytest.approx([2e-4] * 4)
