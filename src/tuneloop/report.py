"""The run's report: `report.md` (the numbers) and `report.png` (loss, eval loss, a preference run's rewards,
and the learning rate).

Written at the end of `tuneloop train` from the files the run leaves (plan.json, metrics.jsonl,
summary.json), so `tuneloop report OUTPUT_DIR` can redraw it for any finished or stopped run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tuneloop import run_files


def read_run(output_dir: Path) -> tuple[dict, list[dict], dict]:
    plan = json.loads((output_dir / run_files.PLAN).read_text())
    log = output_dir / run_files.METRICS  # absent when a run stopped before its first logging step
    metrics = [json.loads(line) for line in log.read_text().splitlines() if line] if log.is_file() else []
    summary = run_files.read_json(output_dir / run_files.SUMMARY) or {}
    return plan, metrics, summary


def write_markdown(output_dir: Path, plan: dict, metrics: list[dict], summary: dict) -> Path:
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    speeds = [m["real_tokens_per_second"] for m in train[1:] if m.get("real_tokens_per_second")]
    lines = [
        f"# tuneloop run: {output_dir.name}", "",
        "| | |", "|---|---|",
        f"| steps run / planned | {summary.get('steps', len(train))} / {plan['total_steps']} |",
        f"| stopped by | {summary.get('stopped_by') or 'end of plan'} |",
        f"| global batch | {plan['global_batch_size']} rows ({plan['micro_batch_size']} × "
        f"{plan['gradient_accumulation_steps']} × {plan['world_size']} ranks), {plan['batching']} |",
        f"| trained tokens | {train[-1]['tokens'] if train else 0} of {_planned_tokens(plan)} planned |",
        f"| train time | {summary.get('train_seconds', '?')} s |",
    ]
    if speeds:
        lines.append(f"| real tokens/s (median after step 1) | {sorted(speeds)[len(speeds) // 2]:.0f} |")
    if summary.get("mfu") is not None:
        lines.append(f"| MFU (model FLOPs utilisation) | {summary['mfu']:.1%} of {plan['peak_source']} |")
    if summary.get("first_step_seconds") is not None and plan.get("torch_compile"):
        lines.append(f"| first step (compiling) | {summary['first_step_seconds']:.1f} s |")
    seconds = summary.get("seconds") or {}
    if seconds.get("total") is not None:
        named = (("data", "data"), ("model_load", "model load"), ("training", "training"), ("eval", "eval"),
                 ("saving", "saving"))
        lines.append(f"| wall time | {seconds['total']:.1f} s: " + ", ".join(
            f"{label} {seconds[key]:.1f} s" for key, label in named if seconds.get(key) is not None) + " |")
    memory = summary.get("peak_memory_gb") or {}
    if memory:
        gpu = memory.get("cuda_allocated")
        device = f"{gpu:.2f} GB GPU allocated, " if gpu is not None else ""
        lines.append(f"| peak memory | {device}{memory['host_rss']:.2f} GB host RSS (plan estimate "
                     f"{memory.get('estimated') or '?'} GB) |")
    if train:
        lines.append(_train_loss_row(train))
    if evals:
        lines.append(f"| eval loss first → last | {evals[0]['eval_loss']:.4f} (step {evals[0]['step']}) → "
                     f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']}) |")
        last = evals[-1]
        if "eval_token_accuracy" in last:
            lines.append(f"| eval token accuracy last | {last['eval_token_accuracy']:.4f} |")
        if "eval_accuracy" in last:  # a reward model (reward_model: true)
            lines.append(f"| eval accuracy first → last | {evals[0]['eval_accuracy']:.4f} → {last['eval_accuracy']:.4f} "
                         f"(pairs scored chosen above rejected; margin last {last['eval_margin']:.4f}) |")
        if "eval_reward_accuracy" in last:  # a preference run (rl:)
            lines.append(f"| eval reward accuracy first → last | {evals[0]['eval_reward_accuracy']:.4f} → "
                         f"{last['eval_reward_accuracy']:.4f} (pairs ranked right) |")
            lines.append(f"| eval reward margin last | {last['eval_reward_margin']:.4f} (chosen "
                         f"{last['eval_reward_chosen']:.4f}, rejected {last['eval_reward_rejected']:.4f}) |")
    if plan.get("warnings"):
        lines += ["", "Plan warnings:", *[f"- {w}" for w in plan["warnings"]]]
    signal_warnings = [f"- step {line['step']}: {line['warning']}" for line in train if line.get("warning")]
    if signal_warnings:  # (online RL: steps with nothing to learn from, online_rl/rows.py)
        lines += ["", "Run warnings:", *signal_warnings]
    if any("generation_seconds" in line for line in train):
        generation = sum(line["generation_seconds"] for line in train if "generation_seconds" in line)
        training = sum(line.get("training_seconds", 0.0) for line in train)
        lines.insert(lines.index("|---|---|") + 1,
                     f"| generation vs training (logged steps, summed) | {generation:.1f} s vs {training:.1f} s |")
    lines += ["", f"![loss curves]({run_files.REPORT_PNG})", ""]
    path = output_dir / run_files.REPORT_MD
    run_files.record(output_dir, path.name)
    path.write_text("\n".join(lines))
    return path


def _train_loss_row(train: list[dict]) -> str:
    """The train loss at the start and at the end of the run, each the mean of a fifth of the train lines (one line
    where there are fewer than ten). One line's loss swings with its batch: the quickstart's last step, 88 trained
    tokens, read 2.48 against 1.19–1.53 for the three before it, and its first 2.17, so "first → last" of single
    lines said the loss rose (2.17 → 2.48) in a run whose eval loss fell from 3.31 to 1.33."""
    count = max(1, len(train) // 5)
    first, last = (sum(m["loss"] for m in lines) / count for lines in (train[:count], train[-count:]))
    if count == 1:
        return f"| train loss first → last | {first:.4f} → {last:.4f} |"
    return (f"| train loss first → last (each the mean of {count} of the {len(train)} train lines) | {first:.4f} → "
            f"{last:.4f} |")


def _planned_tokens(plan: dict):
    """The plan's trained tokens; a stream's are counted as it is read."""
    planned = plan["total_trainable_tokens"]
    return planned if planned is not None else "an unknown number (a stream)"


def write_plot(output_dir: Path, plan: dict, metrics: list[dict]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # the report extra is not installed; report.md still has the numbers
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    rewarded = [m for m in train if "reward_accuracy" in m]  # a preference run: its rewards get a panel
    panels = 3 if rewarded else 2
    figure, axes = plt.subplots(panels, 1, figsize=(8, 6 + 2 * (panels - 2)), sharex=True,
                                gridspec_kw={"height_ratios": [3, 2, 1][:panels] if rewarded else [3, 1]})
    loss_axis, lr_axis = axes[0], axes[-1]
    if rewarded:
        reward_axis = axes[1]
        steps = [m["step"] for m in rewarded]
        reward_axis.plot(steps, [m["reward_accuracy"] for m in rewarded], label="reward accuracy (train)")
        reward_axis.plot(steps, [m["reward_margin"] for m in rewarded], label="reward margin (train)")
        eval_rewards = [m for m in evals if "eval_reward_accuracy" in m]
        if eval_rewards:
            reward_axis.plot([m["step"] for m in eval_rewards], [m["eval_reward_accuracy"] for m in eval_rewards],
                             "o-", label="reward accuracy (eval)")
        reward_axis.set_ylabel("rewards")
        reward_axis.legend()
        reward_axis.grid(alpha=0.3)
    finite = [m for m in train if math.isfinite(m["loss"])]
    per = "pair" if plan.get("unit") == "pairs" else "token"
    loss_axis.plot([m["step"] for m in finite], [m["loss"] for m in finite], label=f"train loss (per {per})")
    if evals:
        loss_axis.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", label="eval loss")
    loss_axis.set_ylabel("loss")
    loss_axis.set_title(f"{plan['total_steps']} planned steps, global batch {plan['global_batch_size']} rows, "
                        f"{plan['batching']}")
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    lr_axis.plot([m["step"] for m in train], [m["lr"] for m in train], color="tab:green")
    lr_axis.set_ylabel("learning rate")
    lr_axis.set_xlabel("optimizer step")
    lr_axis.grid(alpha=0.3)
    figure.tight_layout()
    path = output_dir / run_files.REPORT_PNG
    run_files.record(output_dir, path.name)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(output_dir: Path) -> list[Path]:
    plan, metrics, summary = read_run(output_dir)
    written = [write_markdown(output_dir, plan, metrics, summary)]
    plot = write_plot(output_dir, plan, metrics)
    return written + ([plot] if plot else [])
