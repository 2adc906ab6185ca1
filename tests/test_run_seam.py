"""The entry point below the command line: a run composed from a config, watched through hooks.

The hooks see what the run does (the plan, every micro-batch, every metrics line, every phase), and two
runs with different precisions follow each other in one process."""

from __future__ import annotations

import contextlib
import json

from conftest import base_config, read_metrics, tiny_rows, write_config, write_jsonl

from tuneloop.config import load_run_config
from tuneloop.run import TrainingSession
from tuneloop.train.hooks import RunHooks


class Recorder(RunHooks):
    def __init__(self):
        self.plans, self.records, self.batches, self.phases, self.events = [], [], [], {}, []

    def planned(self, plan, resume_from):
        self.plans.append((plan, resume_from))

    def logged(self, record):
        self.records.append(record)

    def micro_batch(self, batch):
        self.batches.append(batch)

    @contextlib.contextmanager
    def _counted(self, name):
        self.phases[name] = self.phases.get(name, 0) + 1
        yield

    def phase(self, name):
        return self._counted(name)

    def loop_started(self):
        self.events.append("started")

    def loop_ended(self, model):
        self.events.append(("ended", type(model).__name__))


def test_a_session_runs_the_plan_and_tells_the_hooks_everything(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(40, seed=8))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, val_set_size=0.1,
                                                              gradient_accumulation_steps=2, num_epochs=2))
    hooks = Recorder()
    with TrainingSession(load_run_config(config), hooks) as session:
        result = session.run()
    assert result.error is None and not result.stopped_by_signal
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert [p.to_json() for p, _ in hooks.plans] == [plan] and hooks.plans[0][1] is None
    assert hooks.records == read_metrics(tmp_path / "out")  # every line of metrics.jsonl, in order
    assert len(hooks.batches) == plan["micro_batches_per_epoch"] * 2
    assert sum(batch.n_targets for batch in hooks.batches) == plan["total_trainable_tokens"]
    micro = len(hooks.batches)
    assert {name: hooks.phases[name] for name in ("collate", "forward and loss", "backward")} == dict.fromkeys(
        ("collate", "forward and loss", "backward"), micro)
    assert hooks.phases["optimizer step"] == plan["total_steps"] == result.summary["steps"]
    assert hooks.phases["sampler"] == 2 and hooks.phases["eval"] == plan["eval_count"]
    assert hooks.events == ["started", ("ended", "LlamaForCausalLM")]


def test_runs_with_different_precisions_follow_each_other_in_one_process(tmp_path, tiny_model_dir):
    """accelerate refuses a second Accelerator with another mixed precision in one process; a session
    forgets accelerate's state when it ends, so a notebook (or this suite) can run one config after another."""
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(16, seed=9))
    for precision in ("true", "false", "true"):
        cfg = load_run_config(write_config(tmp_path / "run.yml", **base_config(tmp_path / precision,
                                                                               tiny_model_dir, data, max_steps=2)),
                              [f"bf16={precision}"])
        with TrainingSession(cfg) as session:
            result = session.run(overwrite=True)
            assert session.accelerator.mixed_precision == ("bf16" if precision == "true" else "no")
        assert result.error is None and result.summary["steps"] == 2
