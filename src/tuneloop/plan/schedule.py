"""When things happen in a run: the warm-up's length, and the steps at which it evaluates and saves.

One schedule for prepared and streamed runs. "Per epoch" settings (evals_per_epoch, saves_per_epoch) count
over an epoch of the prepared data; a stream has no epochs known beforehand, so for it they count over the
whole run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    warmup_steps: int
    eval_steps_at: list[int]  # step 0 is an eval before the first step (eval_on_start)
    save_steps_at: list[int]  # the final model is saved after the last step, not as a checkpoint


def recurring(total: int, steps_per_epoch: int, every: int | float | None, per_epoch: int | None,
              default_per_epoch: int = 1) -> list[int]:
    """Step numbers (1-based) at which something recurring happens: every N steps, every fraction of the run,
    or N times an epoch."""
    if every is not None:
        interval = max(1, math.ceil(total * every)) if every < 1 else int(every)
        return list(range(interval, total + 1, interval))
    per_epoch = default_per_epoch if per_epoch is None else per_epoch
    steps = set()
    for epoch in range(math.ceil(total / steps_per_epoch)):
        for k in range(1, per_epoch + 1):
            steps.add(epoch * steps_per_epoch + max(1, round(steps_per_epoch * k / per_epoch)))
    return sorted(step for step in steps if step <= total)


def run_schedule(cfg, total_steps: int, steps_per_epoch: int | None, eval_rows: int) -> Schedule:
    """`steps_per_epoch` None: a stream (its "epoch" is the whole run)."""
    per_epoch = steps_per_epoch or total_steps
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil((cfg.warmup_ratio or 0) * total_steps)
    # evals_per_epoch: 0 and eval_strategy: no turn evaluation off, the final eval included
    has_eval = eval_rows > 0 and cfg.evals_per_epoch != 0 and cfg.eval_strategy != "no"
    eval_at = recurring(total_steps, per_epoch, cfg.eval_steps, cfg.evals_per_epoch) if has_eval else []
    if has_eval and total_steps not in eval_at:
        eval_at.append(total_steps)  # the final model is always evaluated
    if has_eval and cfg.eval_on_start:
        eval_at.insert(0, 0)
    saves_off = cfg.save_strategy == "no" or cfg.saves_per_epoch == 0
    save_at = [] if saves_off else [step for step in recurring(total_steps, per_epoch, cfg.save_steps,
                                                               cfg.saves_per_epoch) if step < total_steps]
    if cfg.save_strategy == "best":  # every eval may save: the loop saves at those that improve the metric
        save_at = [step for step in eval_at if 0 < step < total_steps]
    return Schedule(warmup, eval_at, save_at)
