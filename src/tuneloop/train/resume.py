"""Whether a run starts fresh or continues, decided once by the main process before training.

A fresh run refuses an output_dir that holds another run's files unless told `--overwrite`.
A resumed run picks its checkpoint (the given one, or the newest complete one with
`auto_resume_from_checkpoints`), checks that it belongs to this config, and puts back the
metrics log as it was at that checkpoint, so no step is logged twice or lost. Which files
belong to a run is run_files.py's to say.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tuneloop import run_files
from tuneloop.errors import UserError
from tuneloop.run_files import complete_checkpoints, step_of
from tuneloop.train import checkpoint


def finished_run(output_dir: Path) -> dict | None:
    """The summary of a run that finished in output_dir (a run stopped by a signal did not finish)."""
    summary = run_files.read_json(output_dir / run_files.SUMMARY)  # None also when torn by a kill
    return summary if summary is not None and summary.get("stopped_by") != "signal" else None


def choose_checkpoint(cfg, output_dir: Path, overwrite: bool, notices: list[str]) -> Path | None:
    """The checkpoint to resume from, or None. A damaged checkpoint named by resume_from_checkpoint is refused;
    with auto-resume the newest sound one is taken instead of a damaged newer one, and `notices` says so: a
    requeued job then continues (the steps after it are trained again, exactly) instead of failing forever.
    `--overwrite` means "start over": it turns auto-resume off (a named checkpoint is still resumed)."""
    if cfg.resume_from_checkpoint:
        path = Path(cfg.resume_from_checkpoint).expanduser()
        if not path.is_dir():
            raise UserError(f"resume: no checkpoint folder {path}")
        if not (path / run_files.STATE).is_file() and (path / run_files.WRITTEN).is_file():
            raise UserError(_run_folder_not_a_checkpoint(path))
        checkpoint.read_state(path)  # refuses a torn one
        problem = checkpoint.damage(path)
        if problem:
            older = [p.name for p in complete_checkpoints(path.parent) if step_of(p) < step_of(path)]
            offer = f"; the one before it is {older[-1]}" if older else ""
            raise UserError(f"resume: {path} is damaged: {problem}{offer}. Point resume_from_checkpoint at another "
                            "checkpoint.")
        return path
    if not cfg.auto_resume_from_checkpoints or overwrite:
        return None
    saved = complete_checkpoints(output_dir)
    for candidate in reversed(saved):
        problem = checkpoint.damage(candidate)
        if problem is None:
            return candidate
        notices.append(f"{candidate.name} is damaged ({problem}); resuming from an older checkpoint: the steps "
                       "after it are trained again, and the damaged checkpoint is removed with them")
    if saved:  # never start over in silence over a run that has checkpoints
        raise UserError(f"resume: every checkpoint in {output_dir} is damaged ({'; '.join(notices)}). Pass "
                        "--overwrite to start the run over, or point resume_from_checkpoint at a sound copy.")
    return None


def _run_folder_not_a_checkpoint(path: Path) -> str:
    """`resume_from_checkpoint` naming a run's output_dir (a common slip): its newest sound checkpoint named."""
    saved = [candidate for candidate in complete_checkpoints(path) if checkpoint.damage(candidate) is None]
    if saved:
        return (f"resume: {path} is a run's output_dir, not a checkpoint: its newest sound checkpoint is "
                f"{saved[-1]}; set resume_from_checkpoint to it (or `auto_resume_from_checkpoints: true`, which "
                "takes the newest)")
    return (f"resume: {path} is a run's output_dir, not a checkpoint, and it holds no sound checkpoint to resume "
            "from; remove resume_from_checkpoint to start over (with --overwrite)")


