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
    unit: str = "pairs"  # what its loss is averaged over, and accumulation normalises by: "pairs" or "rows"
    paired: bool = True  # its data: chosen/rejected pairs, or unpaired rows with a desirable/undesirable label


RL_METHODS: Registry[RLMethod] = Registry("preference method", "rl")
RL_METHODS.add("dpo", RLMethod(("sigmoid", "ipo", "hinge"), uses_reference=True))  # sigmoid by default
RL_METHODS.add("ipo", RLMethod(("ipo",), uses_reference=True))  # DPO with the IPO loss
RL_METHODS.add("orpo", RLMethod((), uses_reference=False))  # odds ratio + NLL of the chosen reply
RL_METHODS.add("kto", RLMethod((), uses_reference=True, unit="rows", paired=False))  # unpaired, labelled rows
RL_METHODS.add("simpo", RLMethod((), uses_reference=False))  # length-normalised margin + cpo_alpha × NLL

# names axolotl knows that tuneloop does not train, and what to say
NOT_OFFERED = {
    "kto_pair": "`rl: kto_pair` is gone from axolotl (and TRL); its successor is `rl: kto` (unpaired rows with a "
                "label), or `rl: dpo` for paired data",
}


def check_rl(name: str) -> str:
    from tuneloop.axolotl_keys import FEATURES

    if name in RL_METHODS:
        return RL_METHODS.canonical(name)
    why = NOT_OFFERED.get(name, f"`rl: {name}` is not a method tuneloop trains ({RL_METHODS.choices()})")
    raise ValueError(f"asks for {FEATURES['preference'][0]}, which tuneloop does not do yet: {why}")


def keeps_reference_copy(cfg) -> bool:
    """A preference run holds a second, frozen copy of the weights: full fine-tuning against a reference whose
    log-probs are computed as it trains (a LoRA run's reference is its base, the adapter switched off)."""
    return bool(cfg.rl) and RL_METHODS[cfg.rl].uses_reference and not cfg.adapter and not cfg.precompute_ref_log_probs


def reference_source(cfg) -> str | None:
    """Where a preference run's reference log-probs come from, in words (None: the method has no reference)."""
    if not cfg.rl or not RL_METHODS[cfg.rl].uses_reference:
        return None
    if cfg.precompute_ref_log_probs:
        return "log-probs computed once before training and cached with the data"
    if cfg.adapter:
        return "the base model: the LoRA adapter switched off (no second copy)"
    return "a frozen copy of the starting model (one more set of weights in memory)"
