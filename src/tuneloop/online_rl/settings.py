"""The `trl:` block of an online RL run, as axolotl passes it to TRL's GRPOConfig, and what each key means here.

Defaults are TRL 1.16's (axolotl inherits them), so a config written for axolotl runs the same objective:
`loss_type: dapo`, `beta: 0`, `epsilon: 0.2`, `num_generations: 8`, `temperature: 1.0`. Every loss type of TRL
is one record of loss_types.py's LOSS_TYPES (its surrogate, its reduction and the unit its normalisation runs over:
what the loop divides a step's summed loss by, on every rank); `loss_type` accepts exactly its names.

This module imports nothing heavy: it is read while the config is validated.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from tuneloop.online_rl.loss_types import LOSS_TYPES

# keys of TRL's GRPOConfig that change the result and that tuneloop does not do (each refused, named)
NOT_OFFERED_KEYS = {  # key -> (what it does, the value that means "off", which is accepted)
    "sync_ref_model": ("a reference model that follows the policy", False),
    "ref_model_mixup_alpha": ("a reference model that follows the policy", None),
    "ref_model_sync_steps": ("a reference model that follows the policy", None),
    "top_entropy_quantile": ("training only the highest-entropy tokens", 1.0),
    "off_policy_mask_threshold": ("DeepSeek-V3.2's off-policy sequence mask", None),
    "entropy_coef": ("an entropy bonus", 0.0),
    "reward_processing_classes": ("a reward model with its own tokenizer", None),
    "steps_per_generation": ("generations that span several optimizer steps", None),
    "generation_batch_size": ("generations that span several optimizer steps", None),
    "vllm_structured_outputs_regex": ("generation constrained to a regular expression (vLLM's structured outputs)",
                                      None),
    "rollout_func": ("a custom rollout function", None),
    "use_liger_loss": ("Liger's fused GRPO loss", False),
}


class TRLBlock(BaseModel):
    """axolotl's `trl:` mapping. `vllm_*` keys are accepted (with `use_vllm: true`) and warned about: vLLM is a
    faster generator of the same distribution, which tuneloop does not use (generation runs through transformers)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None  # None or 0: no top-k filtering
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    generation_kwargs: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    beta: float = 0.0  # the KL coefficient; 0: no reference model
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # unset: epsilon
    delta: Optional[float] = None  # two-sided clipping of the ratio (grpo-family losses)
    loss_type: str = "dapo"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    scale_rewards: Union[bool, Literal["group", "batch", "none"]] = "group"
    multi_objective_aggregation: Optional[Literal["sum_then_normalize", "normalize_then_sum"]] = None
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True  # TRL's default: the KL term weighted by the importance ratio
    reward_funcs: Optional[list[str]] = None
    reward_weights: Optional[list[float]] = None
    log_completions: bool = False
    num_completions_to_print: Optional[int] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_vllm: bool = False

    @field_validator("loss_type")
    @classmethod
    def _loss_type(cls, value):
        if value not in LOSS_TYPES:
            raise ValueError(f"got {value!r}; TRL's GRPO losses are {', '.join(LOSS_TYPES.names())}")
        return value

    @field_validator("num_generations")
    @classmethod
    def _groups(cls, value):
        if value < 2:
            raise ValueError(f"got {value}: a group of one completion has no one to be compared with (its advantage "
                             "is always 0, so nothing trains); use 2 or more")
        return value

    @field_validator("max_completion_length", "num_iterations")
    @classmethod
    def _positive(cls, value):
        if value < 1:
            raise ValueError(f"got {value}; it must be 1 or more")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if value <= 0:
            raise ValueError(f"got {value}: sampling needs a temperature above 0 (GRPO compares different "
                             "completions of one prompt)")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        extra = dict(self.model_extra or {})
        for key in extra:
            if key in NOT_OFFERED_KEYS:
                continue
            if not key.startswith("vllm_"):
                raise ValueError(f"`trl.{key}` is not a GRPO key tuneloop knows; the keys it reads are "
                                 f"{', '.join(sorted(TRLBlock.model_fields))}")
        vllm_keys = [key for key in extra if key.startswith("vllm_") and key not in NOT_OFFERED_KEYS]
        if vllm_keys and not self.use_vllm:
            raise ValueError(f"`trl.{vllm_keys[0]}` configures vLLM, and `trl.use_vllm` is not true: the two "
                             "disagree; remove it (or set use_vllm: true, which tuneloop warns about: generation "
                             "runs through transformers)")
        if self.reward_weights is not None and self.reward_funcs is not None \
                and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"`trl.reward_weights` has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward_funcs; give one weight per function")
        return self

    # ---- what the keys resolve to -------------------------------------------------------------------------
    @property
    def refused_keys(self) -> list[str]:
        """Set keys of TRL's that tuneloop does not do (each changes what trains)."""
        return [key for key, value in (self.model_extra or {}).items()
                if key in NOT_OFFERED_KEYS and value != NOT_OFFERED_KEYS[key][1] and value is not None]

    @property
    def vllm_keys(self) -> list[str]:
        return [key for key in (self.model_extra or {}) if key.startswith("vllm_") and key not in NOT_OFFERED_KEYS]

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def reward_scaling(self) -> str:
        """scale_rewards as TRL reads it: True is "group", False is "none"."""
        return {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)

    def aggregation(self, method: str) -> str:
        """How several rewards become one: summed, then normalised in the group (GRPO); or each normalised in the
        group first, then summed and normalised over the batch (GDPO, axolotl's `rl: gdpo`)."""
        if self.multi_objective_aggregation:
            return self.multi_objective_aggregation
        return "normalize_then_sum" if method == "gdpo" else "sum_then_normalize"

    @property
    def unit(self) -> str:
        """What a step's summed loss is divided by (loss_types.py's LossType.unit)."""
        return LOSS_TYPES[self.loss_type].unit

    def generation_settings(self) -> dict:
        """The sampling settings HF `generate` takes (generation_kwargs on top, as TRL merges them)."""
        settings = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k or 0, "repetition_penalty": self.repetition_penalty}
        if self.min_p is not None:
            settings["min_p"] = self.min_p
        settings.update(self.generation_kwargs or {})
        return settings
