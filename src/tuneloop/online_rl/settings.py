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
    "rollout_func": ("a custom rollout function", None),
    "use_liger_loss": ("Liger's fused GRPO loss", False),
}


# TRL's keys of a vLLM engine inside the training process (vllm_mode: colocate), which tuneloop refuses: vLLM pins a
# transformers older than tuneloop's, so the two cannot be imported in one process (the server's keys are `vllm:`)
COLOCATE_KEYS = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
                 "vllm_model_impl", "vllm_max_model_length", "vllm_kv_cache_dtype")

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class TRLBlock(BaseModel):
    """axolotl's `trl:` mapping. With `use_vllm: true` completions are generated on a vLLM server
    (generation/vllm_server.py), the weights of every optimizer step synced to it; TRL 1.16's vLLM keys and
    defaults (importance-sampling correction on, sequence_mask, clip_max 3)."""

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
    # tuneloop's: steps in a row on which no reward function scored any completion (each returned None for every
    # one) that the run trains through before it stops. Such a step has every advantage 0 and trains nothing (but
    # trl.beta's pull to the reference), which TRL only warns of; 0: the first one stops, before its weights change
    # (a function that never scores is a bug: a column misnamed, an answer format never matched). Raise it where
    # the functions score only some tasks of a mixed dataset, and a step may by chance draw none of those.
    unscored_steps_allowed: int = 0
    log_completions: bool = False
    num_completions_to_print: Optional[int] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_vllm: bool = False
    vllm_mode: Literal["server", "colocate"] = "server"
    vllm_server_base_url: Optional[str] = None  # wins over host and port (TRL)
    vllm_server_host: Optional[str] = None  # unset: the `vllm:` block's host (0.0.0.0 is reached at 127.0.0.1)
    vllm_server_port: Optional[int] = None  # unset: the `vllm:` block's port (8000)
    vllm_server_timeout: float = 240.0  # seconds a run waits for the server to answer before it starts (TRL's)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: Optional[float] = None
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    vllm_importance_sampling_cap: Optional[float] = None  # TRL's deprecated name of clip_max (axolotl writes it)
    vllm_lora_sync: bool = False  # axolotl's: a LoRA run sends its adapter files (else the merged weights)
    vllm_structured_outputs_regex: Optional[str] = None  # completions constrained to a regular expression
    vllm_guided_decoding_regex: Optional[str] = None  # (its older name, axolotl's)
    # tuneloop's: the gap between the completion tokens' log-probs on the server and in the trainer that the run
    # accepts (fp32: the largest |Δ|, unset 1e-3; bf16/fp16: the mean |Δ|, unset 0.1; the plan states it)
    vllm_logprob_tolerance: Optional[float] = None
    # axolotl's async GRPO: step n+1's completions generated while step n trains (weights one step old)
    async_prefetch: bool = False
    use_data_producer: bool = False  # axolotl's protocol that async_prefetch rides on (no effect of its own)
    prefetch_depth: Optional[int] = None  # generations ahead: 1 (axolotl's default)
    vllm_sync_interval: Optional[int] = None  # steps between syncs: 1 (every step)

    @field_validator("loss_type")
    @classmethod
    def _loss_type(cls, value):
        if value not in LOSS_TYPES:
            raise ValueError(f"got {value!r}; TRL's GRPO losses are {', '.join(LOSS_TYPES.names())}")
        return value

    @field_validator("vllm_importance_sampling_mode")
    @classmethod
    def _is_mode(cls, value):
        if value not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(f"got {value!r}; TRL's modes are {', '.join(IMPORTANCE_SAMPLING_MODES)}")
        return value

    @field_validator("prefetch_depth", "vllm_sync_interval")
    @classmethod
    def _one_step(cls, value, info):
        if value not in (None, 1):
            what = ("generations further ahead" if info.field_name == "prefetch_depth"
                    else "weights synced less often than every step")
            raise ValueError(f"got {value}: {what} make completions more than one step stale, and tuneloop's async "
                             "mode is one step (its importance correction is sized for that); remove it or set 1")
        return value

    @field_validator("num_generations")
    @classmethod
    def _groups(cls, value):
        if value < 2:
            raise ValueError(f"got {value}: a group of one completion has no one to be compared with (its advantage "
                             "is always 0, so nothing trains); use 2 or more")
        return value

    @field_validator("unscored_steps_allowed")
    @classmethod
    def _not_negative(cls, value):
        if value < 0:
            raise ValueError(f"got {value}; it counts steps: 0 or more")
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
            if key in COLOCATE_KEYS:
                if extra[key] is not None:
                    raise ValueError(f"`trl.{key}` configures a vLLM engine colocated in the training process, "
                                     "which tuneloop does not run (vLLM pins transformers < 5.21, below tuneloop's): "
                                     "generation runs on a vLLM server, configured by the `vllm:` block; remove it")
                continue
            raise ValueError(f"`trl.{key}` is not a GRPO key tuneloop knows; the keys it reads are "
                             f"{', '.join(sorted(TRLBlock.model_fields))}")
        if self.vllm_mode == "colocate" and self.use_vllm:
            raise ValueError("`trl.vllm_mode: colocate` runs vLLM inside the training process, and vLLM pins "
                             "transformers < 5.21, below tuneloop's 5.24, so the two cannot be imported together: "
                             "use `vllm_mode: server` (start it with `tuneloop vllm-serve CONFIG`)")
        changed = [key for key in sorted(self.model_fields_set) if (key.startswith("vllm_") or key in (
            "async_prefetch", "prefetch_depth")) and not self._is_default(key)]
        if changed and not self.use_vllm:
            raise ValueError(f"`trl.{changed[0]}` configures generation on vLLM, and `trl.use_vllm` is not true: the "
                             "two disagree; remove it, or set use_vllm: true (and start the server with "
                             "`tuneloop vllm-serve CONFIG`)")
        if self.vllm_structured_outputs_regex and self.vllm_guided_decoding_regex \
                and self.vllm_structured_outputs_regex != self.vllm_guided_decoding_regex:
            raise ValueError("`trl.vllm_structured_outputs_regex` and `trl.vllm_guided_decoding_regex` (its older "
                             "name) disagree; keep one")
        if self.clip_min is not None and self.clip_max is not None and self.clip_min >= self.clip_max:
            raise ValueError(f"`trl.vllm_importance_sampling_clip_min` ({self.clip_min}) must be below clip_max "
                             f"({self.clip_max})")
        return self

    def _is_default(self, key: str) -> bool:
        return getattr(self, key) == TRLBlock.model_fields[key].default

    # ---- what the keys resolve to -------------------------------------------------------------------------
    @property
    def refused_keys(self) -> list[str]:
        """Set keys of TRL's that tuneloop does not do (each changes what trains)."""
        return [key for key, value in (self.model_extra or {}).items()
                if key in NOT_OFFERED_KEYS and value != NOT_OFFERED_KEYS[key][1] and value is not None]

    @property
    def clip_max(self) -> float | None:
        """The importance-sampling bound above (TRL's deprecated `cap` is read as it, as TRL does)."""
        return self.vllm_importance_sampling_cap if self.vllm_importance_sampling_cap is not None \
            else self.vllm_importance_sampling_clip_max

    @property
    def clip_min(self) -> float | None:
        return self.vllm_importance_sampling_clip_min

    @property
    def regex(self) -> str | None:
        return self.vllm_structured_outputs_regex or self.vllm_guided_decoding_regex

    @property
    def asynchronous(self) -> bool:
        return self.use_vllm and self.async_prefetch

    def logprob_tolerance(self, half_precision: bool) -> tuple[str, float]:
        """What a synced step's server-vs-trainer log-prob gap is held to, and how far (plan and run): in fp32 its
        largest |Δ| (the two engines' own disagreement, measured here on the embedded model: ≤ 7e-5); in bf16/fp16
        its mean |Δ| (each token's rounding alone reached 0.43 on the embedded model, the mean stayed 0.023–0.037)."""
        statistic = "mean" if half_precision else "max"
        if self.vllm_logprob_tolerance is not None:
            return statistic, self.vllm_logprob_tolerance
        return statistic, 0.1 if half_precision else 1e-3

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
