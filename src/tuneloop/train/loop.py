"""The training loop: plain code, every number taken from the TrainingPlan.

Token-weighted accumulation: the loss of an optimizer step is the sum of per-token losses
over all its micro-batches on all ranks, divided by the number of target tokens in the whole
step. That count is known on the host before the step starts (the sampler is deterministic
and every rank can count every rank's rows), so normalising costs no device sync and no
collective. Each micro-batch's summed loss is scaled by world_size / step_tokens because
DDP averages gradients over ranks.

We use `accelerator.no_sync` for the non-final micro-batches of a step rather than
`accelerator.accumulate`: the latter divides the loss by the accumulation count (a mean of
micro-batch means) and ties stepping to the dataloader's end, which would break both the
exact normalisation and the plan's step count on a short last window.

The host waits for the device only at logging, eval and save steps.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tuneloop.data.batching import epoch_micro_batches
from tuneloop.data.collate import Collator
from tuneloop.plan import TrainingPlan, eval_spec, train_spec
from tuneloop.train import checkpoint
from tuneloop.train.evaluate import evaluate
from tuneloop.train.guards import EarlyStopping, LossWatchdog, StopRequests
from tuneloop.train.losses import summed_token_loss
from tuneloop.train.model_folder import has_best, publish_best, publish_final, save_best
from tuneloop.train.optim import build_optimizer, build_scheduler
from tuneloop.train.track import LossWindow, MetricsLog


@dataclass
class RunOutcome:
    steps: int
    tokens: int
    train_seconds: float
    real_tokens: int = 0
    targets_collated: int = 0  # target tokens the collator produced: the loss's denominators, summed
    evals: list = field(default_factory=list)
    stopped_by: str | None = None  # "signal", "early_stopping" or None (ran the whole plan)


def train(cfg, plan: TrainingPlan, prepared, tokenizer, model, accelerator, identity: dict,
          stop: StopRequests, resume_from: Path | None = None) -> RunOutcome:
    output_dir = Path(cfg.output_dir)
    world_size, rank = accelerator.num_processes, accelerator.process_index
    accum = cfg.gradient_accumulation_steps
    lengths = np.asarray(prepared.train["length"])
    targets_per_row = np.asarray(prepared.train["n_targets"])
    spec = train_spec(cfg, world_size)
    collate = Collator(prepared.train, tokenizer.pad_token_id, plan.batching == "packed",
                       pad_to=cfg.sequence_len if cfg.pad_to_sequence_len else None)

    eval_batches = eval_collate = None
    if prepared.eval is not None:
        eval_lengths = np.asarray(prepared.eval["length"])
        eval_batches = epoch_micro_batches(eval_lengths, eval_spec(cfg, world_size), 0, shuffle=False,
                                           even=False)[rank]
        eval_collate = Collator(prepared.eval, tokenizer.pad_token_id, cfg.resolved_eval_sample_packing)

    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, plan, optimizer)  # stepped by us, once per optimizer step
    model, optimizer = accelerator.prepare(model, optimizer)
    state = checkpoint.read_state(resume_from) if resume_from is not None else None
    first_step = state["step"] if state else 0
    metrics = MetricsLog(output_dir / checkpoint.METRICS_FILE, accelerator.is_main_process, plan.total_steps,
                         first_step)
    watchdog = LossWatchdog(cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience, accelerator.device)
    early = EarlyStopping(cfg.early_stopping_patience)
    eval_at, save_at = set(plan.eval_steps_at), set(plan.save_steps_at)
    step, tokens_seen, real_tokens_seen, targets_collated, evals = 0, 0, 0, 0, []

    def gather_counts(count: int) -> list[int]:
        """Every rank's count, on every rank (collective)."""
        return [int(v) for v in accelerator.gather(torch.tensor([count], device=accelerator.device)).tolist()]

    def run_eval(at_step: int) -> None:
        result = evaluate(accelerator.unwrap_model(model), eval_batches, eval_collate, accelerator)
        metrics.write({"step": at_step, "epoch": round(at_step / plan.steps_per_epoch, 4), **result})
        evals.append({"step": at_step, **result})
        if early.update(result["eval_loss"]) and cfg.early_stopping_patience:
            checkpoint.write_on_every_rank(accelerator, output_dir, "the best model",
                                           on_main=lambda: save_best(accelerator.unwrap_model(model), tokenizer,
                                                                     output_dir))

    def log_train_line(at_step: int, lr: float, grad_norm: torch.Tensor) -> None:
        closed = loss_window.close(accelerator)
        metrics.write({"step": at_step, "epoch": round(at_step / plan.steps_per_epoch, 4), "loss": closed["loss"],
                       "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens_seen,
                       "tokens_per_second": closed["tokens_per_second"],
                       "real_tokens_per_second": closed["real_tokens_per_second"]})
        watchdog.check(accelerator)

    def save(at_step: int) -> None:
        watchdog.check_before_save(accelerator)  # never checkpoint a diverged model
        per_rank_targets = gather_counts(targets_collated)

        def write_on_main() -> None:
            state = {"step": at_step, "tokens_seen": tokens_seen, "targets_collated": per_rank_targets,
                     "evals": evals, "best_eval_loss": early.best,
                     "evals_without_improvement": early.evals_without_improvement, "plan": plan.to_json(),
                     **identity}
            written = checkpoint.write_checkpoint(output_dir, at_step, state, accelerator.unwrap_model(model),
                                                  optimizer, scheduler, world_size)
            checkpoint.prune_checkpoints(output_dir, cfg.save_total_limit, keep=written)

        checkpoint.write_on_every_rank(accelerator, output_dir, f"step {at_step}", on_main=write_on_main,
                                       on_every_rank=lambda: checkpoint.write_rank_rng(output_dir, at_step, rank),
                                       clean_up=lambda: checkpoint.remove_rank_rngs(output_dir, at_step,
                                                                                   world_size))

    if state is not None:
        checkpoint.load_training_state(resume_from, optimizer, scheduler, rank)
        step, tokens_seen, evals = state["step"], state["tokens_seen"], state["evals"]
        saved_counts = state.get("targets_collated", [])  # one per rank (a forced resume may change ranks)
        targets_collated = saved_counts[rank] if len(saved_counts) == world_size else 0
        early.best, early.evals_without_improvement = state["best_eval_loss"], state["evals_without_improvement"]
    elif 0 in eval_at:
        run_eval(0)

    loss_window, train_start = LossWindow(accelerator.device), time.perf_counter()
    # a checkpoint written at the step early stopping fired (a later final save failed): stop again at once
    stopped_by = "early_stopping" if state is not None and early.should_stop else None
    model.train()

    for epoch in range(step // plan.steps_per_epoch, plan.epochs_to_run):
        if step == plan.total_steps or stopped_by:
            break
        per_rank = epoch_micro_batches(lengths, spec, epoch)
        # on resume, the first epoch starts at the exact micro-batch after the checkpoint
        first = (step - epoch * plan.steps_per_epoch) * accum
        for start in range(first, plan.micro_batches_per_epoch, accum):
            if step == plan.total_steps or stopped_by:
                break
            step_tokens = sum(int(targets_per_row[row].sum()) for batches in per_rank
                              for micro in batches[start:start + accum] for row in micro)
            window = per_rank[rank][start:start + accum]
            step_loss = torch.zeros((), device=accelerator.device, dtype=torch.float64)
            for index, rows in enumerate(window):
                batch = collate(rows).to(accelerator.device)
                last = index == len(window) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    with accelerator.autocast():
                        logits = model(**batch.inputs).logits
                    loss_sum = summed_token_loss(logits, batch.targets)
                    accelerator.backward(loss_sum * (world_size / step_tokens))
                step_loss += loss_sum.detach().double()
                loss_window.real_tokens += batch.n_real_tokens
                real_tokens_seen += batch.n_real_tokens
                targets_collated += batch.n_targets
                del logits, loss_sum
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            lr = scheduler.get_last_lr()[0]  # the rate this update uses
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += step_tokens
            loss_window.tokens += step_tokens
            loss_window.loss += step_loss
            watchdog.observe(step, step_loss * world_size / step_tokens, grad_norm)

            # a save also logs, so the metrics of a resumed run equal those of an uninterrupted one (the
            # window being averaged is not part of the checkpoint)
            logged = step % cfg.logging_steps == 0 or step == plan.total_steps or step in save_at
            if logged:
                log_train_line(step, lr, grad_norm)
            if step in eval_at:
                run_eval(step)
                if early.should_stop:
                    stopped_by = "early_stopping"
            if step in save_at:
                save(step)
            # a signal during the last step changes nothing: the run is complete and saves its model
            if step < plan.total_steps and not stopped_by and stop.requested(accelerator, step):
                stopped_by = "signal"
                if step not in save_at:
                    if not logged:
                        log_train_line(step, lr, grad_norm)
                    save(step)

    watchdog.check_before_save(accelerator)  # the final model is not saved from a diverged run either
    train_seconds = time.perf_counter() - train_start
    if stopped_by != "signal":
        best_instead = stopped_by == "early_stopping" and has_best(output_dir)
        checkpoint.write_on_every_rank(
            accelerator, output_dir, "the final model",
            on_main=lambda: publish_best(output_dir) if best_instead
            else publish_final(accelerator.unwrap_model(model), tokenizer, output_dir))
    # counted on each rank (real tokens this session; targets over the whole run): reduced once, here
    real_total = int(accelerator.reduce(torch.tensor(real_tokens_seen, device=accelerator.device), reduction="sum"))
    return RunOutcome(step, tokens_seen, train_seconds, real_total, sum(gather_counts(targets_collated)), evals,
                      stopped_by)


def write_summary(output_dir: Path, outcome: RunOutcome, plan: TrainingPlan) -> dict:
    summary = {"steps": outcome.steps, "planned_steps": plan.total_steps, "tokens": outcome.tokens,
               "targets_collated": outcome.targets_collated, "real_tokens": outcome.real_tokens,
               "train_seconds": round(outcome.train_seconds, 4),
               "real_tokens_per_second": round(outcome.real_tokens / outcome.train_seconds, 1)
               if outcome.train_seconds else None, "stopped_by": outcome.stopped_by,
               "first_eval_loss": outcome.evals[0]["eval_loss"] if outcome.evals else None,
               "last_eval_loss": outcome.evals[-1]["eval_loss"] if outcome.evals else None}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
