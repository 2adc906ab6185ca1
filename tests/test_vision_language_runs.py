"""Vision-language runs as the text runs are shown correct (tests/test_equivalence.py, tests/test_resume.py), on the
tiny LLaVA and coloured squares of tests/test_vision_language.py, fp32 (`bf16: false`):

- two DDP ranks (torchrun, gloo) end with the weights of one process over the same global batch: each rank
  collates its own rows *and their images* (an image given to the wrong row, or the same images on both ranks,
  changes the gradient);
- a run killed with SIGKILL mid-run and auto-resumed ends bit-identical to an uninterrupted run, its metrics
  lines too: the resumed run reads the same rows with the same image references from the prepared cache.
One launch of the real command line per check.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import killed_then_resumed, read_metrics, run_in_process, write_config, write_jsonl
from safetensors.torch import load_file
from test_resume import assert_identical
from test_vision_language import caption_rows, save_llava, vlm_config


SGD_STEPS = dict(optimizer="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler="constant", max_steps=2)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return save_llava(tmp_path_factory.mktemp("tiny_llava"))


def update(run_dir, model_dir) -> dict:
    after, before = load_file(run_dir / "out" / "model.safetensors"), load_file(model_dir / "model.safetensors")
    return {key: after[key] - before[key] for key in before}


@pytest.mark.slow
def test_a_vlm_run_killed_mid_run_resumes_bit_identical(tmp_path, llava_dir):
    """AdamW with warm-up, 2 epochs of 40 rows (36 train, 4 eval) in micro-batches of 2, a checkpoint every 3
    steps; stopped at a random step (the signal-at-step hook: the true kill -9 is test_resume's), then the same
    command again."""
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 40, seed=12))
    keys = dict(num_epochs=2, micro_batch_size=2, save_strategy=None, save_steps=3, save_total_limit=2,
                learning_rate=2e-3, warmup_steps=2, val_set_size=0.1, evals_per_epoch=2,
                auto_resume_from_checkpoints=True)
    straight = write_config(tmp_path / "straight.yml", **vlm_config(tmp_path / "straight", llava_dir, data, **keys))
    result = run_in_process("train", str(straight))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = read_metrics(tmp_path / "straight" / "out")
    total = max(m["step"] for m in expected if "loss" in m)

    run_dir = tmp_path / "killed"
    config = write_config(tmp_path / "killed.yml", **vlm_config(run_dir, llava_dir, data, **keys))
    seed = random.randrange(10**6)
    stop_after = random.Random(seed).randint(4, total - 12)
    newest, _ = killed_then_resumed(config, run_dir / "out", stop_after)
    print(f"\nstopped after step {stop_after} of {total} (seed {seed}), resumed from {newest.name}")

    assert_identical(load_file(run_dir / "out" / "model.safetensors"),
                     load_file(tmp_path / "straight" / "out" / "model.safetensors"))
    metrics = read_metrics(run_dir / "out")
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, total + 1)), f"seed {seed}"
    assert [m["loss"] for m in metrics if "loss" in m] == [m["loss"] for m in expected if "loss" in m]
    assert [m["eval_loss"] for m in metrics if "eval_loss" in m] == [m["eval_loss"] for m in expected
                                                                     if "eval_loss" in m]
    plan = json.loads((run_dir / "out" / "plan.json").read_text())
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["targets_collated"] == plan["total_trainable_tokens"]  # counted across the kill
