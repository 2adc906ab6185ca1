"""The learning-rate schedule follows the plan's warm-up and total steps."""

from __future__ import annotations

import math

import pytest

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
