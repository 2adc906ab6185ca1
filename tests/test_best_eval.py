"""Which eval is the best, and what keeps it: `save_strategy: best` checkpoints exactly the evals that improve
`metric_for_best_model`, `load_best_model_at_end` makes the best eval's weights the final model, and
`greater_is_better` turns the comparison around (the Trainer's keys, as axolotl passes them)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file

from tuneloop.config.load import config_from_dict
from tuneloop.errors import UserError
from tuneloop.run_files import complete_checkpoints
from tuneloop.train.guards import SIGNAL_AT_STEP_ENV
from tuneloop.train.state import RunState


def test_the_best_eval_is_the_lowest_loss_or_the_highest_of_another_metric():
    losses = RunState()
    assert [losses.record_eval(step, {"eval_loss": value}) for step, value in enumerate([3.0, 2.0, 2.0, 2.5, 1.0])] \
        == [False, True, False, False, True]  # (the eval before step 1 is never the best; a tie is no improvement)
    accuracy = RunState()
    name, greater = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "val_set_size": 0.1,
                                      "save_strategy": "best", "metric_for_best_model": "token_accuracy"}).best_metric
    assert (name, greater) == ("eval_token_accuracy", True)
    assert [accuracy.record_eval(step, {"eval_token_accuracy": value}, name, greater)
            for step, value in enumerate([0.1, 0.3, 0.2, 0.4], start=1)] == [True, True, False, True]
    assert accuracy.evals_without_improvement == 0 and accuracy.best_metric == 0.4


@pytest.mark.parametrize("keys, message", [
    ({"save_strategy": "best"}, "`save_strategy: best` picks the best of the evals, and this run has none"),
    ({"load_best_model_at_end": True, "val_set_size": 0.1, "eval_strategy": "no"}, "`load_best_model_at_end` picks"),
    ({"metric_for_best_model": "loss", "val_set_size": 0.1}, "nothing in this run uses the best eval"),
    ({"save_strategy": "best", "val_set_size": 0.1, "metric_for_best_model": "accuracy"},
     "`metric_for_best_model: accuracy` is not a metric this run's evals report (loss, perplexity, token_accuracy)"),
    ({"save_strategy": "best", "val_set_size": 0.1, "save_steps": 5}, "`save_strategy: best` saves at the evals"),
])
def test_best_eval_settings_that_cannot_work_are_refused_naming_the_key(keys, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], **keys})


def test_save_strategy_best_checkpoints_the_improving_evals_and_the_final_model_is_the_best(tmp_path, tiny_model_dir,
                                                                                          monkeypatch):
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(60, seed=21))
    # a learning rate this high makes the eval loss fall, then rise: some evals improve and some do not
    keys = dict(val_set_size=0.2, eval_steps=1, save_strategy="best", load_best_model_at_end=True,
                learning_rate=0.3, lr_scheduler="constant", num_epochs=2, max_grad_norm=0, micro_batch_size=8)
    config = write_config(tmp_path / "best.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    planned = run_in_process("plan", str(config))
    assert "at the evals that improve eval_loss, lower is better" in planned.stdout, planned.stdout
    assert "final model          the best eval's weights (eval_loss, lower is better)" in planned.stdout
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    plan = json.loads((out / "plan.json").read_text())
    evals = [(m["step"], m["eval_loss"]) for m in read_metrics(out) if "eval_loss" in m]
    improving = [step for i, (step, loss) in enumerate(evals) if all(loss < earlier for _, earlier in evals[:i])]
    assert 1 < len(improving) < len(evals), evals  # (the run shows both kinds)
    expected = [step for step in improving if step < plan["total_steps"]]  # (the last step saves the final model)
    assert [int(c.name.split("-")[1]) for c in complete_checkpoints(out)] == expected
    best_step = min(evals, key=lambda e: e[1])[0]
    assert best_step + 1 < plan["total_steps"]  # so the final model is not simply the last step's
    final = load_file(out / "model.safetensors")
    best_checkpoint = load_file(out / f"checkpoint-{best_step}" / "model.safetensors")
    assert all(torch.equal(final[key], best_checkpoint[key]) for key in final)

    # a signal after the best step writes a checkpoint that is not the best: with save_total_limit 1 the best
    # one stays beside it (the Trainer keeps it too), and the resumed run ends with the same final model
    limited = write_config(tmp_path / "limited.yml", **base_config(tmp_path / "limited", tiny_model_dir, data, **keys,
                                                                   save_total_limit=1,
                                                                   auto_resume_from_checkpoints=True))
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, f"0:{best_step + 1}")
    assert run_in_process("train", str(limited)).returncode != 0
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    kept = [c.name for c in complete_checkpoints(tmp_path / "limited" / "out")]
    assert kept == [f"checkpoint-{best_step}", f"checkpoint-{best_step + 1}"], kept
    assert run_in_process("train", str(limited)).returncode == 0
    resumed = load_file(tmp_path / "limited" / "out" / "model.safetensors")
    assert all(torch.equal(final[key], resumed[key]) for key in final)
