"""Registries: a capability is one entry, and everything that needs to know about it reads the entry.

The unknown-name errors list exactly the registered names; every registered optimizer builds and has a
memory figure; every scheduler runs a whole plan; an optimizer that needs a GPU is refused before training;
and the run state survives a checkpoint whole (a counter added to it cannot be saved and forgotten)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneloop.config import config_from_dict
from tuneloop.data.formats import FORMATS
from tuneloop.errors import UserError
from tuneloop.hardware import check_hardware
from tuneloop.optim import OPTIMIZERS, SCHEDULERS, OptimizerKind, build_optimizer, build_scheduler
from tuneloop.registry import Registry
from tuneloop.train.state import RunState

MINIMAL = {"base_model": "m", "datasets": [{"path": "x"}]}


def error_of(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        config_from_dict(raw)
    return str(caught.value)


@pytest.mark.parametrize("key, registry", [("optimizer", OPTIMIZERS), ("lr_scheduler", SCHEDULERS)])
def test_an_unknown_name_is_refused_with_the_registrys_own_list(key, registry):
    message = error_of({**MINIMAL, key: "no_such_thing"})
    assert f"`{key}` got 'no_such_thing'" in message
    assert all(repr(name) in message for name in registry.names())


def test_an_unknown_dataset_type_lists_the_registered_formats():
    message = error_of({"base_model": "m", "datasets": [{"path": "x", "type": "no_such_format"}]})
    assert "unknown dataset type 'no_such_format'" in message
    assert all(repr(name) in message for name in FORMATS.names())


def test_aliases_answer_for_their_entry_and_a_name_cannot_be_taken_twice():
    table: Registry[str] = Registry("thing", "thing")
    table.add("alpaca", "renderer", aliases=("alpaca:chat",))
    assert table["alpaca:chat"] == "renderer" and table.canonical("alpaca:chat") == "alpaca"
    assert table.names() == ["alpaca", "alpaca:chat"]
    with pytest.raises(ValueError, match="registered twice"):
        table.add("other", "x", aliases=("alpaca",))


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_optimizer_builds_or_is_refused_and_the_memory_estimate_knows_its_state(name, tiny_model_dir):
    from tuneloop.memory import estimate_memory
    from tuneloop.model import model_facts

    cfg = config_from_dict({**MINIMAL, "base_model": str(tiny_model_dir), "optimizer": name})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = sum(p.numel() for p in model.parameters())
    estimate = estimate_memory(cfg, model_facts(cfg), tokens_per_micro_batch=64, precision="no")
    assert estimate.optimizer_gb == round(trained * OPTIMIZERS[name].state_bytes_per_param / 1e9, 3)
    if OPTIMIZERS[name].needs_cuda and not torch.cuda.is_available():
        with pytest.raises(UserError, match=f"`optimizer: {name}` needs a CUDA GPU"):
            check_hardware(cfg)  # what `train` does before loading anything
        return
    check_hardware(cfg)
    optimizer = build_optimizer(cfg, model)
    model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    optimizer.step()


class Plan:
    def __init__(self, warmup_steps: int, total_steps: int):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps


@pytest.mark.parametrize("name", SCHEDULERS.names())
def test_every_scheduler_runs_a_whole_plan_with_finite_positive_rates(name):
    cfg = config_from_dict({**MINIMAL, "lr_scheduler": name, "learning_rate": 1e-3})
    parameter = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([parameter], lr=cfg.learning_rate)
    scheduler = build_scheduler(cfg, Plan(warmup_steps=3, total_steps=20), optimizer)
    rates = []
    for _ in range(20):  # the loop steps the scheduler once per optimizer step, total_steps times
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert all(math.isfinite(rate) and 0 < rate <= cfg.learning_rate * (1 + 1e-9) for rate in rates)
    assert max(rates) == pytest.approx(cfg.learning_rate, rel=0.2)


def test_an_optimizer_that_needs_a_gpu_is_refused_on_a_machine_without_one(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    gpu_only = OptimizerKind(build=lambda groups, cfg: None, state_bytes_per_param=2, needs_cuda=True)
    monkeypatch.setitem(OPTIMIZERS._entries, "gpu_only_test", gpu_only)
    monkeypatch.setitem(OPTIMIZERS._canonical, "gpu_only_test", "gpu_only_test")
    cfg = config_from_dict({**MINIMAL, "optimizer": "gpu_only_test"})
    with pytest.raises(UserError, match="`optimizer: gpu_only_test` needs a CUDA GPU"):
        check_hardware(cfg)


def test_the_run_state_survives_a_checkpoint_whole():
    """Every field, set away from its default, comes back from the checkpoint's JSON: a counter added to
    RunState and forgotten in to_json/from_json fails here."""
    state = RunState(step=7, tokens_seen=1234, targets_collated=600,
                     evals=[{"step": 4, "eval_loss": 2.5}, {"step": 7, "eval_loss": 2.75}],
                     best_eval_loss=2.5, evals_without_improvement=1, bad_steps_in_a_row=[0, 2])
    defaults = RunState()
    for field in dataclasses.fields(RunState):
        assert getattr(state, field.name) != getattr(defaults, field.name), f"set {field.name} in this test"
    saved = state.to_json(targets_per_rank=[600, 634], streaks_per_rank=[[0, 2], [1, 0]])
    assert RunState.from_json(saved, rank=0, world_size=2) == state
    assert RunState.from_json(saved, rank=1, world_size=2).targets_collated == 634
    assert RunState.from_json(saved, rank=1, world_size=2).bad_steps_in_a_row == [1, 0]
    # a forced resume on another number of ranks cannot split the per-rank counts: they restart at 0,
    # while the watchdog keeps the longest streak any old rank had
    alone = RunState.from_json(saved, rank=0, world_size=1)
    assert alone.targets_collated == 0 and alone.bad_steps_in_a_row == [1, 2]
