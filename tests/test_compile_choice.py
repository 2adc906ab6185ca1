"""`torch_compile: auto` (plan/compile_choice.py): compile where the run repays compiling, from what this machine
measured for the model; every finished run records its first step and pace; the plan says the decision, and a
run the plan compiles is counted with the compiled widths."""

from __future__ import annotations

import json

import pytest
from conftest import base_config, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.plan import compile_choice
from tuneloop.plan.compile_choice import decide, read_records, record_run
from tuneloop.train.loop import RunOutcome


def run(first: float, pace: float) -> dict:
    return {"first_step_seconds": first, "seconds_per_real_token": pace}


def test_measured_both_ways_it_compiles_only_where_the_steps_repay_the_first():
    records = {"k": {"eager": [run(5.0, 0.004)], "compiled": [run(15.0, 0.003)]}}  # +10 s, 1 ms a token saved
    on, why = decide(records, "k", 20_000, None, None)
    assert on and "adds 10 s" in why and "1.33×" in why and "saves ~20 s" in why
    on, why = decide(records, "k", 5_000, None, None)
    assert not on and "saves ~5 s" in why
    slower = {"k": {"eager": [run(5.0, 0.003)], "compiled": [run(6.0, 0.004)]}}
    assert not decide(slower, "k", 10**9, None, None)[0]


def test_unmeasured_it_compiles_only_runs_long_enough_to_hide_a_cold_compile():
    eager_only = {"k": {"eager": [run(5.0, 0.01)]}}
    assert decide(eager_only, "k", 10**6, None, None)[0]  # ~2.8 hours eager
    on, why = decide(eager_only, "k", 10_000, None, None)
    assert not on and "~2 min eager" in why and "torch_compile: true" in why
    # nothing measured: the model's FLOPs at the assumed MFU (1e9 FLOPs a token, 1e9 FLOPS: 2.2 s a token)
    assert decide({}, "k", 1_000, 1e9, 1e9)[0] and not decide({}, "k", 100, 1e9, 1e9)[0]
    # on a GPU a cold compile is a few seconds and gains more: a run of over 10 minutes eager compiles (2.2 s a token)
    assert decide({}, "k", 300, 1e9, 1e9, "cuda")[0] and not decide({}, "k", 300, 1e9, 1e9)[0]
    assert not decide({}, "k", 250, 1e9, 1e9, "cuda")[0]
    assert decide({}, "k", 10**9, None, None) == (
        False, "not measured here for this model, and the run's length cannot be estimated")


def outcome(steps: int, first: float, training: float, tokens: int, first_tokens: int = 100) -> RunOutcome:
    return RunOutcome(steps=steps, tokens=0, train_seconds=training + 5, real_tokens=tokens, first_step_seconds=first,
                      first_step_real_tokens=first_tokens, training_seconds=training)


def test_runs_are_recorded_the_last_three_kept_and_the_pace_is_their_median(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNELOOP_COMPILE_RECORDS", str(tmp_path / "records.json"))
    record_run("k", False, outcome(2, 1.0, 10.0, 1100), resumed=False)
    assert read_records() == {}  # two steps: no steady pace to speak of
    record_run("k", False, outcome(9, 1.0, 10.0, 1100), resumed=True)
    assert read_records() == {}  # a resumed session's first step reloads, its steps are not the run's
    # the pace: the steps after the first, without the evals and saves (train_seconds has 5 s of those)
    for first, training, tokens in ((4.0, 14.0, 1100), (3.0, 5.5, 1100), (2.0, 7.0, 1100), (1.0, 5.0, 1100)):
        record_run("k", False, outcome(5, first, training, tokens), resumed=False)
    kept = read_records()["k"]["eager"]
    assert [r["first_step_seconds"] for r in kept] == [3.0, 2.0, 1.0]
    assert compile_choice._measured(kept) == {"first_step_seconds": 1.0, "seconds_per_real_token": 4.0 / 1000}


def test_a_records_file_of_anything_else_leaves_the_plan_unmeasured(tmp_path, monkeypatch):
    path = tmp_path / "records.json"
    monkeypatch.setenv("TUNELOOP_COMPILE_RECORDS", str(path))
    for text in ("null", "[]", '{"k": 3}', '{"k": {"eager": [{"first_step_seconds": 1}]}}', "{not json"):
        path.write_text(text)
        assert decide(read_records(), "k", 10, None, None)[0] is False
    record_run("k", True, outcome(5, 1.0, 5.0, 1100), resumed=False)  # and a run still records over it
    assert len(read_records()["k"]["compiled"]) == 1


@pytest.fixture()
def tiny_run(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TUNELOOP_COMPILE_RECORDS", str(tmp_path / "records.json"))
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(24, seed=3))
    return write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=3,
                                                            sample_packing=False))


