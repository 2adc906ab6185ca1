"""Optimizers and learning-rate schedules, built from the config and the plan's step counts."""

from __future__ import annotations

import math

import torch

from tuneloop.config import TuneloopConfig
from tuneloop.plan import TrainingPlan

NO_DECAY_NAMES = ("bias", "norm", "layernorm", "ln_")


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only, as the Trainer does: not on biases or norms."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        skip = param.ndim < 2 or any(part in name.lower() for part in NO_DECAY_NAMES)
        (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TuneloopConfig, model) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.optimizer in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_epsilon, fused=cfg.optimizer == "adamw_torch_fused")
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.learning_rate)
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=cfg.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)


def lr_multiplier(step: int, plan: TrainingPlan, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for the update that makes optimizer step `step + 1`."""
    warmup = plan.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    decay_steps = max(1, plan.total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if kind == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: TuneloopConfig, plan: TrainingPlan, optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    min_ratio = cfg.cosine_min_lr_ratio or 0.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, plan, cfg.lr_scheduler, min_ratio))