def check_output_dir_apart(cfg) -> None:
    """Before anything is read or written: output_dir must not be, hold, or sit inside one of the run's inputs
    (the model, the tokenizer, the data, the prepared-data cache), so no write or `--overwrite` can reach them."""
    output_dir = Path(cfg.output_dir).expanduser().resolve()
    inputs = [("base_model", cfg.base_model), ("tokenizer_config", cfg.tokenizer_config),
              ("dataset_prepared_path", cfg.dataset_prepared_path)]
    for key in ("datasets", "test_datasets"):
        for index, entry in enumerate(getattr(cfg, key)):
            inputs.append((f"{key}[{index}].path", entry.path))
            files = [entry.data_files] if isinstance(entry.data_files, str) else entry.data_files or []
            inputs += [(f"{key}[{index}].data_files", name) for name in files]
    for key, value in inputs:
        if not value:
            continue
        path = Path(value).expanduser()
        if key != "dataset_prepared_path" and not path.exists():
            continue  # a hub name, or a file that data loading will report
        path = path.resolve()
        if path == output_dir or output_dir in path.parents or path in output_dir.parents:
            where = ("is" if path == output_dir else "holds" if output_dir in path.parents else "sits inside")
            raise UserError(f"config: `output_dir: {cfg.output_dir}` {where} `{key}: {value}`; a run writes (and "
                            "--overwrite clears) output_dir, so it must be apart from the run's inputs. Choose "
                            "another output_dir.")


def make_output_dir(output_dir: Path) -> None:
    """output_dir is a folder this process can write in (made if missing)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"config: `output_dir: {output_dir}` is a file; give a folder (it is created if missing)")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f"{run_files.TEMP_PREFIX}write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UserError(f"config: cannot write in `output_dir: {output_dir}` ({error.strerror or error}); choose a "
                        "folder you can write to") from None


def prepare_output_dir(cfg, output_dir: Path, overwrite: bool, notices: list[str]) -> Path | None:
    """Main process only, holding output_dir (run_files.OutputDirLock). Returns the checkpoint to resume from,
    or None for a fresh start (the folder then holds nothing of an earlier run). Changes nothing when it refuses;
    appends what the user should know to `notices`."""
    resume = choose_checkpoint(cfg, output_dir, overwrite, notices)
    if resume is not None and resume.parent.resolve() == output_dir.resolve():
        return resume  # this folder's own run, continued
    # a fresh start, or another folder's checkpoint continued here: this folder must hold nothing else
    foreign = run_files.foreign_model_files(output_dir)
    if foreign:
        raise UserError(f"output_dir {output_dir} holds files tuneloop did not write and a run would write over "
                        f"({', '.join(p.name for p in foreign)}). tuneloop never overwrites or deletes what it did "
                        "not write, even with --overwrite: choose another output_dir.")
    leftovers = run_files.run_files_in(output_dir)
    # auto-resume of a tuneloop run killed before its first checkpoint: start it again
    interrupted_before_first_save = (resume is None and cfg.auto_resume_from_checkpoints and not overwrite
                                     and (output_dir / run_files.PLAN).is_file() and finished_run(output_dir) is None)
    if leftovers and not (overwrite or interrupted_before_first_save or run_files.never_trained(output_dir)):
        names = ", ".join(p.name for p in leftovers[:4]) + (" …" if len(leftovers) > 4 else "")
        torn = (" Its final model was not written: the run was stopped while saving it."
                if (output_dir / run_files.TEMP_FINAL).exists() else "")
        raise UserError(f"output_dir {output_dir} holds another run's files ({names}).{torn} Pass --overwrite to "
                        "replace them, set `auto_resume_from_checkpoints: true` to continue that run, or "
                        "choose another output_dir.")
    run_files.clear_run_files(output_dir)
    return resume


def continue_from(output_dir: Path, resume: Path) -> None:
    """After the checkpoint passed check_resumable: the folder as it was at that checkpoint — its metrics
    log, no summary, no torn saves, and no checkpoints of the abandoned steps after it."""
    run_files.remove_torn_saves(output_dir)
    saved_metrics = resume / run_files.METRICS
    if saved_metrics.is_file():
        run_files.record(output_dir, run_files.METRICS)
        shutil.copyfile(saved_metrics, output_dir / run_files.METRICS)
    else:
        (output_dir / run_files.METRICS).unlink(missing_ok=True)
    (output_dir / run_files.SUMMARY).unlink(missing_ok=True)
    completions = output_dir / run_files.COMPLETIONS  # online RL's log: the completions of steps not undone
    if completions.is_file():
        kept = [line for line in completions.read_text().splitlines(keepends=True)
                if _logged_step(line) <= step_of(resume)]
        run_files.write_text(completions, "".join(kept))
    if resume.parent.resolve() == output_dir.resolve():
        for later in complete_checkpoints(output_dir):
            if step_of(later) > step_of(resume):
                shutil.rmtree(later)


def _logged_step(line: str) -> float:
    """A log line's step; a line a kill tore in half belongs to no kept step."""
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return float("inf")


