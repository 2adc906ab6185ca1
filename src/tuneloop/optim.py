"""Optimizers and learning-rate schedules: one registry entry each, built from the config and the plan.

An optimizer entry says how to build it, how many bytes of state it keeps per trained parameter
(the plan's memory estimate reads it), and whether it needs a CUDA GPU or another library (host/hardware.py
refuses it when `train` starts on a machine without them; the config and the plan accept it). A
scheduler entry builds a torch LR scheduler that the loop steps once per optimizer
step. torch is imported inside the builders: the config reads these tables before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from tuneloop.registry import Registry

# The config validates `optimizer:` and `lr_scheduler:` against the tables below, so this module sits
# under the config and does not import it: `cfg` is the run's TuneloopConfig, `plan` its TrainingPlan.

NO_DECAY_NAMES = ("bias", "norm", "layernorm", "ln_")


@dataclass(frozen=True)
class OptimizerKind:
    build: Callable  # (parameter groups, cfg) -> torch.optim.Optimizer; with `by_name`: (named parameters, cfg)
    state_bytes_per_param: float  # optimizer state kept per trained parameter, for the memory estimate
    needs_cuda: bool = False
    library: str | None = None  # the package it comes from, when not torch or transformers
    by_name: bool = False  # it sorts the parameters itself, by name (Muon: hidden matrices apart from the rest)
    # state kept per trained hidden-matrix weight where it differs from the rest's (Muon: momentum only, 4 bytes)
    hidden_matrix_state_bytes: float | None = None
    words: Callable | None = None  # (cfg) -> how it steps, for the plan, where its name does not say it all


def _adamw(fused: bool):
    def build(groups, cfg):
        import torch

        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.adamw_betas,
                                 eps=cfg.adam_epsilon, fused=fused)
    return build


def _sgd(groups, cfg):
    import torch

    return torch.optim.SGD(groups, lr=cfg.learning_rate)


def _adafactor(groups, cfg):
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=cfg.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)


def _library_adamw(module: str, name: str):
    """An AdamW of another library (bitsandbytes' 8-bit and paged ones, torchao's low-bit ones)."""
    def build(groups, cfg):
        import importlib

        optimizer_class = getattr(importlib.import_module(module), name)
        return optimizer_class(groups, lr=cfg.learning_rate, betas=cfg.adamw_betas,
                               eps=cfg.adam_epsilon)
    return build


OPTIMIZERS: Registry[OptimizerKind] = Registry("optimizer", "optimizer")
OPTIMIZERS.add("adamw_torch", OptimizerKind(_adamw(fused=False), state_bytes_per_param=8))
# fused AdamW is the Trainer's default too: on a 135M model its step took 88 ms against 554 ms (CPU)
OPTIMIZERS.add("adamw_torch_fused", OptimizerKind(_adamw(fused=True), state_bytes_per_param=8))
OPTIMIZERS.add("sgd", OptimizerKind(_sgd, state_bytes_per_param=0))
OPTIMIZERS.add("adafactor", OptimizerKind(_adafactor, state_bytes_per_param=4))
# two states of one byte each (8-bit) or half a byte (4-bit), plus small per-block scales
# bitsandbytes steps them on the CPU too (its CPU backend; asked at start-up: hardware.optimizer_refusal)
OPTIMIZERS.add("adamw_bnb_8bit", OptimizerKind(_library_adamw("bitsandbytes.optim", "AdamW8bit"), 2, False,
                                               "bitsandbytes"), aliases=("adamw_8bit",))
OPTIMIZERS.add("paged_adamw_8bit", OptimizerKind(_library_adamw("bitsandbytes.optim", "PagedAdamW8bit"), 2, False,
                                                 "bitsandbytes"))
OPTIMIZERS.add("paged_adamw_32bit", OptimizerKind(_library_adamw("bitsandbytes.optim", "PagedAdamW32bit"), 8, False,
                                                  "bitsandbytes"))
def _muon(named_parameters, cfg):
    from tuneloop.muon import build_muon

    return build_muon(named_parameters, cfg, NO_DECAY_NAMES)


def _muon_words(cfg) -> str:
    from tuneloop.muon import muon_words

    return muon_words(cfg)


# axolotl's Muon (tuneloop/muon.py): momentum for the hidden matrices, AdamW's two states for the rest
OPTIMIZERS.add("muon", OptimizerKind(_muon, state_bytes_per_param=8, by_name=True, hidden_matrix_state_bytes=4,
                                     words=_muon_words))
OPTIMIZERS.add("adamw_torch_8bit", OptimizerKind(_library_adamw("torchao.optim", "AdamW8bit"), 2, True, "torchao"))
OPTIMIZERS.add("adamw_torch_4bit", OptimizerKind(_library_adamw("torchao.optim", "AdamW4bit"), 1, True, "torchao"))


def parameter_groups(named_parameters, weight_decay: float, rates: LoraPlusRates | None = None) -> list[dict]:
    """Weight decay on weight matrices only, as the Trainer does: not on biases or norms. With LoRA+ `rates`, each
    of the two is split again by learning rate (LoraPlusRates), always into the same six groups, empty or not, so a
    checkpoint's optimizer state fits every start."""
    kinds = (None,) if rates is None else LoraPlusRates.KINDS
    groups = {(decays, kind): [] for kind in kinds for decays in (True, False)}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        skip = param.ndim < 2 or any(part in name.lower() for part in NO_DECAY_NAMES)
        groups[(not skip, None if rates is None else rates.kind(name, param))].append(param)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0,
             **({} if kind is None else {"lr": rates.rate_of(kind)})}
            for (decays, kind), params in groups.items()]


