"""DPO's loss types (`dpo_loss_type`), by name: each a function of a batch of pairs' log-ratios -> its per-pair losses.

`rl: dpo` accepts every name in DPO_LOSS_TYPES (the first, sigmoid, is its default; `rl: ipo` is DPO with "ipo"
alone), and train/preference.py's dpo_losses sums the named ones, weighted. A new loss type is one function and one
`DPO_LOSS_TYPES.add` here, and its case in tests/test_registries.py walks it end to end.

The config reads these names before torch loads (`tuneloop check` imports no torch), so nothing here imports it at
module level: the functions compute with the tensors they are given.
"""

from __future__ import annotations

from typing import Callable

from tuneloop.registry import Registry

# Each function: (chosen_ratio, rejected_ratio, counts, settings) -> per-pair losses, where the ratios are the policy's
# log-prob minus the reference's, summed over each reply's tokens ([pairs] each), `counts` the target tokens of each
# sequence ([2 × pairs], chosen at even positions) and `settings` train/preference.py's PairLosses.


def sigmoid(chosen_ratio, rejected_ratio, counts, settings):
    """DPO's own: −log σ(β·margin) of the summed log-ratios, label-smoothed (conservative DPO) by
    dpo_label_smoothing."""
    import torch.nn.functional as F

    beta, smoothing = settings.beta, settings.dpo_label_smoothing
    margin = chosen_ratio - rejected_ratio
    return -(1 - smoothing) * F.logsigmoid(beta * margin) - smoothing * F.logsigmoid(-beta * margin)


def ipo(chosen_ratio, rejected_ratio, counts, settings):
    """IPO: (margin − 1/(2β))² on log-ratios averaged over each reply's tokens (as in its paper and TRL)."""
    averaged = chosen_ratio / counts[0::2] - rejected_ratio / counts[1::2]
    return (averaged - 1 / (2 * settings.beta)) ** 2


def hinge(chosen_ratio, rejected_ratio, counts, settings):
    """SLiC's hinge: max(0, 1 − β·margin) of the summed log-ratios."""
    return (1 - settings.beta * (chosen_ratio - rejected_ratio)).relu()


DPO_LOSS_TYPES: Registry[Callable] = Registry("DPO loss type", "dpo_loss_type")
DPO_LOSS_TYPES.add("sigmoid", sigmoid)  # first: `rl: dpo`'s default
DPO_LOSS_TYPES.add("ipo", ipo)
DPO_LOSS_TYPES.add("hinge", hinge)
