"""What `tuneloop train` shows: a live bar on a terminal, plain lines elsewhere, and a last line that says what
summary.json says (the time split and the peak memory beside the plan's estimate)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl

from tuneloop.console import ProgressBar


class Terminal(io.StringIO):
    """A stdout that says it is a terminal, and keeps what was written to it."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """The 120 columns a terminal without a size gets (pytest-xdist sets COLUMNS=80 in its workers)."""
    monkeypatch.setenv("COLUMNS", "120")


def test_on_a_terminal_a_live_bar_counts_the_plan_and_eval_lines_stay_above_it(tmp_path, tiny_model_dir):
    from tuneloop.cli import main

    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(40))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, val_set_size=0.2,
                                                              eval_steps=4, max_steps=8, logging_steps=2))
    screen, errors = Terminal(), io.StringIO()
    with contextlib.redirect_stdout(screen), contextlib.redirect_stderr(errors):
        assert main(["train", str(config)]) == 0, errors.getvalue()[-2000:]
    text = screen.getvalue().replace("\x1b[K", "")  # the erase-to-end-of-line codes
    draws = [draw for line in text.split("\n") for draw in line.split("\r") if draw.startswith("step ")]
    final_bar = [draw for draw in draws if draw.startswith("step 8/8 [")]
    assert final_bar and "100%" in final_bar[-1] and "loss " in final_bar[-1] and " GB" in final_bar[-1]
    assert any(re.match(r"step \d/8 \[#*\.+\] \d+% .*\| left \d+m\d\ds", draw) for draw in draws), draws
    # eval lines are printed whole, each on a line of its own; train lines are not printed, the bar shows them
    evals = [line.split("\r")[-1] for line in text.split("\n") if "eval_loss" in line]
    assert len(evals) == 2 and all(line.startswith(("step 4/8 | ", "step 8/8 | ")) for line in evals), evals
    assert not any(line.split("\r")[-1].startswith("step 2/8 | ") for line in text.split("\n"))
    assert text.rstrip("\n").split("\n")[-1].startswith("done: 8 steps in ")


def test_the_last_line_and_summary_json_say_the_same_time_split_and_memory(tmp_path, tiny_model_dir):

    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(40))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, val_set_size=0.2,
                                                              eval_steps=4, max_steps=8, save_steps=4,
                                                              save_strategy="steps", eval_on_start=True))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    seconds, memory = summary["seconds"], summary["peak_memory_gb"]
    assert set(seconds) == {"data", "model_load", "training", "eval", "saving", "total"}
    assert all(value >= 0 for value in seconds.values())
    assert seconds["eval"] > 0 and seconds["saving"] > 0  # three evals (steps 0, 4, 8), two checkpoints and a model
    parts = sum(seconds[key] for key in ("data", "model_load", "training", "eval", "saving"))
    assert parts <= seconds["total"] + 0.05
    assert seconds["training"] + seconds["eval"] <= summary["train_seconds"] + seconds["eval"] + 0.05
    assert memory["host_rss"] > 0.2 and memory["cuda_allocated"] is None  # torch alone is more than 0.2 GB
    assert memory["estimated"] == plan["estimated_memory_gb"]
    last = result.stdout.strip().splitlines()[-1]
    assert (f"time: data {seconds['data']:.1f} s, model load {seconds['model_load']:.1f} s, training "
            f"{seconds['training']:.1f} s, eval {seconds['eval']:.1f} s, saving {seconds['saving']:.1f} s, total "
            f"{seconds['total']:.1f} s") in last
    assert f"peak memory {memory['host_rss']:.2f} GB host RSS (plan estimate {memory['estimated']:.2f} GB)" in last
    assert f"eval loss {summary['first_eval_loss']:.4f} (step 0) → {summary['last_eval_loss']:.4f} (step 8)" in last
    assert [m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m][-1] == summary["last_eval_loss"]


def test_the_bar_redraws_in_place_and_keeps_printed_lines_above_it(monkeypatch):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr("tuneloop.console.time.perf_counter", lambda: next(clock))
    screen = Terminal()
    bar = ProgressBar(screen, total_steps=4)
    bar.stepped(1)
    bar.train_line({"step": 1, "loss": 2.5, "lr": 1e-3, "real_tokens_per_second": 120.0, "mfu": 0.31})
    bar.above("step 1/4 | eval_loss 2.4")
    bar.stepped(4)
    bar.close()
    text = screen.getvalue()
    assert text.endswith("\n") and "\r\x1b[K" in text  # the bar is erased before a line is printed over it
    lines = text.split("\n")
    assert lines[0].endswith("step 1/4 | eval_loss 2.4")  # whole, on its own line
    last_draw = lines[1].split("\r")[-1]
    assert last_draw.startswith("step 4/4 [####################] 100% | loss 2.5 | lr 0.001 | tok/s 120 | mfu 31.0%")
    assert "left" not in last_draw  # nothing is left at the last step


def test_a_train_lines_throughput_leaves_out_the_evals_before_it(tmp_path, tiny_model_dir):
    """Each train line's tokens/s (and MFU) is its steps' own, as the summary's is: an eval after step 1 is not in
    step 2's window. So the lines' windows (tokens over tokens/s, one line a step) add up to the training time."""
    data = write_jsonl(tmp_path / "data.jsonl", tiny_rows(40))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, val_set_size=0.5,
                                                              eval_steps=1, max_steps=6))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "out"
    seconds = json.loads((out / "summary.json").read_text())["seconds"]
    train_lines = [m for m in read_metrics(out) if "loss" in m]
    assert len(train_lines) == 6
    windows = sum((line["tokens"] - before) / line["tokens_per_second"]
                  for line, before in zip(train_lines, [0] + [m["tokens"] for m in train_lines]))
    assert abs(windows - seconds["training"]) <= 0.01 + 0.05 * seconds["training"], (windows, seconds)
