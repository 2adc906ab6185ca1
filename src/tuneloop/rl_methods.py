"""Preference training methods (`rl:`), by name: what each needs and which keys it reads, for the config and
the plan.

The losses themselves are train/preference.py's LOSSES (torch), one function per method under the same name;
this table stays light because the config is validated before torch loads. A method is one entry here (its
data, its reference, its keys and their defaults) and one loss there; a test walks both tables. DPO's loss types
(`dpo_loss_type`) are dpo_loss_types.py's DPO_LOSS_TYPES, which `rl: dpo` reads its accepted names from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tuneloop.dpo_loss_types import DPO_LOSS_TYPES
from tuneloop.registry import Registry

# every preference key, and what it does (the config refuses one that the run's method does not read)
PREFERENCE_KEYS = {
    "rl_beta": "is the beta of DPO, IPO, KTO and SimPO",
    "dpo_beta": "is the beta of DPO, IPO, KTO and SimPO (axolotl's older name of rl_beta)",
    "dpo_loss_type": "names DPO's losses",
    "dpo_loss_weights": "weighs DPO's losses",
    "dpo_label_smoothing": "smooths DPO's sigmoid loss",
    "precompute_ref_log_probs": "computes a reference model's log-probs once, before training",
    "orpo_alpha": "weighs ORPO's odds ratio",
    "kto_desirable_weight": "weighs KTO's rows",
    "kto_undesirable_weight": "weighs KTO's rows",
    "simpo_gamma": "shapes SimPO's loss",
    "cpo_alpha": "shapes SimPO's loss",
}
DPO_KEYS = ("rl_beta", "dpo_beta", "dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing",
            "precompute_ref_log_probs")


EVERY_DPO_LOSS_TYPE = None  # (an RLMethod's own_loss_types: all of DPO_LOSS_TYPES, read from it when asked)


@dataclass(frozen=True)
class RLMethod:
    uses_reference: bool  # a frozen reference model's log-probabilities are part of the loss
    unit: str = "pairs"  # what its loss is averaged over, and accumulation normalises by: "pairs" or "rows"
    paired: bool = True  # its data: chosen/rejected pairs, or unpaired rows with a desirable/undesirable label
    keys: tuple[str, ...] = ()  # the PREFERENCE_KEYS it reads
    defaults: dict = field(default_factory=dict)  # the value of each of its keys that is left unset
    # the DPO_LOSS_TYPES names `dpo_loss_type` may take, the first the default (empty: the key does not apply), or
    # EVERY_DPO_LOSS_TYPE: the table's names, read when asked, so that a loss type added there is accepted here
    own_loss_types: tuple[str, ...] | None = ()

    @property
    def loss_types(self) -> tuple[str, ...]:
        """What `dpo_loss_type` may name, the first its default."""
        if self.own_loss_types is EVERY_DPO_LOSS_TYPE:
            return tuple(DPO_LOSS_TYPES.names())
        return self.own_loss_types


RL_METHODS: Registry[RLMethod] = Registry("preference method", "rl")
RL_METHODS.add("dpo", RLMethod(uses_reference=True, keys=DPO_KEYS,  # sigmoid by default
                                own_loss_types=EVERY_DPO_LOSS_TYPE))
RL_METHODS.add("ipo", RLMethod(uses_reference=True, keys=DPO_KEYS,  # DPO with the IPO loss
                                own_loss_types=(DPO_LOSS_TYPES.canonical("ipo"),)))
RL_METHODS.add("orpo", RLMethod(uses_reference=False, keys=("orpo_alpha",),  # odds ratio + NLL of the chosen
                                defaults={"orpo_alpha": 0.1}))
RL_METHODS.add("kto", RLMethod(uses_reference=True, unit="rows", paired=False,  # unpaired, labelled rows
                               keys=("rl_beta", "dpo_beta", "precompute_ref_log_probs", "kto_desirable_weight",
                                     "kto_undesirable_weight")))
RL_METHODS.add("simpo", RLMethod(uses_reference=False,  # length-normalised margin + cpo_alpha × NLL (TRL's CPO)
                                 keys=("rl_beta", "dpo_beta", "simpo_gamma", "cpo_alpha"),
                                 defaults={"simpo_gamma": 0.5, "cpo_alpha": 1.0}))

# online RL (online_rl/): the policy generates its own completions each step, scored by reward functions; the `trl:`
# block holds every setting (online_rl/settings.py). GDPO is GRPO with each reward normalised in its group first;
# EBFT (structured mode) is GRPO with a reward of its own first: features of a frozen copy of the starting model
# matched against the reference answer's (online_rl/feature_matching.py, the `ebft:` block)
ONLINE_METHODS = ("grpo", "gdpo", "ebft")
FEATURE_MATCHING_METHOD = "ebft"

# names axolotl knows that tuneloop does not train, and what to say
NOT_OFFERED = {
    "kto_pair": "`rl: kto_pair` is gone from axolotl (and TRL); its successor is `rl: kto` (unpaired rows with a "
                "label), or `rl: dpo` for paired data",
}


# `reward_model: true`: a sequence classifier's score trained on chosen/rejected pairs by the Bradley-Terry loss
# (train/reward_model.py), not an `rl:` method: it has no reference, no policy log-probs and no preference keys
REWARD_MODEL_OBJECTIVE = "bradley_terry"
# its eval line (TRL's RewardTrainer's names, so that an axolotl config's metric_for_best_model reads the same)
REWARD_MODEL_EVAL_METRICS = ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward")
# `process_reward_model: true`: a token classifier (correct / incorrect) trained at each reasoning step's end token
# (train/process_reward_model.py); its eval line: the loss per labelled step and the steps classified right
PROCESS_REWARD_OBJECTIVE = "token_classification"
PROCESS_REWARD_EVAL_METRICS = ("eval_loss", "eval_step_accuracy")


def objective_name(cfg) -> str:
    """The name of what the run minimises (train/objectives.py's OBJECTIVES): the reward model's, the `rl:`
    method's, or the language model's."""
    if cfg is not None and cfg.reward_model:
        return REWARD_MODEL_OBJECTIVE
    if cfg is not None and cfg.process_reward_model:
        return PROCESS_REWARD_OBJECTIVE
    return cfg.rl if cfg is not None and cfg.rl else "language_model"


def trains_on_pairs(cfg) -> bool:
    """Each row is a chosen/rejected pair, kept and batched whole: a paired `rl:` method, or a reward model."""
    return bool(cfg.reward_model) or (bool(cfg.rl) and cfg.rl in RL_METHODS and RL_METHODS[cfg.rl].paired)


def eval_metric_names(cfg) -> tuple[str, ...]:
    """What an eval line reports for the run's objective (train/objectives.py, train/preference.py,
    train/reward_model.py, train/process_reward_model.py): the names `metric_for_best_model` may take. Online RL
    has no eval set."""
    if is_online(cfg):
        return ()
    if cfg.reward_model:
        return REWARD_MODEL_EVAL_METRICS
    if cfg.process_reward_model:
        return PROCESS_REWARD_EVAL_METRICS
    if not cfg.rl:
        return ("eval_loss", "eval_perplexity", "eval_token_accuracy")
    rewards = ("eval_reward_chosen", "eval_reward_rejected", "eval_reward_margin")
    if RL_METHODS[cfg.rl].paired:
        return ("eval_loss", *rewards, "eval_reward_accuracy")
    return ("eval_loss", *rewards, "eval_kl")


def is_online(cfg) -> bool:
    """An online RL run (`rl: grpo` or `gdpo`): completions generated and scored as it trains."""
    return cfg is not None and cfg.rl in ONLINE_METHODS


def matches_features(cfg) -> bool:
    """`rl: ebft`: the run's first reward is feature matching against each row's reference answer."""
    return cfg is not None and cfg.rl == FEATURE_MATCHING_METHOD


def preference_method(cfg) -> RLMethod | None:
    """The run's offline preference method (DPO family), or None (supervised, or online RL)."""
    return RL_METHODS[cfg.rl] if cfg is not None and cfg.rl in RL_METHODS else None


