"""The training loop: plain code, one screen, every number taken from the TrainingPlan.

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
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from tuneloop.data.batching import epoch_micro_batches
from tuneloop.data.collate import Collator
from tuneloop.plan import TrainingPlan, eval_spec, train_spec
from tuneloop.train.checkpoint import save_checkpoint
from tuneloop.train.evaluate import evaluate
from tuneloop.train.losses import summed_token_loss
from tuneloop.train.optim import build_optimizer, build_scheduler
from tuneloop.train.track import MetricsLog


def train(cfg, plan: TrainingPlan, prepared, tokenizer, model, accelerator) -> dict:
    output_dir = Path(cfg.output_dir)
    world_size, rank = accelerator.num_processes, accelerator.process_index
    accum = cfg.gradient_accumulation_steps
    lengths = np.asarray(prepared.train["length"])
    targets_per_row = np.asarray(prepared.train["n_targets"])
    spec = train_spec(cfg, world_size)
    packed = plan.batching == "packed"
    collate = Collator(prepared.train, tokenizer.pad_token_id, packed,
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
    metrics = MetricsLog(output_dir / "metrics.jsonl", accelerator.is_main_process)
    eval_at, save_at = set(plan.eval_steps_at), set(plan.save_steps_at)

    def run_eval(at_step: int) -> dict:
        result = evaluate(accelerator.unwrap_model(model), eval_batches, eval_collate, accelerator)
        metrics.write({"step": at_step, "epoch": round(at_step / plan.steps_per_epoch, 4), **result})
        return result

    evals = [run_eval(0)] if 0 in eval_at else []
    step, tokens_seen, real_tokens_seen = 0, 0, 0
    window_loss = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    window_tokens, window_real, window_start = 0, 0, time.perf_counter()
    train_start = time.perf_counter()
    model.train()

    for epoch in range(plan.epochs_to_run):
        per_rank = epoch_micro_batches(lengths, spec, epoch)
        for start in range(0, plan.micro_batches_per_epoch, accum):
            if step == plan.total_steps:
                break
            step_tokens = sum(int(targets_per_row[row].sum()) for batches in per_rank
                              for micro in batches[start:start + accum] for row in micro)
            window = per_rank[rank][start:start + accum]
            for index, rows in enumerate(window):
                batch = collate(rows).to(accelerator.device)
                last = index == len(window) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    with accelerator.autocast():
                        logits = model(**batch.inputs).logits
                    loss_sum = summed_token_loss(logits, batch.targets)
                    accelerator.backward(loss_sum * (world_size / step_tokens))
                window_loss += loss_sum.detach().double()
                window_real += batch.n_real_tokens
                del logits, loss_sum
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            lr = scheduler.get_last_lr()[0]  # the rate this update used
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += step_tokens
            window_tokens += step_tokens

            if step % cfg.logging_steps == 0 or step == plan.total_steps:
                # the only host sync of a training step, and only at logging steps
                loss = float(accelerator.reduce(window_loss, reduction="sum")) / window_tokens
                real = int(accelerator.reduce(torch.tensor(window_real, device=accelerator.device),
                                              reduction="sum"))
                elapsed = time.perf_counter() - window_start
                metrics.write({"step": step, "epoch": round(step / plan.steps_per_epoch, 4), "loss": loss,
                               "lr": lr, "grad_norm": float(grad_norm),
                               "tokens": tokens_seen, "tokens_per_second": round(window_tokens / elapsed, 1),
                               "real_tokens_per_second": round(real / elapsed, 1)})
                real_tokens_seen += real
                window_loss.zero_()
                window_tokens, window_real, window_start = 0, 0, time.perf_counter()
            if step in eval_at:
                evals.append(run_eval(step))
            if step in save_at:
                state = {"step": step, "epoch": epoch, "tokens_seen": tokens_seen, "plan": plan.to_json()}
                save_checkpoint(output_dir, step, state, model, optimizer, scheduler, accelerator,
                                cfg.save_total_limit)

    train_seconds = time.perf_counter() - train_start
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_final(accelerator.unwrap_model(model), tokenizer, output_dir)
    summary = {"steps": step, "tokens": tokens_seen, "real_tokens": real_tokens_seen,
               "train_seconds": round(train_seconds, 2),
               "real_tokens_per_second": round(real_tokens_seen / train_seconds, 1) if train_seconds else None,
               "first_eval_loss": evals[0]["eval_loss"] if evals else None,
               "last_eval_loss": evals[-1]["eval_loss"] if evals else None}
    if accelerator.is_main_process:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def save_final(model, tokenizer, output_dir: Path) -> None:
    """A standard Hugging Face folder: from_pretrained(output_dir) loads it (the adapter, for LoRA)."""
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = True  # off for training (packing needs it off); on for whoever generates next
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
