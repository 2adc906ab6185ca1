"""Whether a run starts fresh or continues, decided once by the main process before training.

A fresh run refuses an output_dir that holds another run's files unless told `--overwrite`.
A resumed run picks its checkpoint (the given one, or the newest complete one with
`auto_resume_from_checkpoints`), checks that it belongs to this config, and puts back the
metrics log as it was at that checkpoint, so no step is logged twice or lost. Which files
belong to a run is run_files.py's to say.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tuneloop import run_files
from tuneloop.errors import UserError
from tuneloop.run_files import clear_previous_run, complete_checkpoints, previous_run_files, step_of
from tuneloop.train import checkpoint


def finished_run(output_dir: Path) -> dict | None:
    """The summary of a run that finished in output_dir (a run stopped by a signal did not finish)."""
    summary = run_files.read_json(output_dir / run_files.SUMMARY)  # None also when torn by a kill
    return summary if summary is not None and summary.get("stopped_by") != "signal" else None


def choose_checkpoint(cfg, output_dir: Path) -> Path | None:
    if cfg.resume_from_checkpoint:
        path = Path(cfg.resume_from_checkpoint)
        if not path.is_dir():
            raise UserError(f"resume: no checkpoint folder {path}")
        checkpoint.read_state(path)  # refuses a torn one
        return path
    if cfg.auto_resume_from_checkpoints:
        complete = complete_checkpoints(output_dir)
        return complete[-1] if complete else None
    return None


def prepare_output_dir(cfg, output_dir: Path, overwrite: bool) -> Path | None:
    """Main process only. Returns the checkpoint to resume from, or None for a fresh start (the folder
    then holds nothing of an earlier run). Changes nothing when it refuses."""
    output_dir.mkdir(parents=True, exist_ok=True)
    resume = choose_checkpoint(cfg, output_dir)
    if resume is not None:
        return resume
    leftovers = previous_run_files(output_dir)
    # auto-resume of a tuneloop run killed before its first checkpoint: start it again
    interrupted_before_first_save = (cfg.auto_resume_from_checkpoints and (output_dir / run_files.PLAN).is_file()
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
    run_files.remove_torn_saves(output_dir)
    saved_metrics = resume / run_files.METRICS
    if saved_metrics.is_file():
        shutil.copyfile(saved_metrics, output_dir / run_files.METRICS)
    else:
        (output_dir / run_files.METRICS).unlink(missing_ok=True)
    (output_dir / run_files.SUMMARY).unlink(missing_ok=True)
    if resume.parent.resolve() == output_dir.resolve():
        for later in complete_checkpoints(output_dir):
            if step_of(later) > step_of(resume):
                shutil.rmtree(later)


def check_resumable(state: dict, plan: dict, identity: dict, force: bool) -> None:
    changed = checkpoint.incompatibilities(state, plan, identity["data_key"], identity["base_model"],
                                           identity["adapter"])
    if changed and not force:
        raise UserError("resume: the checkpoint was written by a different run: " + "; ".join(changed) +
                        ". Restore the old settings, start a fresh output_dir, or pass --force-resume.")
