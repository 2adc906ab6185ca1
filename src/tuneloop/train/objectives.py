"""What a step minimises: one registry entry per training objective, each with its unit of normalisation.

An objective runs the model on a micro-batch and returns a *summed* loss, and says what that sum is over
(its unit): the language-model loss sums cross-entropy over target tokens, so a step's loss is that sum
divided by the target tokens of the whole step (all micro-batches, all ranks), which the host knows before
the step. Preference objectives (RL_METHODS; their LOSSES in train/preference.py) sum over pairs (KTO: rows) and
normalise by the pairs of the step, in the same loop; so does a reward model's Bradley-Terry loss
(train/reward_model.py), on a sequence classifier's scores.

The model and its objective are one module for the loop (`ObjectiveModule`), so DDP, FSDP2 and DeepSpeed
wrap the loss computation too: the language-model loss meets the output projection in chunks
(chunked_loss.py) and never holds the [tokens, vocabulary] logits whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.registry import Registry
from tuneloop.rl_methods import (ONLINE_METHODS, PROCESS_REWARD_OBJECTIVE, REWARD_MODEL_OBJECTIVE, RL_METHODS,
                                   objective_name)
from tuneloop.kernels.output_head import output_head
from tuneloop.train.chunked_loss import chunked_linear_cross_entropy, chunked_loss_and_correct

def summed_token_loss(logits, targets):
    """Sum (not mean) of cross-entropy over target positions; the caller divides by the step's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def correct_predictions(logits, targets):
    mask = targets != IGNORE_INDEX
    return (logits.argmax(dim=-1).eq(targets) & mask).sum()


def language_model_loss(model, inputs: dict, targets: torch.Tensor, chunked: bool = True) -> torch.Tensor:
    head = output_head(model) if chunked else None
    if head is None:
        return summed_token_loss(model(**inputs).logits, targets)
    decoder, weight = head
    hidden = decoder(**inputs).last_hidden_state
    return chunked_linear_cross_entropy(hidden, weight, targets)


@torch.no_grad()
def language_model_eval(model, inputs: dict, targets: torch.Tensor,
                        chunked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, correct argmax predictions) over the target tokens."""
    head = output_head(model) if chunked else None
    if head is None:
        logits = model(**inputs).logits
        return summed_token_loss(logits, targets).double(), correct_predictions(logits, targets)
    decoder, weight = head
    return chunked_loss_and_correct(decoder(**inputs).last_hidden_state, weight, targets)


def _language_model_eval_sums(model, inputs: dict, targets: torch.Tensor, extra: dict, chunked: bool) -> torch.Tensor:
    """[summed loss, correct predictions, target tokens]."""
    loss, correct = language_model_eval(model, inputs, targets, chunked=chunked)
    count = (targets != IGNORE_INDEX).sum()
    return torch.stack([loss.double(), correct.double(), count.double()])


def language_model_eval_metrics(totals: list[float]) -> dict:
    loss_sum, correct, n_targets = totals
    n_targets = int(n_targets)
    loss = loss_sum / max(n_targets, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_token_accuracy": correct / max(n_targets, 1), "eval_tokens": n_targets}


@dataclass(frozen=True)
class Objective:
    # (model, inputs, targets, extra) -> (the loss summed over the unit: a scalar tensor, stats or None); `extra`
    # holds what the collator adds besides inputs and targets (a pair's sequence numbers, reference log-probs)
    summed_loss: Callable
    eval_sums: Callable  # (model, inputs, targets, extra) -> a 1-D tensor of sums, no gradients
    eval_metrics: Callable  # (the eval sums over every batch and rank, as floats) -> the eval line
    unit: str  # what the sum runs over, and what a step's loss is averaged over: "tokens" or "pairs"
    eval_width: int  # how many sums eval_sums returns
    stat_width: int = 0  # how many sums `stats` holds
    summarise: Callable | None = None  # (the stats summed over a window, its units) -> the train line's numbers
    name: str = "language_model"


def _without_stats(loss_function):
    def summed_loss(model, inputs, targets, extra):
        return loss_function(model, inputs, targets), None
    return summed_loss


def _language_model(cfg) -> Objective:
    """Chunked unless the config says `chunked_cross_entropy: false` (axolotl's key): the same loss from whole
    logits, for comparison or a model whose head the chunked path does not know."""
    chunked = cfg is None or cfg.chunked_cross_entropy is not False
    return Objective(_without_stats(partial(language_model_loss, chunked=chunked)),
                     partial(_language_model_eval_sums, chunked=chunked), language_model_eval_metrics, unit="tokens",
                     eval_width=3)


def _preference(cfg, reference_model=None) -> Objective:
    """A preference method's loss (train/preference.py's LOSSES): per pair, or per labelled row (KTO)."""
    from tuneloop.train.preference import PairLosses, PreferenceLoss

    loss = PreferenceLoss(PairLosses.from_config(cfg), reference_model)
    return Objective(loss, loss.eval_sums, loss.eval_metrics, unit=RL_METHODS[cfg.rl].unit,
                     eval_width=2 + loss.stat_width, stat_width=loss.stat_width, summarise=loss.summarise,
                     name=cfg.rl)


def _online_rl(cfg, reference_model=None) -> Objective:
    """GRPO's clipped objective over generated completions (online_rl/loss.py): its unit is the loss type's; the
    reference model's log-probs come with the batch, computed when the completions were made."""
    from tuneloop.online_rl.loss import GRPOLoss
    from tuneloop.online_rl.rewards import online_reward_names

    settings = cfg.trl_settings
    loss = GRPOLoss(settings, online_reward_names(cfg))

    def no_eval(*_):  # (the config refuses an eval set under online RL)
        raise RuntimeError("online RL has no eval set")

    return Objective(loss, no_eval, no_eval, unit=settings.unit, eval_width=0, stat_width=loss.stat_width,
                     summarise=loss.summarise, name=cfg.rl)