@dataclass(frozen=True)
class LoraPlusRates:
    """LoRA+ (Hayou et al. 2024, axolotl's `loraplus_lr_ratio`): the B matrices learn `ratio` times faster than the
    A matrices. Parameters are sorted as peft's create_loraplus_optimizer sorts them, by name, so fp32 masters
    (named as their weights) sort the same: an embedding's LoRA learns at its own rate; lora_B and every 1-D
    trained parameter (a bias, DoRA's magnitudes) at learning_rate × ratio; the rest (lora_A, a fully trained
    module) at learning_rate."""

    learning_rate: float
    ratio: float
    embedding_rate: float
    KINDS = ("base", "fast", "embedding")

    @staticmethod
    def kind(name: str, param) -> str:
        if "lora_embedding_A" in name or "lora_embedding_B" in name:
            return "embedding"
        return "fast" if "lora_B" in name or param.ndim == 1 else "base"

    def rate_of(self, kind: str) -> float:
        return {"base": self.learning_rate, "fast": self.learning_rate * self.ratio,
                "embedding": self.embedding_rate}[kind]


def loraplus_rates(cfg) -> LoraPlusRates | None:
    if cfg.loraplus_lr_ratio is None:
        return None
    return LoraPlusRates(cfg.learning_rate, cfg.loraplus_lr_ratio, cfg.loraplus_embedding_lr)


def build_optimizer(cfg, model, named_parameters=None):
    """Over the model's parameters, or over `named_parameters` where they are not the model's own (fp32 masters:
    engines/masters.py). (hardware.check_hardware has refused an optimizer this machine cannot run, before
    training.) Each group's learning rate is its peak: the scheduler's multiplier scales every group's."""
    named = model.named_parameters() if named_parameters is None else named_parameters
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.by_name:
        return kind.build(named, cfg)
    return kind.build(parameter_groups(named, cfg.weight_decay, loraplus_rates(cfg)), cfg)


def optimizer_words(cfg) -> str | None:
    """How the optimizer steps, where its name does not say it all (Muon: how it splits the weights)."""
    words = OPTIMIZERS[cfg.optimizer].words
    return words(cfg) if words is not None else None


# ---- learning-rate schedules -------------------------------------------------------------------

def lr_multiplier(step: int, plan, kind: str, min_ratio: float, quadratic_warmup: bool = False,
                  decay_end_ratio: float | None = None) -> float:
    """Multiplier of the peak learning rate for the update that makes optimizer step `step + 1`: a warm-up
    (linear, or quadratic as axolotl's `lr_quadratic_warmup`), then the decay down to `min_ratio`, which ends at
    `decay_end_ratio` of the run where that is set (then the floor holds: axolotl's cosine_constant_lr_ratio,
    whose constant phase starts at int(total × ratio) as axolotl counts it)."""
    warmup = plan.warmup_steps
    if step < warmup:
        rise = (step + 1) / (warmup + 1)
        return rise * rise if quadratic_warmup else rise
    if kind == "constant":
        return 1.0
    end = max(warmup, int(plan.total_steps * decay_end_ratio)) if decay_end_ratio else plan.total_steps
    decay_steps = max(1, end - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if kind == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _warmup_then(kind: str):
    """A warm-up to the peak, then `kind` (cosine, linear or constant) down to cosine_min_lr_ratio."""
    def build(optimizer, cfg, plan):
        import torch

        min_ratio = cfg.cosine_min_lr_ratio or 0.0
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(
            step, plan, kind, min_ratio, cfg.lr_quadratic_warmup, cfg.cosine_constant_lr_ratio))
    return build


def schedule_words(cfg) -> str:
    """The schedule as the plan names it: the scheduler and what shapes it beyond its name."""
    shapes = ["quadratic warm-up"] if cfg.lr_quadratic_warmup else []
    if cfg.cosine_constant_lr_ratio:
        shapes.append(f"decay to {cfg.cosine_min_lr_ratio or 0:g}× by {cfg.cosine_constant_lr_ratio:.0%} of the "
                      "run, then constant")
    return cfg.lr_scheduler + (f" ({'; '.join(shapes)})" if shapes else "")


def _one_cycle(optimizer, cfg, plan):
    """axolotl's one_cycle: torch's OneCycleLR with the warm-up as its rising phase, from
    learning_rate / lr_div_factor (axolotl's default 6) up to learning_rate, then a cosine down to
    1e4 times less than where it started. As in torch, and so in axolotl, the momentum (AdamW's beta1,
    which replaces adam_beta1) cycles the other way, 0.95 -> 0.85 -> 0.95, where the optimizer has one."""
    import torch

    has_momentum = "betas" in optimizer.defaults or bool(optimizer.defaults.get("momentum"))
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.learning_rate, total_steps=plan.total_steps,
        # the cycle needs a step after its rise (torch divides by the fall's length)
        pct_start=min(plan.warmup_steps, plan.total_steps - 1) / plan.total_steps, div_factor=cfg.lr_div_factor or 6.0,
        cycle_momentum=has_momentum)


SCHEDULERS: Registry[Callable] = Registry("learning-rate scheduler", "lr_scheduler")
SCHEDULERS.add("cosine", _warmup_then("cosine"), aliases=("cosine_with_min_lr",))  # floor: cosine_min_lr_ratio
SCHEDULERS.add("linear", _warmup_then("linear"))
SCHEDULERS.add("constant", _warmup_then("constant"), aliases=("constant_with_warmup",))
SCHEDULERS.add("one_cycle", _one_cycle)


def build_scheduler(cfg, plan, optimizer):
    """Stepped by the loop once per optimizer step; its last rate is the one the next update uses."""
    return SCHEDULERS[cfg.lr_scheduler](optimizer, cfg, plan)
