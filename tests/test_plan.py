"""Plan == run: the plan's total_steps and token count are what the loop really does, for packing on
and off, accumulation 1 and >1, max_steps set and not, one rank and two; and the plan's warnings
fire where they should and stay silent on a clean config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.config import config_from_dict
from tuneloop.data.prepare import PreparedData, PrepareStats
from tuneloop.data.source import PreparedRows
from tuneloop.plan.build import data_plan
from tuneloop.resolved import resolve_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("plan_data") / "train.jsonl", tiny_rows(90, seed=11))


CASES = {
    "padded_accum1": dict(micro_batch_size=4, gradient_accumulation_steps=1, num_epochs=2),
    "padded_accum3_partial_window": dict(micro_batch_size=4, gradient_accumulation_steps=3, num_epochs=2),
    "packed_accum2": dict(sample_packing=True, sequence_len=256, micro_batch_size=2, gradient_accumulation_steps=2,
                          num_epochs=2),
    "grouped_max_steps": dict(group_by_length=True, micro_batch_size=4, gradient_accumulation_steps=2,
                              max_steps=13, num_epochs=1),
    "token_budget_accum2": dict(max_tokens_per_micro_batch=256, micro_batch_size=8, gradient_accumulation_steps=2,
                                num_epochs=2),
}


@pytest.mark.parametrize("case", CASES)
def test_plan_total_steps_and_tokens_equal_the_run(tmp_path, tiny_model_dir, data, case):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **CASES[case]))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    steps = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, plan["total_steps"] + 1))
    assert steps[-1]["tokens"] == plan["total_trainable_tokens"]
    # the collator's own count of target tokens (the loss's denominators) agrees with the plan
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["targets_collated"] == plan["total_trainable_tokens"] and summary["steps"] == plan["total_steps"]
    if case == "padded_accum3_partial_window":
        assert plan["micro_batches_per_epoch"] % 3 != 0  # the case really ends an epoch on a short window
    if case == "grouped_max_steps":
        assert plan["total_steps"] == 13
    if case == "token_budget_accum2":  # long rows' micro-batches hold fewer of them, none past the budget
        assert plan["batching"] == "token_budget" and plan["max_micro_batch_tokens"] <= 256
        assert "at most 256 tokens a micro-batch as padded" in result.stdout


def budgeted(lengths, budget: int, rows: int, epoch: int = 0, pad_multiple: int = 1):
    from tuneloop.data.batching import BatchingSpec, epoch_batches

    spec = BatchingSpec("token_budget", rows, 512, 1, seed=3, token_budget=budget, pad_multiple=pad_multiple)
    return epoch_batches(np.asarray(lengths), spec, epoch)


def test_a_token_budget_holds_fewer_long_rows_and_every_epoch_as_many_micro_batches():
    """Rows of 10 to 500 tokens under 1024 tokens a micro-batch (8 rows at most): each micro-batch's rows × its
    widest row's width (rounded up to the collator's multiple of 64) stay within the budget, every row is dealt
    once, the long rows share micro-batches with fewer others; another epoch's shuffle deals as many."""
    lengths = np.random.default_rng(0).integers(10, 500, 300)
    epochs = [budgeted(lengths, 1024, 8, epoch, pad_multiple=64) for epoch in range(3)]
    for micro in epochs:
        assert sorted(row[0] for batch in micro for row in batch) == list(range(300))
        for batch in micro:
            longest = max(int(lengths[row[0]]) for row in batch)
            width = min(-(-longest // 64) * 64, 512)
            assert len(batch) <= 8 and len(batch) * width <= 1024
        widest = {size: [max(int(lengths[row[0]]) for row in batch) for batch in micro if len(batch) == size]
                  for size in (2, 8)}
        assert min(widest[2]) > max(widest[8])  # (the longest rows go two by two, the short eight by eight)
    assert len({len(micro) for micro in epochs}) == 1 and epochs[0] != epochs[1]


@pytest.mark.parametrize("keys, fragment", [
    (dict(max_tokens_per_micro_batch=100), "below sequence_len (256)"),
    (dict(max_tokens_per_micro_batch=1024, sample_packing=True), "cannot be used with `sample_packing: true`"),
    (dict(max_tokens_per_micro_batch=1024, pad_to_sequence_len=True), "`pad_to_sequence_len: true`"),
])
def test_a_token_budget_that_cannot_apply_is_one_line(tmp_path, tiny_model_dir, data, keys, fragment):
    from conftest import assert_user_error

    config = tmp_path / "run.yml"
    import yaml

    config.write_text(yaml.safe_dump(base_config(tmp_path, tiny_model_dir, data, **keys)))
    assert_user_error(run_in_process("plan", str(config)), "max_tokens_per_micro_batch", fragment)


# ---- warnings ----------------------------------------------------------------------------------

class ArrayStore:
    """The columns of a prepared store that the plan reads, over arrays (no tokenizer, no files)."""

    group = 1

    def __init__(self, lengths: np.ndarray, targets: np.ndarray):
        self.columns = {"length": lengths, "n_targets": targets}

    def unit_column(self, name: str) -> np.ndarray:
        return self.columns[name]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    @property
    def units(self) -> int:
        return len(self.columns["length"])


def plan_for(lengths, targets=None, eval_rows=10, dropped=0, world_size=1, **keys):
    """The plan of the data alone, for rows of these lengths (and trained tokens)."""
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], **keys})
    lengths = np.asarray(lengths)
    targets = np.asarray(targets if targets is not None else lengths // 2)
    prepared = PreparedData(ArrayStore(lengths, targets), None,
                            PrepareStats(eval_rows=eval_rows, dropped_too_long=dropped), Path("cache"))
    return data_plan(cfg, resolve_config(cfg), PreparedRows(prepared, encoder_decoder=False), world_size)


UNIFORM = [100] * 400


def test_clean_config_has_no_warnings():
    plan = plan_for(UNIFORM, micro_batch_size=4, gradient_accumulation_steps=2, num_epochs=2, warmup_ratio=0.05)
    assert plan.warnings == []


def test_max_steps_covering_world_size_times_the_epochs_says_per_device():
    # 400 rows / (4 rows × 2 ranks) = 50 steps per epoch: max_steps=50 is 1 pass where num_epochs says 2,
    # and that ratio (2) is the world size
    plan = plan_for(UNIFORM, world_size=2, micro_batch_size=4, num_epochs=2, max_steps=50)
    assert any("covers 1 passes" in w and "world size (2)" in w and "per-device" in w for w in plan.warnings)
    other = plan_for(UNIFORM, micro_batch_size=4, num_epochs=2, max_steps=30)
    assert any("max_steps=30" in w for w in other.warnings)
    assert not any("per-device" in w for w in other.warnings)


def test_a_few_steps_of_a_huge_epoch_are_planned_and_said_as_a_tiny_share_of_a_pass():
    # 2 steps of 100,000 per epoch: epochs_covered rounds to 0.0, and the warning once divided by it
    plan = plan_for([100] * 100_000, micro_batch_size=1, max_steps=2)
    assert plan.total_steps == 2 and plan.epochs_covered == 0.0
    assert any("covers 2e-05 passes" in w for w in plan.warnings), plan.warnings


def test_padding_waste_above_20_percent_without_packing():
    lengths = np.random.default_rng(0).integers(20, 512, size=400)
    assert any("padding" in w for w in plan_for(lengths, micro_batch_size=8, sequence_len=512).warnings)
    assert not any("padding" in w for w in plan_for(lengths, micro_batch_size=8, sequence_len=512,
                                                    sample_packing=True).warnings)


def test_frequent_evals_and_saves():
    plan = plan_for(UNIFORM, micro_batch_size=1, eval_steps=2, save_steps=3)
    assert any("200 evals" in w for w in plan.warnings) and any("saves" in w for w in plan.warnings)


def test_sequence_len_dropping_more_than_one_percent():
    assert any("drops 20 of 420 rows" in w for w in plan_for(UNIFORM, eval_rows=0, dropped=20).warnings)


def test_global_batch_larger_than_the_data_and_warmup_as_long_as_the_run():
    plan = plan_for([50] * 10, micro_batch_size=4, gradient_accumulation_steps=8, warmup_steps=5)
    assert any("larger than one epoch" in w for w in plan.warnings)
    assert any("warm-up (5 steps) is as long as the run" in w for w in plan.warnings)


def test_memory_estimate_counts_the_real_parameters_and_warns_above_the_device(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tuneloop.model.kinds import MODEL_KINDS
    from tuneloop.plan.model_facts import model_facts
    from tuneloop.plan.memory import MemoryEstimate, estimate_memory, memory_warning

    cfg = config_from_dict({"base_model": str(tiny_model_dir), "datasets": [{"path": "x"}]})
    facts = model_facts(cfg, MODEL_KINDS["causal"])
    engine = resolve_config(cfg).engine
    estimate = estimate_memory(cfg, facts, tokens_per_micro_batch=4096, precision="no", engine=engine)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert estimate.parameters == estimate.trainable_parameters == real
    assert estimate.weights_gb == round(real * 4 / 1e9, 3) and estimate.optimizer_gb == round(real * 8 / 1e9, 3)
    bigger = estimate_memory(cfg, facts, tokens_per_micro_batch=8192, precision="no", engine=engine)
    assert bigger.activations_gb > estimate.activations_gb

    assert memory_warning(estimate) is None  # 0.1 GB on this machine
    too_big = MemoryEstimate(parameters=10**10, trainable_parameters=10**10, weights_gb=40.0, gradients_gb=40.0,
                             optimizer_gb=80.0, activations_gb=20.0, total_gb=180.0, device="NVIDIA H200",
                             device_gb=143.8)
    warning = memory_warning(too_big)
    assert "estimated memory 180.0 GB" in warning and "144 GB of NVIDIA H200" in warning