FORCE_MAY_NOT = ("the model's shape (its class, parameters and trained parameters: the checkpoint's weights "
                 "would not fit)", "the engine (FSDP2, DeepSpeed and its ZeRO stage lay weights and optimizer state "
                 "out their own way)", "the number of ranks of a DeepSpeed or streamed run")


def check_resumable(state: dict, plan: dict, identity: dict, lr_scheduler: str,
                    force: bool) -> tuple[list[str], list[str]]:
    """Refuses a checkpoint of another run (naming what changed) unless forced; returns (notices, the settings a
    forced resume overrides). A checkpoint of a model of another shape is refused forced or not: its weights
    cannot be loaded into this run's model. A longer or shorter run is allowed while it still ends after the
    checkpoint's step: the plan is recomputed and the learning-rate schedule follows the new length from there on
    (a notice). one_cycle fixes its cycle when the run starts, so with it the length cannot change."""
    before_shape, shape = state.get("model_shape"), identity.get("model_shape")
    if before_shape is not None and before_shape != shape:
        raise UserError(f"resume: the checkpoint holds a model of another shape ({before_shape['model']}, "
                        f"{before_shape['trainable_parameters']:,} trained) than this run's ({shape['model']}, "
                        f"{shape['trainable_parameters']:,} trained): its weights cannot be loaded, --force-resume "
                        "or not. Restore the model settings (base_model, the adapter, added tokens), or start a "
                        "fresh output_dir.")
    changed = checkpoint.incompatibilities(state, plan, identity)
    notices = []
    before, now, step = state["plan"]["total_steps"], plan["total_steps"], state["step"]
    if before != now:
        if now <= step:
            changed.append(f"the run's length ({before} → {now} steps, but the checkpoint is at step {step})")
        elif lr_scheduler == "one_cycle":
            changed.append(f"the run's length ({before} → {now} steps; one_cycle fixes its cycle when a run starts)")
        else:
            notices.append(f"the run is now {now} steps long (it was {before}): from step {step} on, the "
                           f"learning-rate schedule follows the new length")
    if changed and not force:
        raise UserError("resume: the checkpoint was written by a different run: " + "; ".join(changed) +
                        ". Restore the old settings, start a fresh output_dir, or pass --force-resume to continue "
                        "the checkpoint's weights, optimizer and step with the new settings (it may override any "
                        f"setting but {', '.join(FORCE_MAY_NOT[:-1])} and {FORCE_MAY_NOT[-1]}).")
    if changed:
        notices.append(f"--force-resume: continuing with settings the checkpoint was not written with: "
                       f"{'; '.join(changed)} (recorded in {run_files.RESUMES})")
    return notices, changed


def check_finished_run_matches(output_dir: Path, settings: dict) -> None:
    """auto-resume found a finished run: nothing to do, unless this config is another run, which would then be
    silently skipped; refused naming what changed."""
    from tuneloop.config.schema import NOT_RESULT_CHANGING, changed_settings

    recorded = run_files.read_yaml(output_dir / run_files.RUN_CONFIG)
    if recorded is None:
        return  # written before tuneloop recorded its config: nothing to compare
    before = {key: value for key, value in recorded.items() if key not in NOT_RESULT_CHANGING}
    changed = changed_settings(before, settings)
    if changed:
        raise UserError(f"output_dir {output_dir} holds a finished run with other settings: {'; '.join(changed)}. "
                        "Nothing to resume: choose another output_dir, or pass --overwrite to replace that run.")