def _reward_model(cfg, reference_model=None) -> Objective:
    """A reward model's Bradley-Terry loss over pairs (train/reward_model.py); no reference."""
    from tuneloop.train.reward_model import BradleyTerryLoss

    loss = BradleyTerryLoss(cfg.center_rewards_coefficient or 0.0)
    return Objective(loss, loss.eval_sums, loss.eval_metrics, unit="pairs", eval_width=2 + loss.stat_width,
                     stat_width=loss.stat_width, summarise=loss.summarise, name=REWARD_MODEL_OBJECTIVE)


def _process_reward_model(cfg, reference_model=None) -> Objective:
    """A process reward model's token-classification loss over the labelled step ends
    (train/process_reward_model.py)."""
    from tuneloop.train.process_reward_model import TokenClassificationLoss

    loss = TokenClassificationLoss()
    return Objective(loss, loss.eval_sums, loss.eval_metrics, unit="tokens", eval_width=3,
                     stat_width=loss.stat_width, summarise=loss.summarise, name=PROCESS_REWARD_OBJECTIVE)


# `rl:` name -> (cfg, reference model or None) -> Objective; supervised fine-tuning is "language_model", a reward
# model (`reward_model: true`) "bradley_terry" (rl_methods.objective_name says which a config trains)
OBJECTIVES: Registry[Callable] = Registry("training objective", "rl")
OBJECTIVES.add(REWARD_MODEL_OBJECTIVE, _reward_model)
OBJECTIVES.add(PROCESS_REWARD_OBJECTIVE, _process_reward_model)
OBJECTIVES.add("language_model", lambda cfg, reference_model=None: _language_model(cfg))
for _method in RL_METHODS.names():  # every preference method the config accepts (rl_methods.py) is one loss here
    OBJECTIVES.add(_method, _preference)
for _method in ONLINE_METHODS:
    OBJECTIVES.add(_method, _online_rl)


def objective_of(cfg, reference_model=None) -> Objective:
    """Supervised fine-tuning trains the language-model loss; `rl:` names a preference objective, which compares
    the policy with `reference_model` (None: LoRA's adapter switched off, or log-probs that came precomputed)."""
    return OBJECTIVES[objective_name(cfg)](cfg, reference_model)


class ObjectiveModule(torch.nn.Module):
    """The model the loop trains: a language model and its objective in one forward, which is what DDP wraps."""

    def __init__(self, model, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def weights_used_outside_their_module(self) -> list:
        """The weights this forward uses without calling the module that holds them: the output head's, which the
        chunked losses meet directly (an engine that gathers a module's weights when it runs, ZeRO-3, is told)."""
        head = output_head(self.model)
        return [head[1]] if head is not None else []

    def forward(self, inputs: dict, targets: torch.Tensor, extra: dict, evaluating: bool = False):
        """(the summed loss, stats); with `evaluating`, the eval sums. Eval goes through here too, so that an engine
        that gathers sharded weights in the root's forward (FSDP2, ZeRO-3) has them for the head as well."""
        if evaluating:
            return self.objective.eval_sums(self.model, inputs, targets, extra)
        return self.objective.summed_loss(self.model, inputs, targets, extra)
