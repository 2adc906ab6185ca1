"""What a step minimises: one registry entry per training objective, each with its unit of normalisation.

An objective runs the model on a micro-batch and returns a *summed* loss, and says what that sum is over
(its unit): the language-model loss sums cross-entropy over target tokens, so a step's loss is that sum
divided by the target tokens of the whole step (all micro-batches, all ranks), which the host knows before
the step. Preference objectives (DPO and friends) will sum over pairs or rows and normalise by the pairs or
rows of the step, in the same loop.

The model and its objective are one module for the loop (`ObjectiveModule`), so DDP, and the FSDP to come,
wrap the loss computation too: the language-model loss meets the output projection in chunks
(chunked_loss.py) and never holds the [tokens, vocabulary] logits whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.registry import Registry
from tuneloop.train.chunked_loss import chunked_linear_cross_entropy, chunked_loss_and_correct

# config keys of models whose logits are more than hidden @ lm_head (soft-capping, scaling): they keep the
# plain loss, computed from the model's own logits
LOGIT_STEPS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "scale_width", "output_logits_scaling",
               "mup_width_multiplier")


def summed_token_loss(logits, targets):
    """Sum (not mean) of cross-entropy over target positions; the caller divides by the step's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def correct_predictions(logits, targets):
    mask = targets != IGNORE_INDEX
    return (logits.argmax(dim=-1).eq(targets) & mask).sum()


def output_head(model):
    """(decoder, output projection weight) when the logits are exactly decoder states @ weight.T (a plain
    Linear head without bias, no logit soft-capping or scaling, no adapter on the head), else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if type(head) is not torch.nn.Linear or head.bias is not None or decoder is None:
        return None
    config = base.config
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in LOGIT_STEPS):
        return None
    return decoder, head.weight


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


@dataclass(frozen=True)
class Objective:
    summed_loss: Callable  # (model, inputs, targets) -> a scalar tensor: the loss summed over the unit
    eval_sums: Callable  # (model, inputs, targets) -> (summed loss, correct predictions), no gradients
    unit: str  # what the sum runs over, and what a step's loss is averaged over: "tokens", "pairs" or "rows"


def _language_model(cfg) -> Objective:
    """Chunked unless the config says `chunked_cross_entropy: false` (axolotl's key): the same loss from whole
    logits, for comparison or a model whose head the chunked path does not know."""
    chunked = cfg is None or cfg.chunked_cross_entropy is not False
    return Objective(partial(language_model_loss, chunked=chunked), partial(language_model_eval, chunked=chunked),
                     unit="tokens")


# `rl:` name -> (cfg -> Objective)
OBJECTIVES: Registry[Callable] = Registry("training objective", "rl")
OBJECTIVES.add("language_model", _language_model)


def objective_of(cfg) -> Objective:
    """Supervised fine-tuning trains the language-model loss (preference objectives will be chosen by `rl`)."""
    return OBJECTIVES["language_model"](cfg)


def uses_chunked_loss(cfg, model) -> bool:
    return (cfg is None or cfg.chunked_cross_entropy is not False) and output_head(model) is not None


class ObjectiveModule(torch.nn.Module):
    """The model the loop trains: a language model and its objective in one forward, which is what DDP wraps."""

    def __init__(self, model, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
        return self.objective.summed_loss(self.model, inputs, targets)
