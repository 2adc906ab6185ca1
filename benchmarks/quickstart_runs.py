"""One run of `tuneloop train examples/quickstart.yml` with `--set` overrides in its own fresh process, and what its
files say: the run's own throughput (summary.json's real tokens/s after the first step: the first step left out,
the evals between steps included, alike in every variant), its last eval loss, peak RSS, the plan's estimate.
Shared by the side-by-side benchmarks here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yml"


def train_quickstart(name: str, sets: list[str], workdir: Path, max_steps: int | None = None) -> dict:
    out = workdir / name
    sets = [*sets, f"output_dir={out}", f"dataset_prepared_path={workdir / 'prepared'}"]
    if max_steps:
        sets.append(f"max_steps={max_steps}")
    command = [sys.executable, "-m", "tuneloop", "train", str(QUICKSTART), "--overwrite"]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"tokens_per_second": summary["real_tokens_per_second_after_first_step"],
            "first_step_seconds": summary["first_step_seconds"], "mfu": summary.get("mfu"),
            "eval_loss": [m["eval_loss"] for m in evals if "eval_loss" in m][-1],
            "peak_rss_gb": summary["peak_memory_gb"]["host_rss"], "estimated_gb": plan["estimated_memory_gb"],
            "precision": plan["precision"], "attention": plan["attention"], "plan": plan}
