"""Preference losses (DPO with its loss types, dpo_loss_types.py; ORPO; SimPO; KTO) on pairs of sequences.

A micro-batch holds whole pairs: sequence 2j is pair j's prompt + chosen reply, sequence 2j+1 its prompt +
rejected reply, padded side by side or packed (data/collate.py numbers every sequence in `sequence_index`).
KTO's unit is a labelled row, also two sequences: its prompt + its reply, and its prompt + another row's reply,
whose log-ratios estimate the KL term (as TRL does, from mismatched prompts and completions).
The policy's log-probability of each reply is a sum over its target tokens, which the output projection
meets only at target positions, a chunk at a time: the [tokens, vocabulary] logits are never whole.

Each loss is summed over the micro-batch's pairs (KTO: rows); the loop divides by the pairs of the whole step
(all micro-batches, all ranks), so accumulation and ranks change nothing (unit "pairs"). KTO's KL estimate is
the mean over the micro-batch's rows on its rank (TRL also averages it over the ranks): with KTO, and only
there, the micro-batch size is part of the loss.

The reference model (of the methods that use one) is the policy's starting point, frozen: with a LoRA adapter, the same
model with its adapter switched off (no second copy); in full fine-tuning, a frozen copy made before the
first step; or neither, when `precompute_ref_log_probs` computed its log-probs once before training (the
batch then carries them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tuneloop.dpo_loss_types import DPO_LOSS_TYPES
from tuneloop.log_probs import reference_mode, sequence_log_probs
from tuneloop.registry import Registry
from tuneloop.rl_methods import RL_METHODS, setting


@dataclass(frozen=True)
class PairLosses:
    """The run's method and its settings: each key the method reads (rl_methods.py), the config's value or the
    method's default; the DPO family's losses and their weights."""

    method: str  # an RL_METHODS name
    loss_types: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    orpo_alpha: float = 0.0
    kto_desirable_weight: float = 1.0  # KTO's weights of desirable and undesirable rows
    kto_undesirable_weight: float = 1.0
    simpo_gamma: float = 0.5  # SimPO's target margin, and the weight of its NLL term (TRL's CPO defaults)
    cpo_alpha: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> "PairLosses":
        method = RL_METHODS[cfg.rl]
        types = tuple(cfg.dpo_loss_type or method.loss_types[:1])  # the method's first loss by default
        read = {key: setting(cfg, key) for key in method.keys if key in SETTING_KEYS}
        return cls(cfg.rl, types, tuple(cfg.dpo_loss_weights or [1.0] * len(types)), cfg.beta, **read)


SETTING_KEYS = {"dpo_label_smoothing", "orpo_alpha", "kto_desirable_weight", "kto_undesirable_weight",
                "simpo_gamma", "cpo_alpha"}


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor,
               settings: PairLosses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and (chosen, rejected) rewards. `policy`, `reference`, `counts`: [2 × pairs], chosen at
    even positions. The loss is the weighted sum of the run's loss types (dpo_loss_types.py's DPO_LOSS_TYPES)."""
    beta = settings.beta
    chosen_ratio = policy[0::2] - reference[0::2]
    rejected_ratio = policy[1::2] - reference[1::2]
    total = torch.zeros_like(chosen_ratio)
    for name, weight in zip(settings.loss_types, settings.weights):
        total = total + weight * DPO_LOSS_TYPES[name](chosen_ratio, rejected_ratio, counts, settings)
    return total, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def orpo_losses(policy: torch.Tensor, reference: None, counts: torch.Tensor,
                settings: PairLosses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO per pair: the chosen reply's mean token NLL minus alpha × log σ(log odds ratio), the odds taken on
    log-probs averaged per token; rewards are alpha × those averages (as TRL reports them)."""
    chosen, rejected = policy[0::2] / counts[0::2], policy[1::2] / counts[1::2]

    def log_one_minus_exp(x):  # log(1 - e^x) for x < 0, stable near 0
        return torch.log(-torch.expm1(x.clamp(max=-1e-7)))

    log_odds = (chosen - rejected) - (log_one_minus_exp(chosen) - log_one_minus_exp(rejected))
    alpha = settings.orpo_alpha
    loss = -chosen - alpha * F.logsigmoid(log_odds)
    return loss, alpha * chosen.detach(), alpha * rejected.detach()


def simpo_losses(policy: torch.Tensor, reference: None, counts: torch.Tensor,
                 settings: PairLosses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO per pair, as axolotl runs it (TRL's CPO trainer, loss_type simpo): -log σ(β(ā_c − ā_r) − γ) on
    log-probs averaged per reply token, plus cpo_alpha × the chosen reply's mean token NLL (0: SimPO alone);
    rewards are β × the averages."""
    chosen, rejected = policy[0::2] / counts[0::2], policy[1::2] / counts[1::2]
    loss = -F.logsigmoid(settings.beta * (chosen - rejected) - settings.simpo_gamma) - settings.cpo_alpha * chosen
    return loss, settings.beta * chosen.detach(), settings.beta * rejected.detach()


def kto_losses(policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor,
               settings: PairLosses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO per row (eq. 7 of its paper, as TRL computes it): w_d (1 - σ(β(r - z))) for a desirable reply,
    w_u (1 - σ(β(z - r))) for an undesirable one, where r is the reply's log-ratio and z the KL estimate: the
    mean log-ratio of the mismatched replies (odd sequences), at least 0, with no gradient. Returns (losses,
    rewards β·r, z)."""
    ratios = policy - reference
    kl = ratios[1::2].detach().mean().clamp(min=0)
    reply = ratios[0::2]
    beta = settings.beta
    losses = torch.where(desirable, settings.kto_desirable_weight * (1 - torch.sigmoid(beta * (reply - kl))),
                         settings.kto_undesirable_weight * (1 - torch.sigmoid(beta * (kl - reply))))
    return losses, beta * reply.detach(), kl


# what a micro-batch reports besides its loss: sums, summarised per unit by `summarise_*` (train and eval lines)
PAIR_STAT_WIDTH = 3  # reward of the chosen replies, of the rejected ones, pairs ranked right
KTO_STAT_WIDTH = 6  # reward of desirable rows, their count, of undesirable rows, their count, KL estimate, batches


def summarise_pairs(stats: list[float], pairs: int) -> dict:
    chosen, rejected, correct = (value / max(pairs, 1) for value in stats)
    return {"reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected,
            "reward_accuracy": correct}


def summarise_rows(stats: list[float], rows: int) -> dict:
    """KTO: rewards averaged over the desirable and the undesirable rows apart, and the mean KL estimate."""
    desirable_sum, desirable, undesirable_sum, undesirable, kl_sum, batches = stats
    chosen = desirable_sum / desirable if desirable else 0.0
    rejected = undesirable_sum / undesirable if undesirable else 0.0
    return {"reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected,
            "kl": kl_sum / max(batches, 1)}


def pairwise(per_pair):
    """A loss over pairs (chosen at even sequences, rejected at odd) as the objective sums it: (the losses summed,
    the stats: the chosen and rejected rewards summed, the pairs ranked right)."""
    def loss(policy, reference, counts, extra, settings):
        losses, chosen, rejected = per_pair(policy, reference, counts, settings)
        return losses.sum(), torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).sum().float()]).double()
    return loss


def kto_loss(policy, reference, counts, extra, settings):
    """KTO over labelled rows: (the losses summed, the stats: each label's rewards and rows, the KL estimate)."""
    desirable = extra["desirable"]
    losses, rewards, kl = kto_losses(policy, reference, desirable, settings)
    wanted = desirable.double()
    stats = torch.stack([(rewards * wanted).sum(), wanted.sum(), (rewards * (1 - wanted)).sum(),
                         (1 - wanted).sum(), kl.double(), torch.ones_like(kl, dtype=torch.float64)])
    return losses.sum(), stats.double()


# `rl:` name -> (policy log-probs, reference log-probs or None, target counts, extra, settings) -> (loss summed over
# the units, stats): one entry per RL_METHODS name (a test checks that the two tables name the same methods)
LOSSES: Registry = Registry("preference loss", "rl")
LOSSES.add("dpo", pairwise(dpo_losses))
LOSSES.add("ipo", pairwise(dpo_losses))  # dpo_losses with the IPO loss type
LOSSES.add("orpo", pairwise(orpo_losses))
LOSSES.add("kto", kto_loss)
LOSSES.add("simpo", pairwise(simpo_losses))


class PreferenceLoss:
    """The objective's loss function: (model, inputs, targets, extra) -> (loss summed over units, stats)."""

    def __init__(self, settings: PairLosses, reference_model=None):
        method = RL_METHODS[settings.method]
        self.settings, self.loss = settings, LOSSES[settings.method]
        self.uses_reference = method.uses_reference
        self.reference_model = reference_model  # full fine-tuning's frozen copy; None: LoRA's base, or precomputed
        self.stat_width = PAIR_STAT_WIDTH if method.paired else KTO_STAT_WIDTH
        self.summarise = summarise_pairs if method.paired else summarise_rows
        self.unit_name = method.unit

    def reference_log_probs(self, model, inputs, targets, extra) -> torch.Tensor:
        if "reference" in extra:
            return extra["reference"].float()
        with torch.no_grad():
            if self.reference_model is not None:
                return sequence_log_probs(self.reference_model, inputs, targets, extra["sequence_index"],
                                          extra["n_sequences"])[0]
            with reference_mode(model):
                return sequence_log_probs(model, inputs, targets, extra["sequence_index"], extra["n_sequences"])[0]

    def __call__(self, model, inputs: dict, targets: torch.Tensor, extra: dict):
        policy, counts = sequence_log_probs(model, inputs, targets, extra["sequence_index"], extra["n_sequences"])
        reference = self.reference_log_probs(model, inputs, targets, extra) if self.uses_reference else None
        return self.loss(policy, reference, counts, extra, self.settings)

    @torch.no_grad()
    def eval_sums(self, model, inputs: dict, targets: torch.Tensor, extra: dict) -> torch.Tensor:
        """[loss, units, the stats], summed over the micro-batch's units."""
        loss, stats = self(model, inputs, targets, extra)
        units = torch.tensor([extra["n_sequences"] // 2], dtype=torch.float64, device=stats.device)
        return torch.cat([loss.double().reshape(1), units, stats])

    def eval_metrics(self, totals: list[float]) -> dict:
        loss, units, stats = totals[0], int(totals[1]), totals[2:]
        summary = {f"eval_{name}": value for name, value in self.summarise(stats, units).items()}
        return {"eval_loss": loss / max(units, 1), **summary, f"eval_{self.unit_name}": units}
