"""Preference training methods (`rl:`), by name: what each needs, read by the config and the plan.

The losses themselves are train/preference.py's (torch); this table stays light because the config is
validated before torch loads. A method is one entry here and one loss there.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuneloop.registry import Registry


@dataclass(frozen=True)
class RLMethod:
    loss_types: tuple[str, ...]  # what `dpo_loss_type` may name (empty: the key does not apply)
    uses_reference: bool  # a frozen reference model's log-probabilities are part of the loss
    unit: str = "pairs"  # what its loss is averaged over, and accumulation normalises by


RL_METHODS: Registry[RLMethod] = Registry("preference method", "rl")
RL_METHODS.add("dpo", RLMethod(("sigmoid", "ipo", "hinge"), uses_reference=True))  # sigmoid by default
RL_METHODS.add("ipo", RLMethod(("ipo",), uses_reference=True))  # DPO with the IPO loss
RL_METHODS.add("orpo", RLMethod((), uses_reference=False))  # odds ratio + NLL of the chosen reply

# names axolotl knows that tuneloop does not train, and what to say
NOT_OFFERED = {
    "kto_pair": "`rl: kto_pair` is gone from axolotl (and TRL); its successor is `rl: kto`, which tuneloop does not "
                "train yet: use `rl: dpo` for paired data",
    "kto": "`rl: kto` (unpaired preference rows) is not trained by tuneloop yet: use `rl: dpo` or `rl: orpo` with "
           "chosen/rejected pairs",
}


def check_rl(name: str) -> str:
    from tuneloop.axolotl_keys import FEATURES

    if name in RL_METHODS:
        return RL_METHODS.canonical(name)
    why = NOT_OFFERED.get(name, f"`rl: {name}` is not a method tuneloop trains ({RL_METHODS.choices()})")
    raise ValueError(f"asks for {FEATURES['preference'][0]}, which tuneloop does not do yet: {why}")