def test_the_plan_says_its_choice_and_counts_compiled_widths_when_it_compiles(tiny_run, tmp_path):
    planned = run_in_process("plan", str(tiny_run), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    eager = json.loads(planned.stdout)
    assert eager["torch_compile_choice"].startswith("auto: off, not measured both ways here for this model yet")
    assert eager["resolved"]["compiled"] is False and eager["torch_compile"] is None
    # this machine measured the model both ways, and compiling pays for itself many times over
    (tmp_path / "records.json").write_text(json.dumps(
        {eager["compile_key"]: {"eager": [run(1.0, 0.1)], "compiled": [run(2.0, 0.01)]}}))
    planned = run_in_process("plan", str(tiny_run), "--json")
    compiled = json.loads(planned.stdout)
    assert compiled["torch_compile_choice"].startswith("auto: on, measured here for this model: compiling adds 1 s")
    assert compiled["resolved"]["compiled"] is True and compiled["torch_compile"].startswith("torch.compile")
    assert compiled["max_micro_batch_tokens"] % (64 * 4) == 0  # widths rounded up for the compiled graph
    assert compiled["padding_fraction"] > eager["padding_fraction"]
    text = run_in_process("plan", str(tiny_run)).stdout
    assert "compile              auto: on, measured here" in text
    assert not any("torch_compile_mode" in warning for warning in compiled["warnings"])


def test_compile_settings_of_a_run_the_plan_does_not_compile_are_said(tiny_run):
    planned = run_in_process("plan", str(tiny_run), "--json", "--set", "torch_compile_mode=max-autotune")
    plan = json.loads(planned.stdout)
    assert plan["resolved"]["compiled"] is False
    assert any("`torch_compile_mode` given, but this run is not compiled (torch_compile: auto, and the plan decided "
               "against it)" in warning for warning in plan["warnings"])


def test_a_finished_run_records_its_pace_under_the_plans_key(tiny_run, tmp_path):
    trained = run_in_process("train", str(tiny_run))
    assert trained.returncode == 0, trained.stderr[-2000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    recorded = read_records()[plan["compile_key"]]["eager"]
    assert recorded[-1]["first_step_seconds"] == pytest.approx(summary["first_step_seconds"], abs=1e-3)
    # (this run has no evals or saves inside the loop: the summary's pace is the same, to its rounding)
    assert recorded[-1]["seconds_per_real_token"] == pytest.approx(
        1 / summary["real_tokens_per_second_after_first_step"], rel=1e-3)


def test_a_decision_handed_down_by_rank_0_is_the_plans_whatever_this_hosts_records_say(tiny_run):
    """With several ranks each plans from its own host's records, and every rank runs rank 0's decision
    (run.py hands it down): the plan built with it compiles, counts compiled widths and says whose it is."""
    import yaml

    from tuneloop.config import config_from_dict
    from tuneloop.plan.build import build_plan
    from tuneloop.resolved import resolve_run
    from tuneloop.run import prepare_data

    cfg = config_from_dict(yaml.safe_load(tiny_run.read_text()))
    resolved = resolve_run(cfg)
    tokenizer, rows = prepare_data(cfg, resolved)
    own = build_plan(cfg, resolved, rows, tokenizer, 2)
    assert own.compile_decision[0] is False  # nothing measured here
    handed = build_plan(cfg, resolved, rows, tokenizer, 2,
                        compile_decision=(True, "measured on rank 0's host (rank 0's decision)"))
    assert handed.resolved.compiled is True
    assert handed.torch_compile_choice == "auto: on, measured on rank 0's host (rank 0's decision)"
    assert handed.max_micro_batch_tokens % (64 * 4) == 0 and handed.total_steps == own.total_steps
