"""The output folder's rules: never mix two runs, resume only what fits.

A fresh run refuses an output_dir that holds another run's files unless told `--overwrite`.
A resumed run picks its checkpoint (the given one, or the newest complete one with
`auto_resume_from_checkpoints`), checks that it belongs to this config, and puts back the
metrics log as it was at that checkpoint, so no step is logged twice or lost.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tuneloop.errors import UserError
from tuneloop.train import checkpoint
from tuneloop.train.model_folder import BEST_DIR, OLD_BEST_DIR

# everything a run leaves: its records, the model or adapter folder save_pretrained writes, the report
RUN_FILES = ("plan.json", "metrics.jsonl", "summary.json", "report.md", "report.png", "config.json",
             "generation_config.json", "model.safetensors", "model.safetensors.index.json",
             "adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
             "added_tokens.json", "README.md")


def previous_run_files(output_dir: Path) -> list[Path]:
    if not (output_dir / "plan.json").exists() and not checkpoint.complete_checkpoints(output_dir):
        # not a tuneloop run: refuse only on the files a run would overwrite
        return [output_dir / name for name in ("model.safetensors", "adapter_model.safetensors", "config.json")
                if (output_dir / name).exists()]
    found = [output_dir / name for name in RUN_FILES if (output_dir / name).exists()]
    found += sorted(output_dir.glob("model-*.safetensors"))
    found += sorted(output_dir.glob(f"{checkpoint.PREFIX}*")) + sorted(output_dir.glob(".tmp-*"))
    found += sorted(output_dir.glob(".rng-*"))
    # the early-stopping best model, and the copy save_best keeps while it replaces it
    found += [output_dir / name for name in (BEST_DIR, OLD_BEST_DIR) if (output_dir / name).exists()]
    return found


def finished_run(output_dir: Path) -> dict | None:
    summary = output_dir / "summary.json"
    if not summary.is_file():
        return None
    try:
        data = json.loads(summary.read_text())
    except json.JSONDecodeError:
        return None  # torn by a kill while it was written: the run did not finish cleanly
    return data if data.get("stopped_by") != "signal" else None


def choose_checkpoint(cfg, output_dir: Path) -> Path | None:
    if cfg.resume_from_checkpoint:
        path = Path(cfg.resume_from_checkpoint)
        if not path.is_dir():
            raise UserError(f"resume: no checkpoint folder {path}")
        checkpoint.read_state(path)  # refuses a torn one
        return path
    if cfg.auto_resume_from_checkpoints:
        complete = checkpoint.complete_checkpoints(output_dir)
        return complete[-1] if complete else None
    return None


def clear_previous_run(output_dir: Path) -> None:
    for path in previous_run_files(output_dir):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def prepare_output_dir(cfg, output_dir: Path, overwrite: bool) -> Path | None:
    """Main process only. Returns the checkpoint to resume from, or None for a fresh start (the folder
    then holds nothing of an earlier run). Changes nothing when it refuses."""
    output_dir.mkdir(parents=True, exist_ok=True)
    resume = choose_checkpoint(cfg, output_dir)
    if resume is not None:
        return resume
    leftovers = previous_run_files(output_dir)
    # auto-resume of a tuneloop run killed before its first checkpoint: start it again
    interrupted_before_first_save = (cfg.auto_resume_from_checkpoints and (output_dir / "plan.json").is_file()
                                     and finished_run(output_dir) is None)
    if leftovers and not overwrite and not interrupted_before_first_save:
        names = ", ".join(p.name for p in leftovers[:4]) + (" …" if len(leftovers) > 4 else "")
        raise UserError(f"output_dir {output_dir} holds another run's files ({names}). Pass --overwrite to "
                        "replace them, set `auto_resume_from_checkpoints: true` to continue that run, or "
                        "choose another output_dir.")
    clear_previous_run(output_dir)
    return None


def continue_from(output_dir: Path, resume: Path) -> None:
    """After the checkpoint passed check_resumable: the folder as it was at that checkpoint — its metrics
    log, no summary, no torn saves, and no checkpoints of the abandoned steps after it."""
    checkpoint.remove_torn_saves(output_dir)
    saved_metrics = resume / checkpoint.METRICS_FILE
    if saved_metrics.is_file():
        shutil.copyfile(saved_metrics, output_dir / checkpoint.METRICS_FILE)
    else:
        (output_dir / checkpoint.METRICS_FILE).unlink(missing_ok=True)
    (output_dir / "summary.json").unlink(missing_ok=True)
    if resume.parent.resolve() == output_dir.resolve():
        for later in checkpoint.complete_checkpoints(output_dir):
            if checkpoint.step_of(later) > checkpoint.step_of(resume):
                shutil.rmtree(later)


def check_resumable(state: dict, plan: dict, identity: dict, force: bool) -> None:
    changed = checkpoint.incompatibilities(state, plan, identity["data_key"], identity["base_model"],
                                           identity["adapter"])
    if changed and not force:
        raise UserError("resume: the checkpoint was written by a different run: " + "; ".join(changed) +
                        ". Restore the old settings, start a fresh output_dir, or pass --force-resume.")
