"""The run state: everything a resumed run needs to continue exactly where a checkpoint left off.

The loop advances one RunState; a checkpoint writes it whole and a resume reads it whole, so a
counter added here is saved and restored by construction. Its counters go to the checkpoint's
JSON marker; each rank's RNG state (dropout draws differ per rank) to a file of its own.

Not in it, on purpose: the loss window being averaged for the next train line (every save step is
also a logging step, so the window is empty when a checkpoint is written) and this session's
throughput counters (a resumed run measures its own speed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RunState:
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # target tokens trained on, all ranks
    targets_collated: int = 0  # target tokens this rank's collator produced: the loss's denominators, summed
    evals: list[dict] = field(default_factory=list)  # every eval's metrics, with its step
    best_metric: float | None = None  # the best eval's metric_for_best_model (eval_loss unless the config says)
    best_step: int | None = None  # the step of that eval (save_strategy: best keeps its checkpoint from pruning)
    evals_without_improvement: int = 0
    # the loss watchdog's streaks on this rank ([not finite, too high]): a streak that a checkpoint
    # interrupts goes on counting after the resume, so a patience of 3 means 3 steps however it was saved
    bad_steps_in_a_row: list[int] = field(default_factory=lambda: [0, 0])

    def record_eval(self, step: int, metrics: dict, metric: str = "eval_loss", greater_is_better: bool = False) -> bool:
        """Adds an eval; True when its `metric` is the best so far (what early stopping, save_strategy: best and
        load_best_model_at_end keep). A tie is not an improvement, as in the Trainer; nor is the eval before the
        first step (eval_on_start), which the Trainer leaves out too: the untrained model is never "the best"."""
        self.evals.append({"step": step, **metrics})
        if step == 0:
            return False
        value, best = metrics[metric], self.best_metric
        if best is None or (value > best if greater_is_better else value < best):
            self.best_metric, self.best_step, self.evals_without_improvement = value, step, 0
            return True
        self.evals_without_improvement += 1
        return False

    def plateaued(self, patience: int | None) -> bool:
        return patience is not None and self.evals_without_improvement >= patience

    def to_json(self, targets_per_rank: list[int], streaks_per_rank: list[list[int]]) -> dict:
        """The counters as the checkpoint marker stores them (each rank's own counters, gathered)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "targets_collated": targets_per_rank,
                "evals": self.evals, "best_metric": self.best_metric, "best_step": self.best_step,
                "evals_without_improvement": self.evals_without_improvement,
                "bad_steps_in_a_row": streaks_per_rank}

    @classmethod
    def from_json(cls, data: dict, rank: int, world_size: int) -> "RunState":
        counts = data.get("targets_collated", [])  # one per rank (a forced resume may change the ranks)
        same_ranks = len(counts) == world_size
        streaks = data.get("bad_steps_in_a_row", [])  # absent in checkpoints written before it was kept
        return cls(step=data["step"], tokens_seen=data["tokens_seen"],
                   targets_collated=counts[rank] if same_ranks else 0, evals=list(data["evals"]),
                   # (checkpoints written before the metric could be chosen held eval_loss's as best_eval_loss)
                   best_metric=data.get("best_metric", data.get("best_eval_loss")), best_step=data.get("best_step"),
                   evals_without_improvement=data["evals_without_improvement"],
                   # with other ranks, the longest streak of any old rank carries on (the stricter reading)
                   bad_steps_in_a_row=(list(streaks[rank]) if same_ranks and len(streaks) == world_size
                                       else [max(s[i] for s in streaks) for i in range(2)] if streaks else [0, 0]))


def rng_states() -> dict:
    """This process's random generators (python, numpy, torch and CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