def setting(cfg, key: str):
    """A preference key's value for the run's method: the config's, else the method's default."""
    value = getattr(cfg, key)
    return RL_METHODS[cfg.rl].defaults.get(key) if value is None else value


def keeps_reference_copy(cfg) -> bool:
    """A preference run holds a second, frozen copy of the weights: full fine-tuning against a reference whose
    log-probs are computed as it trains (a LoRA run's reference is its base, the adapter switched off); online RL
    only where its KL term is on (`trl.beta` ≠ 0)."""
    if is_online(cfg):  # (EBFT's features come from the starting model: that copy, or the adapter switched off)
        return (cfg.trl_settings.beta != 0.0 or matches_features(cfg)) and not cfg.adapter
    return bool(cfg.rl) and RL_METHODS[cfg.rl].uses_reference and not cfg.adapter and not cfg.precompute_ref_log_probs


def reference_source(cfg) -> str | None:
    """Where a preference run's reference log-probs come from, in words (None: the method has no reference)."""
    if is_online(cfg):
        if cfg.trl_settings.beta == 0.0:
            return None
    elif not cfg.rl or not RL_METHODS[cfg.rl].uses_reference:
        return None
    if cfg.precompute_ref_log_probs:
        return "log-probs computed once before training and cached with the data"
    if cfg.adapter:
        return "the base model: the LoRA adapter switched off (no second copy)"
    return "a frozen copy of the starting model (one more set of weights in memory)"
