"""axolotl's `ebft:` block: Energy-Based Fine-Tuning (Jelassi et al., 2026), `rl: ebft`.

Structured mode is GRPO (online_rl/) with one reward of its own: how well a frozen copy's hidden features of each
completion match those of the row's reference answer (`ground_truth`), less how alike a group's completions are
(online_rl/feature_matching.py). Every key of axolotl's schema is here with axolotl's default; the strided mode and
its keys are refused, naming why (see `_strided`). No torch: `check` validates it.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator, model_validator

from tuneloop.config.datasets import Strict

EMBED_METHODS = ("last_token", "mean_pooling", "completion_mean", "concat")

# the strided mode's own keys (axolotl's defaults), refused with it
STRIDED_KEYS = {"stride": 8, "context_length": 8, "generate_max_len": 8, "n_samples_per_prompt": 4,
                "temperature": 0.6, "top_p": 1.0, "rl_coef": 1.0, "advantage_estimator": "rloo",
                "min_completion_prefix": 0, "mask_thinking_ce": False}

# the message's feature name is config/axolotl.py FEATURES["preference"][0] (the README's list of what is not built)
STRIDED_REFUSAL = ("`ebft.mode: strided` asks for this preference/RL training, which tuneloop does not do yet: strided "
                   "EBFT samples short blocks at anchors inside each document, all in one forward under a block "
                   "attention mask, and trains them with its own RLOO loss and a cross-entropy term; tuneloop's EBFT "
                   "is the structured mode (rows of a `prompt` and its `ground_truth`, completions generated after "
                   "the prompt on GRPO's machinery): use `mode: structured`, or remove `ebft.mode`")


class EBFTBlock(Strict):
    """axolotl's EBFTConfig keys."""

    mode: Literal["structured", "strided"] = "structured"
    feature_layers: list[float] = [0.25, 0.5, 0.75]  # depths, as fractions of the model's layers
    embed_method: Literal["last_token", "mean_pooling", "completion_mean", "concat"] = "last_token"
    use_whitening: bool = False  # each group's features whitened (SVD) before they are compared
    alignment_coef: float = 1.0
    diversity_coef: float = 1.0
    ce_coef: float = 0.0
    adaptive_max_tokens: bool = True  # a step's completions capped near its longest reference answer
    gt_length_multiplier: float = 1.5
    stride: Optional[int] = None
    context_length: Optional[int] = None
    generate_max_len: Optional[int] = None
    n_samples_per_prompt: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    rl_coef: Optional[float] = None
    advantage_estimator: Optional[str] = None
    min_completion_prefix: Optional[int] = None
    mask_thinking_ce: Optional[bool] = None

    @field_validator("feature_layers")
    @classmethod
    def _fractions(cls, value):
        if not value:
            raise ValueError("names no layer: give the depths to read features at, as fractions (e.g. [0.25, 0.5, "
                             "0.75])")
        outside = [depth for depth in value if not 0.0 <= depth <= 1.0]
        if outside:
            raise ValueError(f"{outside[0]} is not a depth between 0 and 1 (a fraction of the model's layers: 0.5 is "
                             "the middle layer's output)")
        return value

    @field_validator("gt_length_multiplier")
    @classmethod
    def _multiplier(cls, value):
        if value < 0.1:
            raise ValueError(f"got {value}; it must be 0.1 or more (axolotl's bound)")
        return value

    @model_validator(mode="after")
    def _structured_only(self):
        if self.mode == "strided":
            raise ValueError(STRIDED_REFUSAL)
        given = [key for key in STRIDED_KEYS if getattr(self, key) is not None]
        if given:
            raise ValueError(f"`ebft.{given[0]}` is a setting of EBFT's strided mode, and this run is the structured "
                             "mode (its sampling is `trl:`'s: temperature, top_p, num_generations, "
                             "max_completion_length): remove it")
        if self.ce_coef != 0.0:
            raise ValueError(f"`ebft.ce_coef: {self.ce_coef}` weighs a cross-entropy term on the reference answer that "
                             "only EBFT's strided mode trains (axolotl's structured trainer reads it and adds nothing): "
                             "set it to 0 or remove it")
        return self
