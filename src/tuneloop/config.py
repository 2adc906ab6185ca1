"""The run's config: axolotl-named YAML keys, validated by pydantic, with errors a user can act on.

`load_config(path, overrides)` is the only way in. It reads YAML, applies `--set key=value`
overrides, rejects unknown keys naming the nearest known one, triages axolotl keys we do not
implement (see axolotl_keys.py), and turns pydantic's errors into one `UserError` per problem.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, field_validator,
                      model_validator)

from tuneloop import axolotl_keys
from tuneloop.data.chat_templates import check_template_name
from tuneloop.data.formats import FORMATS, TURN_END_OPTIONS
from tuneloop.data.preference import PREFERENCE_CHAT_TYPES, PREFERENCE_FORMATS, UNPAIRED_FORMATS
from tuneloop.data.load import parse_split
from tuneloop.errors import UserError
from tuneloop.optim import OPTIMIZERS, SCHEDULERS
from tuneloop.rl_methods import RL_METHODS, check_rl


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class CustomFormat(_Strict):
    """axolotl's user-defined instruction format (`type:` given as a mapping)."""

    system_prompt: str = ""
    system_format: str = "{system}"
    field_system: str = "system"
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    format: str = "{instruction} {input} "
    no_input_format: str = "{instruction} "


class PreferenceFormat(_Strict):
    """axolotl's user-defined preference format (`type:` given as a mapping under `rl:`): the prompt, chosen and
    rejected replies (KTO: the completion and its label) from these fields, each put into its format string."""

    field_prompt: str = "prompt"
    field_system: str = "system"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    prompt_format: str = "{prompt}"
    chosen_format: str = "{chosen}"
    rejected_format: str = "{rejected}"
    field_completion: str = "completion"  # rl: kto
    field_label: str = "label"
    completion_format: str = "{completion}"


# the chat keys that choose trained turns: preference data trains its reply, so under rl: they are refused
TRAINED_TURN_KEYS = ("roles_to_train", "train_on_eos", "train_on_eot")
PAIRED_ONLY_KEYS = ("field_chosen", "field_rejected", "chosen_format", "rejected_format")
UNPAIRED_ONLY_KEYS = ("field_completion", "field_label", "completion_format")


# the text-to-text (encoder-decoder) model families: their *ForConditionalGeneration classes are seq2seq models,
# not the multimodal ones of the same suffix (model.py checks that the class and the checkpoint agree)
SEQ2SEQ_FAMILIES = ("T5", "MT5", "UMT5", "LongT5", "Bart", "MBart", "PLBart", "Pegasus", "PegasusX", "BigBirdPegasus",
                    "Blenderbot", "BlenderbotSmall", "LED", "M2M100", "NllbMoe", "FSMT", "Mvp", "ProphetNet",
                    "SwitchTransformers", "T5Gemma", "Marian")


def is_seq2seq_class(name: str) -> bool:
    family = name.removesuffix("ForConditionalGeneration").removesuffix("MTModel")
    return name != family and family in SEQ2SEQ_FAMILIES


# dataset keys that only a chat dataset reads (set on another type, they would be ignored: refused instead)
CHAT_ONLY_KEYS = ("field_messages", "message_field_role", "message_field_content", "message_property_mappings",
                  "roles", "roles_to_train", "train_on_eos", "train_on_eot", "drop_system_message", "field_thinking",
                  "template_thinking_key", "chat_template", "chat_template_jinja")


def _jinja_means_jinja(holder) -> None:
    """A template's text without `chat_template: jinja` means that template, as in axolotl."""
    if holder.chat_template_jinja and holder.chat_template is None:
        holder.chat_template = "jinja"
    elif holder.chat_template_jinja and holder.chat_template != "jinja":
        raise ValueError(f"`chat_template: {holder.chat_template}` and `chat_template_jinja` name two templates: "
                         "keep one of them")


class DatasetConfig(_Strict):
    path: str
    # unset: rows already tokenized (input_ids, labels), as in axolotl; a mapping: a user-defined format
    type: Optional[Union[str, CustomFormat, PreferenceFormat]] = None
    data_files: Optional[Union[str, list[str]]] = None
    ds_type: Optional[Literal["json", "jsonl", "parquet", "csv", "arrow", "text"]] = None
    split: str = "train"  # a split, or a slice of it: train[:1%], train[10%:], train[:500]
    name: Optional[str] = None  # a hub dataset's configuration
    revision: Optional[str] = None  # a hub dataset's revision
    # completion
    field: Optional[str] = None
    # seq2seq: the prompt's field and the trained text's field
    field_source: Optional[str] = None
    field_target: Optional[str] = None
    # chat_template
    field_messages: Optional[str] = None
    message_field_role: str = "role"
    message_field_content: str = "content"
    message_property_mappings: Optional[dict[str, str]] = None  # template key -> the row's message key
    roles: Optional[dict[str, list[str]]] = None  # template role -> the row's names for it
    roles_to_train: list[str] = Field(default_factory=lambda: ["assistant"])
    train_on_eos: Optional[str] = None  # whose end-of-turn marker is trained: turn, all, last, none
    train_on_eot: Optional[str] = None
    drop_system_message: bool = False
    field_thinking: Optional[str] = None  # the row's key for a message's reasoning
    template_thinking_key: Optional[str] = None  # the template's name for it (reasoning_content)
    chat_template: Optional[str] = None  # this dataset's own template, instead of the run's
    chat_template_jinja: Optional[str] = None
    # preference data (rl:)
    field_chosen: Optional[str] = None  # the row's key for the chosen reply (default `chosen`)
    field_rejected: Optional[str] = None  # and for the rejected one (default `rejected`)

    @field_validator("split")
    @classmethod
    def _split(cls, value):
        parse_split(value)  # raises ValueError with the accepted forms
        return value

    @field_validator("type")
    @classmethod
    def _known_type(cls, value):
        if isinstance(value, str) and not any(value in known for known in (FORMATS, PREFERENCE_FORMATS,
                                                                            UNPAIRED_FORMATS)):
            feature = axolotl_keys.FEATURES[axolotl_keys.dataset_type_feature(value)][0]
            raise ValueError(f"unknown dataset type {value!r} ({feature}); tuneloop supports {FORMATS.choices()}, "
                             "or a mapping with field_instruction/field_input/field_output/format")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value):
        return value if value is None else check_template_name(value)

    @field_validator("train_on_eos", "train_on_eot")
    @classmethod
    def _turn_end(cls, value):
        if value is not None and value not in TURN_END_OPTIONS:
            raise ValueError(f"got {value!r}; use one of {', '.join(TURN_END_OPTIONS)}")
        return value

    @field_validator("roles", mode="before")
    @classmethod
    def _role_names(cls, value):
        if isinstance(value, dict):  # axolotl also takes a single name
            return {role: [names] if isinstance(names, str) else names for role, names in value.items()}
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.train_on_eos and self.train_on_eot and self.train_on_eos != self.train_on_eot:
            raise ValueError(f"`train_on_eos: {self.train_on_eos}` and `train_on_eot: {self.train_on_eot}` disagree; "
                             "tuneloop trains one end-of-turn marker per turn: keep one of them")
        _jinja_means_jinja(self)
        chat = self.type in ("chat_template", "chat_template.default", "sharegpt", *PREFERENCE_CHAT_TYPES)
        set_keys = [key for key in CHAT_ONLY_KEYS if key in self.model_fields_set]
        if set_keys and not chat:
            raise ValueError(f"`{set_keys[0]}` applies to chat datasets (type chat_template or sharegpt), and this "
                             f"one is `type: {self.type if isinstance(self.type, str) else 'a custom format'}`; "
                             "remove it")
        paired = [key for key in ("field_chosen", "field_rejected") if key in self.model_fields_set]
        if paired and self.type not in ("chat_template", "chat_template.default", *PREFERENCE_CHAT_TYPES):
            raise ValueError(f"`{paired[0]}` names a reply of preference data (`rl:` with type chat_template or "
                             "chat_template.argilla); remove it")
        pair_fields = [key for key in ("field_source", "field_target") if key in self.model_fields_set]
        if pair_fields and self.type != "seq2seq":
            raise ValueError(f"`{pair_fields[0]}` names a field of a `type: seq2seq` dataset; remove it")
        if "field" in self.model_fields_set and self.type != "completion":
            raise ValueError("`field` names the text of a `type: completion` dataset; remove it")
        return self


ZERO_MEANS = {"evals_per_epoch": " (no evals)", "saves_per_epoch": " (no saves)", "max_grad_norm": " (no clipping)"}
# what `attn_implementation` may say; kernels that cannot run on this machine fall back to sdpa (same maths)
ATTENTION_IMPLEMENTATIONS = {"sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", "xformers"}


class PretrainingDataset(_Strict):
    """axolotl's `pretraining_dataset` entry: raw text (`text_column`) read as a stream and packed into full rows;
    or, with another `type`, rows of that format streamed the same way."""

    path: str
    name: Optional[str] = None
    split: str = "train"
    data_files: Optional[Union[str, list[str]]] = None
    ds_type: Optional[Literal["json", "jsonl", "parquet", "csv", "arrow", "text"]] = None
    text_column: str = "text"
    type: Optional[str] = "pretrain"
    trust_remote_code: bool = False
    skip: Optional[int] = None

    @field_validator("skip")
    @classmethod
    def _no_skip(cls, value):
        if value:
            raise ValueError(f"got {value}: skipping rows at the start of the stream is "
                             f"{axolotl_keys.FEATURES['data_options'][0]} tuneloop does not have; remove it")
        return value

    @field_validator("trust_remote_code")
    @classmethod
    def _no_remote_code(cls, value):
        if value:
            raise ValueError("tuneloop reads local files and hub datasets without running their code; remove it")
        return value

    def as_dataset(self) -> "DatasetConfig":
        """The entry as the data side reads it: `pretrain` text is a completion row of `text_column`."""
        raw = self.type in (None, "pretrain")
        if not raw and self.text_column != "text":
            raise ValueError(f"`text_column` names the text of `type: pretrain`, and this entry is `type: {self.type}`")
        return DatasetConfig(path=self.path, name=self.name, split=self.split, data_files=self.data_files,
                             ds_type=self.ds_type, type="completion" if raw else self.type,
                             **({"field": self.text_column} if raw else {}))


PRETRAINING_FORM, DATASET_FORM = "pretraining entry", "dataset entry"  # (left out of error messages' key paths)


def _pretraining_entry_form(value) -> str:
    """axolotl takes a pretraining entry (path, text_column, ...) or any dataset entry (type, field, ...)."""
    keys = set(value) if isinstance(value, dict) else set(value.model_fields_set)
    return PRETRAINING_FORM if keys <= set(PretrainingDataset.model_fields) else DATASET_FORM


class TrainTokenizer(_Strict):
    """tuneloop's own key: a tokenizer trained on the run's training text (with the `tokenizers` library) before
    the data is prepared, for a model trained from scratch. It is cached beside the prepared data and saved with
    the model; the model's embeddings are sized to it."""

    type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = 8000
    # what each special token is called; the first ids go to them in this order (T5's: pad 0, eos 1, unk 2)
    special_tokens: dict[str, str] = Field(default_factory=lambda: {"pad_token": "<pad>", "eos_token": "</s>",
                                                                   "unk_token": "<unk>"})
    min_frequency: int = 2

    @field_validator("vocab_size")
    @classmethod
    def _vocabulary(cls, value):
        if value < 32:
            raise ValueError("must be at least 32 (the special tokens and the bytes or characters need room)")
        return value

    @field_validator("special_tokens")
    @classmethod
    def _special(cls, value):
        known = ("pad_token", "eos_token", "unk_token", "bos_token", "sep_token", "cls_token", "mask_token")
        for name in value:
            if name not in known:
                raise ValueError(f"`{name}` is not a special token name; use {', '.join(known)}")
        for needed in ("pad_token", "eos_token"):
            if needed not in value:
                raise ValueError(f"needs `{needed}` (padding and the end of every target use it)")
        return value

    @model_validator(mode="after")
    def _unknown_for_unigram(self):
        if self.type == "unigram" and "unk_token" not in self.special_tokens:
            raise ValueError("a unigram tokenizer needs `special_tokens.unk_token`: a character it never saw in "
                             "training (in eval rows or a prompt) has no other token to become")
        return self


class TuneloopConfig(_Strict):
    _distributed: Any = PrivateAttr(default=None)
    # model: pretrained weights (base_model), or a model built from a config with random weights (from scratch:
    # base_model_config, a folder or a model type name such as `t5`, or reinit_weights)
    base_model: Optional[str] = None
    base_model_config: Optional[str] = None
    reinit_weights: bool = False
    train_tokenizer: Optional[TrainTokenizer] = None
    model_type: Optional[str] = None  # a transformers class name; axolotl's `type_of_model` too
    revision_of_model: Optional[str] = None  # axolotl's `model_revision` too
    overrides_of_model_config: Optional[dict[str, Any]] = None  # axolotl's `model_config` too
    tokenizer_config: Optional[str] = None
    tokenizer_type: Optional[str] = None  # a transformers tokenizer class name
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = None
    flash_attention: bool = False
    sdp_attention: bool = False
    flex_attention: bool = False
    eager_attention: bool = False
    special_tokens: dict[str, str] = Field(default_factory=dict)
    tokens: list[str] = Field(default_factory=list)  # new tokens added to the vocabulary
    chat_template: Optional[str] = None
    chat_template_jinja: Optional[str] = None
    eot_tokens: Optional[list[str]] = None  # the text that ends a chat turn (its trained end marker)
    plugins: list[str] = Field(default_factory=list)
    # adapters and quantized loading
    adapter: Optional[Literal["lora", "qlora"]] = None
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: Optional[Union[str, list[str]]] = None  # names, or one regex over module paths
    lora_target_parameters: Optional[list[str]] = None
    lora_target_linear: bool = False
    lora_modules_to_save: Optional[list[str]] = None
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_config_kwargs: Optional[dict[str, Any]] = None
    unfrozen_parameters: Optional[list[str]] = None  # full fine-tuning of only the parameters these regexes match
    # data
    datasets: list[DatasetConfig] = Field(default_factory=list)
    # read as a stream instead of prepared whole (axolotl's keys): raw text packed into full rows, for max_steps
    # (an entry is axolotl's pretraining form, or a dataset entry of any type, as axolotl also takes)
    pretraining_dataset: Optional[list[Annotated[
        Union[Annotated[PretrainingDataset, Tag(PRETRAINING_FORM)], Annotated[DatasetConfig, Tag(DATASET_FORM)]],
        Discriminator(_pretraining_entry_form)]]] = None
    streaming: bool = False
    test_datasets: list[DatasetConfig] = Field(default_factory=list)
    val_set_size: float = 0.0
    dataset_prepared_path: str = "last_run_prepared"
    shuffle_merged_datasets: bool = True
    dataset_shard_num: Optional[int] = None
    dataset_shard_idx: int = 0
    sequence_len: int = 2048
    train_on_inputs: bool = False
    sample_packing: bool = False
    eval_sample_packing: Optional[bool] = None
    pad_to_sequence_len: bool = False
    group_by_length: bool = False
    # batch arithmetic
    micro_batch_size: int = 1
    eval_batch_size: Optional[int] = None
    gradient_accumulation_steps: int = 1
    batch_size: Optional[int] = None
    num_epochs: int = 1
    max_steps: Optional[int] = None
    # optimisation
    learning_rate: float = 2e-5
    lr_scheduler: str = "cosine"  # a name in optim.py's SCHEDULERS
    warmup_steps: Optional[int] = None
    warmup_ratio: Optional[float] = None
    cosine_min_lr_ratio: Optional[float] = None
    lr_div_factor: Optional[float] = None  # one_cycle: it starts at learning_rate / lr_div_factor (default 6)
    optimizer: str = "adamw_torch_fused"  # a name in optim.py's OPTIMIZERS
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0  # 0 turns clipping off (a blank value means the default, as in axolotl)
    # precision and memory
    bf16: Union[bool, Literal["auto"]] = "auto"
    fp16: bool = False
    tf32: bool = False
    gradient_checkpointing: Union[bool, Literal["offload"]] = False  # "offload": checkpoints kept in CPU memory
    gradient_checkpointing_kwargs: Optional[dict[str, Any]] = None
    chunked_cross_entropy: Optional[bool] = None  # unset/true: the loss meets lm_head in chunks; false: whole logits
    # sharding over ranks (distributed.py): FSDP2 from axolotl's fsdp keys, or DeepSpeed ZeRO from a JSON file
    fsdp: Optional[Union[str, list[str]]] = None  # axolotl's list: full_shard, shard_grad_op, offload, auto_wrap
    fsdp_version: Optional[int] = None
    fsdp_config: Optional[dict[str, Any]] = None
    fsdp_final_state_dict_type: Optional[str] = None
    deepspeed: Optional[Union[str, dict[str, Any]]] = None  # a path, beside the config, or a shipped name (zero2)
    # preference training (rl_methods.py; the losses in train/preference.py)
    rl: Optional[str] = None  # dpo, ipo or orpo; unset: supervised fine-tuning
    rl_beta: Optional[float] = None  # DPO/IPO's beta (default 0.1); axolotl's older `dpo_beta` too
    dpo_beta: Optional[float] = None
    dpo_loss_type: Optional[Union[str, list[str]]] = None  # sigmoid (default), ipo, hinge; a list is a weighted sum
    dpo_loss_weights: Optional[list[float]] = None  # one per dpo_loss_type (default: 1 each)
    dpo_label_smoothing: float = 0.0  # conservative DPO: the chance a pair's label is flipped
    orpo_alpha: Optional[float] = None  # ORPO's weight of the odds-ratio term (default 0.1)
    simpo_gamma: Optional[float] = None  # SimPO's target reward margin (default 0.5, as TRL's CPO trainer)
    cpo_alpha: Optional[float] = None  # SimPO's weight of the chosen reply's NLL (default 1.0, as TRL; 0: pure SimPO)
    kto_desirable_weight: float = 1.0  # KTO's weights of desirable and undesirable rows' losses
    kto_undesirable_weight: float = 1.0
    precompute_ref_log_probs: bool = False  # reference log-probs computed once, before training, and cached
    # speed: torch.compile of the model's body (train/compiling.py), and the peak MFU is measured against
    torch_compile: Union[bool, Literal["auto"]] = False  # "auto": true, as in axolotl (torch ≥ 2.5.1 here)
    torch_compile_mode: Optional[Literal["default", "reduce-overhead", "max-autotune"]] = None
    torch_compile_backend: Optional[str] = None  # torch.compile's backend (inductor when unset)
    torch_compile_options: Optional[dict[str, Any]] = None  # torch._inductor.config flags set before compiling
    peak_tflops: Optional[float] = None  # tuneloop's key: this device's peak for MFU, instead of table or probe
    bfloat16: bool = False  # load the weights in bf16 (no fp32 copy): half the memory, bf16 updates
    float16: bool = False  # the same in fp16
    float32: bool = False  # the default: fp32 weights (mixed precision computes in bf16 where asked)
    # outputs, logging, eval, saves
    output_dir: str = "./model-out"
    logging_steps: int = 10
    eval_steps: Optional[Union[int, float]] = None
    evals_per_epoch: Optional[int] = None
    eval_strategy: Optional[Literal["steps", "epoch", "no"]] = None  # axolotl's `evaluation_strategy` too
    eval_on_start: bool = False
    save_steps: Optional[Union[int, float]] = None
    saves_per_epoch: Optional[int] = None
    save_strategy: Optional[Literal["steps", "epoch", "no"]] = None
    save_total_limit: Optional[int] = None
    seed: int = 42
    dataset_processes: Optional[int] = None  # processes that tokenize the data (default: every core available)
    # trackers (trackers.py), as axolotl spells them; metrics.jsonl is always written
    use_tensorboard: bool = False  # event files in output_dir/runs/
    use_wandb: Optional[bool] = None  # unset: on when wandb_project is set
    wandb_project: Optional[str] = None
    wandb_entity: Optional[str] = None
    wandb_name: Optional[str] = None
    wandb_run_id: Optional[str] = None  # continue that run (and its name, when wandb_name is unset)
    wandb_mode: Optional[Literal["online", "offline", "disabled", "shared"]] = None  # unset: WANDB_MODE or online
    use_mlflow: Optional[bool] = None  # unset: on when mlflow_experiment_name or mlflow_tracking_uri is set
    mlflow_tracking_uri: Optional[str] = None
    mlflow_experiment_name: Optional[str] = None
    mlflow_run_name: Optional[str] = None
    # resume and failure handling
    resume_from_checkpoint: Optional[str] = None
    auto_resume_from_checkpoints: bool = False
    loss_watchdog_threshold: Optional[float] = None
    loss_watchdog_patience: Optional[int] = None
    early_stopping_patience: Optional[int] = None

    @field_validator("rl")
    @classmethod
    def _known_rl(cls, value):
        return value if value is None else check_rl(value)

    @field_validator("dpo_loss_type")
    @classmethod
    def _loss_types(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("dpo_label_smoothing")
    @classmethod
    def _smoothing(cls, value):
        if not 0 <= value < 0.5:
            raise ValueError("must be at least 0 and below 0.5 (the chance that a pair's label is wrong)")
        return value

    @field_validator("rl_beta", "dpo_beta", "orpo_alpha", "kto_desirable_weight", "kto_undesirable_weight",
                     "simpo_gamma")
    @classmethod
    def _positive_weight(cls, value):
        if value is not None and value <= 0:
            raise ValueError("must be above 0")
        return value

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value):
        return OPTIMIZERS.check(value)

    @field_validator("lr_scheduler")
    @classmethod
    def _known_scheduler(cls, value):
        return SCHEDULERS.check(value)

    @field_validator("sequence_len", "micro_batch_size", "gradient_accumulation_steps", "num_epochs", "logging_steps")
    @classmethod
    def _positive(cls, value):
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @model_validator(mode="before")
    @classmethod
    def _old_tokens_mapping(cls, data):
        """Old axolotl configs give special tokens as a `tokens:` mapping (today's `special_tokens`)."""
        if isinstance(data, dict) and isinstance(data.get("tokens"), dict):
            data = dict(data)
            data["special_tokens"] = {**data.pop("tokens"), **(data.get("special_tokens") or {})}
            warnings.warn("`tokens` given as a mapping is axolotl's old spelling of `special_tokens`; it is read as "
                          "that.", UserWarning, stacklevel=2)
        return data

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, value):
        if value == "offload_disk":
            warnings.warn("`gradient_checkpointing: offload_disk`: tuneloop offloads checkpointed activations to CPU "
                          "memory, not to disk (where they live changes only memory and speed).", UserWarning,
                          stacklevel=2)
            return "offload"
        return value

    @field_validator("unfrozen_parameters")
    @classmethod
    def _unfrozen_patterns(cls, value):
        from tuneloop.adapters import name_pattern

        for pattern in value or []:
            if re.search(r"\[\d*(:\d*)?\]$", pattern):
                raise ValueError(f"{pattern!r}: unfreezing a row range of a parameter asks for "
                                 f"{axolotl_keys.FEATURES['training_methods'][0]}; unfreeze whole parameters")
            _compiled(pattern, name_pattern(pattern))
        return value

    @field_validator("lora_target_modules")
    @classmethod
    def _target_regex(cls, value):
        if isinstance(value, str):
            _compiled(value, value)
        return value

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value):
        return value if value is None else check_template_name(value)

    @field_validator("attn_implementation")
    @classmethod
    def _attention(cls, value):
        if value is None or value in ATTENTION_IMPLEMENTATIONS or value.startswith("kernels-community/"):
            return value
        raise ValueError(f"got {value!r}; use one of {', '.join(sorted(ATTENTION_IMPLEMENTATIONS))} or a "
                         "kernels-community/ flash-attention kernel")

    @field_validator("model_type")
    @classmethod
    def _model_class(cls, value):
        if value is None or value in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM") or value.endswith("ForCausalLM"):
            return value
        if is_seq2seq_class(value):
            return value
        feature = ("multimodal" if "ConditionalGeneration" in value or "ImageText" in value or "Vision" in value
                   else "preference" if "SequenceClassification" in value else "model_options")
        raise ValueError(f"got {value!r}: tuneloop trains causal language models (AutoModelForCausalLM or a "
                         f"*ForCausalLM class) and text-to-text models (AutoModelForSeq2SeqLM, "
                         f"T5ForConditionalGeneration, ...); this needs {axolotl_keys.FEATURES[feature][0]}")

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, value):
        for plugin in value:
            if plugin not in axolotl_keys.SPEED_ONLY_PLUGINS:
                raise ValueError(f"the plugin {plugin!r} is {axolotl_keys.FEATURES['plugins'][0]} tuneloop does not "
                                 "have; remove it")
            warnings.warn(f"`plugins`: {axolotl_keys.SPEED_ONLY_PLUGINS[plugin]} changes only speed, memory or "
                          "logging, so tuneloop trains without it.", UserWarning, stacklevel=2)
        return value

    @field_validator("max_steps", "eval_batch_size", "batch_size", "dataset_processes",
                     "save_total_limit", "loss_watchdog_patience", "early_stopping_patience")
    @classmethod
    def _positive_or_none(cls, value):
        if value is not None and value < 1:
            raise ValueError("must be at least 1 (or left out)")
        return value

    @field_validator("peak_tflops")
    @classmethod
    def _peak_positive(cls, value):
        if value is not None and value <= 0:
            raise ValueError("is the device's peak in TFLOPS (e.g. 989 for an H100 in bf16): a positive number")
        return value

    @field_validator("warmup_steps", "dataset_shard_idx", "weight_decay", "evals_per_epoch", "saves_per_epoch",
                     "max_grad_norm")
    @classmethod
    def _not_negative(cls, value, info):
        if value is not None and value < 0:
            raise ValueError(f"must be 0{ZERO_MEANS.get(info.field_name, '')} or more")
        return value

    @field_validator("lora_r", "lora_alpha")
    @classmethod
    def _lora_positive(cls, value):
        if value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("lora_dropout", "adam_beta1", "adam_beta2")
    @classmethod
    def _probability(cls, value):
        if not 0 <= value < 1:
            raise ValueError("must be in [0, 1)")
        return value

    @field_validator("learning_rate", "lr_div_factor", "adam_epsilon", "loss_watchdog_threshold")
    @classmethod
    def _lr_positive(cls, value):
        if value is None:
            return value
        if value <= 0:
            raise ValueError("must be greater than 0")
        return value

    @field_validator("val_set_size")
    @classmethod
    def _val_set_size(cls, value):
        if value < 0 or (value >= 1 and value != int(value)):
            raise ValueError("must be a fraction in [0, 1) or a whole number of rows")
        return value

    @field_validator("eval_steps", "save_steps")
    @classmethod
    def _interval(cls, value):
        if value is None:
            return value
        if value <= 0 or (value >= 1 and value != int(value)):
            raise ValueError("must be a whole number of steps (≥ 1) or a fraction of the run in (0, 1)")
        return int(value) if value >= 1 else value

    @field_validator("shuffle_merged_datasets")
    @classmethod
    def _shuffled(cls, value):
        if not value:
            raise ValueError("false is not supported: tuneloop's sampler shuffles rows every epoch (by seed)")
        return value

    @field_validator("warmup_ratio", "cosine_min_lr_ratio")
    @classmethod
    def _ratio(cls, value):
        if value is not None and not 0 <= value <= 1:
            raise ValueError("must be between 0 and 1")
        return value

    @model_validator(mode="after")
    def _exclusive_keys(self):
        pairs = [("warmup_steps", "warmup_ratio"), ("eval_steps", "evals_per_epoch"), ("save_steps", "saves_per_epoch")]
        for first, second in pairs:
            if getattr(self, first) is not None and getattr(self, second) is not None:
                raise ValueError(f"`{first}` and `{second}` cannot both be set: keep one of them")
        if self.save_strategy == "no" and (self.save_steps is not None or self.saves_per_epoch):
            raise ValueError("`save_strategy: no` turns saving off, but `save_steps`/`saves_per_epoch` is set: "
                             "keep one of them")
        if self.save_strategy == "epoch" and self.save_steps is not None:
            raise ValueError("`save_strategy: epoch` and `save_steps` disagree: keep one of them")
        if self.bf16 is True and self.fp16:
            raise ValueError("`bf16` and `fp16` cannot both be true: choose one precision")
        if self.test_datasets and self.val_set_size:
            raise ValueError("`test_datasets` and `val_set_size` cannot both be set: keep one way to get an eval set")
        if self.dataset_shard_num is not None and not 0 <= self.dataset_shard_idx < self.dataset_shard_num:
            raise ValueError(f"`dataset_shard_idx` must be in [0, dataset_shard_num={self.dataset_shard_num})")
        if self.lr_div_factor is not None and self.lr_scheduler != "one_cycle":
            raise ValueError(f"`lr_div_factor` only shapes `lr_scheduler: one_cycle`, and this run uses "
                             f"`{self.lr_scheduler}`: remove it or switch the scheduler")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("`load_in_4bit` and `load_in_8bit` cannot both be true: choose one")
        if self.adapter == "qlora" and self.load_in_8bit:
            raise ValueError("`adapter: qlora` loads the weights in 4-bit, and `load_in_8bit` asks for 8-bit: use "
                             "`adapter: lora` with load_in_8bit, or qlora without it")
        if self.cosine_min_lr_ratio is not None and self.lr_scheduler in ("constant", "constant_with_warmup",
                                                                           "one_cycle"):
            raise ValueError(f"`cosine_min_lr_ratio` sets where a decay ends, and `lr_scheduler: "
                             f"{self.lr_scheduler}` has none of its own: remove it or switch the scheduler")
        flags = [name for name in ("flash_attention", "sdp_attention", "flex_attention", "eager_attention")
                 if getattr(self, name)]
        implied = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "flex_attention": "flex_attention",
                   "eager_attention": "eager"}
        if len(flags) > 1 or (flags and self.attn_implementation
                              and implied[flags[0]] != self.attn_implementation):
            named = flags + ([f"attn_implementation: {self.attn_implementation}"] if self.attn_implementation else [])
            raise ValueError(f"the attention settings disagree ({', '.join(named)}): keep one of them")
        _jinja_means_jinja(self)
        if (self.load_in_4bit or self.load_in_8bit) and not self.adapter:
            raise ValueError("quantized weights (`load_in_4bit`/`load_in_8bit`) are not trained directly: set "
                             "`adapter: qlora` (4-bit) or `adapter: lora`")
        if self.adapter and not (self.lora_target_linear or self.lora_target_modules or self.lora_target_parameters):
            raise ValueError(f"`adapter: {self.adapter}` needs `lora_target_modules`, `lora_target_parameters` or "
                             "`lora_target_linear: true`")
        if self.unfrozen_parameters and self.adapter:
            raise ValueError(f"`unfrozen_parameters` with `adapter: {self.adapter}` (base-model weights trained next "
                             f"to the adapter) asks for {axolotl_keys.FEATURES['peft_variants'][0]}; keep one of them")
        if sum((self.bfloat16, self.float16, self.float32)) > 1:
            raise ValueError("`bfloat16`, `float16` and `float32` choose one dtype for the weights: keep one")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ValueError("`eval_strategy: steps` needs `eval_steps`")
        if self.eval_strategy in ("epoch", "no") and self.eval_steps is not None:
            raise ValueError(f"`eval_strategy: {self.eval_strategy}` and `eval_steps` disagree: keep one of them")
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            raise ValueError("`chat_template: jinja` needs the template text in `chat_template_jinja`")
        self._check_model_source()
        self._check_streaming()
        self._check_preference()
        self._distributed = self._read_distributed()
        return self

    @property
    def streams(self) -> bool:
        """The training rows are read as a stream (pretraining_dataset, or `streaming: true`)."""
        return self.streaming or bool(self.pretraining_dataset)

    @property
    def train_entries(self) -> list["DatasetConfig"]:
        """The training data's entries: `datasets`, or pretraining_dataset's as dataset entries."""
        if not self.pretraining_dataset:
            return self.datasets
        return [entry.as_dataset() if isinstance(entry, PretrainingDataset) else entry
                for entry in self.pretraining_dataset]

    @property
    def streams_packed(self) -> bool:
        """Pretraining text is always packed into full rows; streamed `datasets` as sample_packing says."""
        return bool(self.pretraining_dataset) or self.sample_packing

    def _check_streaming(self) -> None:
        if not self.datasets and not self.pretraining_dataset:
            raise ValueError("`datasets` is required (or `pretraining_dataset`, text read as a stream)")
        if not self.streams:
            return
        if self.datasets and self.pretraining_dataset:
            raise ValueError("`pretraining_dataset` replaces `datasets` (its text is read as a stream): keep one")
        self.train_entries  # (a text_column that would be ignored is refused here)
        if not self.max_steps:
            raise ValueError("a streamed dataset (`pretraining_dataset` or `streaming: true`) is read as the run "
                             "goes, so its length is unknown: set `max_steps`")
        conflicts = [("val_set_size", self.val_set_size), ("group_by_length", self.group_by_length),
                     ("dataset_shard_num", self.dataset_shard_num)]
        for key, value in conflicts:
            if value:
                why = {"val_set_size": "hold eval rows out of a stream; use `test_datasets`",
                       "group_by_length": "sort a stream by length",
                       "dataset_shard_num": "shard a stream (each rank already reads its own share)"}[key]
                raise ValueError(f"`{key}` cannot be used with a streamed dataset: tuneloop does not {why}")
        if any(entry.type is not None and not isinstance(entry.type, str) or entry.type in PREFERENCE_FORMATS
               or entry.type in UNPAIRED_FORMATS for entry in self.train_entries) or self.rl:
            raise ValueError("preference data (`rl:`) is prepared whole: remove `streaming`")

    @property
    def from_scratch(self) -> bool:
        """Random weights from a config (base_model_config without base_model, or reinit_weights)."""
        return self.reinit_weights or self.base_model is None

    def _check_model_source(self) -> None:
        if self.base_model is None and self.base_model_config is None:
            raise ValueError("`base_model` is required (the model to fine-tune); to train from scratch give "
                             "`base_model_config` (a folder with a config.json, or a model type such as t5)")
        named = [key for key in ("pad_token", "eos_token", "unk_token") if key in self.special_tokens]
        if self.train_tokenizer and named:
            raise ValueError(f"`special_tokens.{named[0]}` and `train_tokenizer` both name it: a trained tokenizer's "
                             "special tokens are `train_tokenizer.special_tokens`; move it there")
        if not self.from_scratch:
            if self.train_tokenizer:
                raise ValueError("`train_tokenizer` makes new token ids, which mean nothing to the pretrained weights "
                                 f"of {self.base_model}: use it to train from scratch (`reinit_weights: true`, or "
                                 "`base_model_config` without base_model), or remove it")
            return
        if self.adapter:
            raise ValueError(f"`adapter: {self.adapter}` trains a small adapter on frozen weights, and this run "
                             "starts from random weights (training from scratch): remove the adapter")
        if self.rl:
            raise ValueError(f"`rl: {self.rl}` tunes a trained model's preferences, and this run starts from random "
                             "weights: train it first, then give it as base_model")
        if self.base_model is None and not (self.train_tokenizer or self.tokenizer_config):
            source = self.base_model_config
            if source is None or not Path(source).expanduser().is_dir():
                raise ValueError(f"training from scratch with `base_model_config: {source}` needs a tokenizer: "
                                 "`train_tokenizer: {type: bpe, vocab_size: 8000}` trains one on the data, or "
                                 "`tokenizer_config` names one")

    def _read_distributed(self):
        from tuneloop.distributed import read_distributed

        fsdp_config = dict(self.fsdp_config or {})
        if self.fsdp_final_state_dict_type:
            fsdp_config.setdefault("final_state_dict_type", self.fsdp_final_state_dict_type)
        dist = read_distributed(self.fsdp, self.fsdp_version, fsdp_config, self.deepspeed)
        if dist.engine != "ddp" and self.torch_compile:  # compiling changes only speed: said, and left off
            warnings.warn(f"`torch_compile` with {dist.engine}: tuneloop compiles only unsharded models so far, so "
                          "this run is not compiled (the same result, without the speed-up).", UserWarning,
                          stacklevel=2)
            self.torch_compile = False
        if (self.adapter == "qlora" or self.load_in_4bit or self.load_in_8bit) and dist.engine != "ddp":
            raise ValueError(f"quantized weights (`adapter: {self.adapter}`"
                             f"{', load_in_8bit' if self.load_in_8bit else ''}) under {dist.engine} asks for "
                             f"{axolotl_keys.FEATURES['sharded_4bit'][0]}, which tuneloop does not do yet (it needs a "
                             "GPU to be built and tested); use `adapter: lora` under FSDP2/DeepSpeed, or QLoRA with "
                             "plain DDP ranks")
        if dist.activation_checkpointing and not self.gradient_checkpointing:
            self.gradient_checkpointing = True  # fsdp_config.activation_checkpointing is the same recomputation
        return dist

    @property
    def distributed(self):
        """How the ranks share the model (distributed.py): DDP, FSDP2 or DeepSpeed ZeRO."""
        return self._distributed

    def _check_preference(self) -> None:
        """`rl:` and its keys agree, and every dataset is preference data (of the method's kind: pairs, or KTO's
        labelled rows) exactly when `rl` is set."""
        method = RL_METHODS[self.rl] if self.rl else None
        formats = (PREFERENCE_FORMATS if method.paired else UNPAIRED_FORMATS) if method else None
        for index, entry in enumerate(self.datasets + self.test_datasets):
            mapping = isinstance(entry.type, PreferenceFormat)
            if method:
                fits = (entry.type in formats) if isinstance(entry.type, str) else mapping
                if not fits:
                    name = entry.type if isinstance(entry.type, str) else "a mapping of instruction fields"
                    data = "preference pairs" if method.paired else "rows with a desirable/undesirable label"
                    raise ValueError(f"`rl: {self.rl}` trains on {data}, and dataset {index} is `type: {name}`: use "
                                     f"one of {formats.choices()}, or a mapping with field_prompt and "
                                     + ("field_chosen/field_rejected" if method.paired else
                                        "field_completion/field_label"))
                wrong = [key for key in (UNPAIRED_ONLY_KEYS if method.paired else PAIRED_ONLY_KEYS)
                         if mapping and key in entry.type.model_fields_set]
                if wrong:
                    raise ValueError(f"dataset {index}: `type.{wrong[0]}` is not read by `rl: {self.rl}`; remove it")
            elif mapping or (isinstance(entry.type, str) and entry.type not in FORMATS):
                raise ValueError(f"dataset {index} is preference data (chosen/rejected pairs, or labelled rows): set "
                                 "`rl: dpo` (or ipo, orpo, kto) to train on it")
        preference_keys = ("rl_beta", "dpo_beta", "dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing",
                           "orpo_alpha", "precompute_ref_log_probs", "kto_desirable_weight", "kto_undesirable_weight",
                           "simpo_gamma", "cpo_alpha")
        if not self.rl:
            stray = [key for key in preference_keys
                     if key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default]
            if stray:
                raise ValueError(f"`{stray[0]}` sets preference training, which `rl:` turns on: set `rl: dpo` (or "
                                 "ipo, orpo, kto) or remove it")
            return
        kto_keys = [key for key in ("kto_desirable_weight", "kto_undesirable_weight") if key in self.model_fields_set]
        if kto_keys and self.rl != "kto":
            raise ValueError(f"`{kto_keys[0]}` weighs KTO's rows, and this run is `rl: {self.rl}`: remove it")
        simpo_keys = [key for key in ("simpo_gamma", "cpo_alpha") if getattr(self, key) is not None]
        if simpo_keys and self.rl != "simpo":
            raise ValueError(f"`{simpo_keys[0]}` shapes SimPO's loss, and this run is `rl: {self.rl}`: remove it")
        if self.rl_beta is not None and self.dpo_beta is not None and self.rl_beta != self.dpo_beta:
            raise ValueError(f"`rl_beta: {self.rl_beta}` and `dpo_beta: {self.dpo_beta}` are the same setting: "
                             "keep one")
        if self.dpo_loss_type:
            unknown = [name for name in self.dpo_loss_type if name not in method.loss_types]
            if unknown:
                offered = ", ".join(method.loss_types) or "none: it has a loss of its own"
                raise ValueError(f"`dpo_loss_type: {unknown[0]}` is not a loss of `rl: {self.rl}` ({offered})")
        if self.dpo_loss_weights is not None and not method.loss_types:
            raise ValueError(f"`dpo_loss_weights` weighs DPO's losses, and `rl: {self.rl}` has one loss of its own: "
                             "remove it")
        if self.dpo_loss_weights is not None and any(weight < 0 for weight in self.dpo_loss_weights):
            raise ValueError("`dpo_loss_weights` must not be negative (a negative weight would maximise that loss)")
        losses = self.dpo_loss_type or (["ipo"] if self.rl == "ipo" else ["sigmoid"])
        if self.dpo_label_smoothing and method.loss_types and "sigmoid" not in losses:
            raise ValueError("`dpo_label_smoothing` smooths the sigmoid loss, and `dpo_loss_type` has none: remove it "
                             "or add `sigmoid`")
        ignored = sorted({key for entry in self.datasets + self.test_datasets for key in CHAT_ONLY_KEYS
                          if key in TRAINED_TURN_KEYS and key in entry.model_fields_set})
        if ignored:
            raise ValueError(f"`{ignored[0]}` picks the trained turns of a conversation, and under `rl:` the trained "
                             "part is the reply (with its end-of-turn marker): remove it")
        if self.dpo_loss_weights is not None and len(self.dpo_loss_weights) != len(self.dpo_loss_type or ["sigmoid"]):
            raise ValueError(f"`dpo_loss_weights` has {len(self.dpo_loss_weights)} weights for "
                             f"{len(self.dpo_loss_type or ['sigmoid'])} losses in `dpo_loss_type`: give one each")
        if self.rl == "orpo":
            used = [key for key in ("rl_beta", "dpo_beta", "dpo_label_smoothing", "precompute_ref_log_probs")
                    if getattr(self, key)]
            if used:
                raise ValueError(f"`{used[0]}` shapes a loss against a reference model, and `rl: {self.rl}` has none "
                                 "(its weight is `orpo_alpha`): remove it")
        elif not method.uses_reference and self.precompute_ref_log_probs:
            raise ValueError(f"`precompute_ref_log_probs` with `rl: {self.rl}`, which has no reference model: "
                             "remove it")
        if self.cpo_alpha is not None and self.cpo_alpha < 0:
            raise ValueError("`cpo_alpha` must not be negative (it weighs the chosen reply's NLL)")
        if self.rl in ("kto", "simpo") and self.dpo_label_smoothing:
            raise ValueError(f"`dpo_label_smoothing` smooths DPO's loss, and this run is `rl: {self.rl}`: remove it")
        if self.orpo_alpha is not None and self.rl != "orpo":
            raise ValueError(f"`orpo_alpha` weighs ORPO's odds ratio, and this run is `rl: {self.rl}`: remove it")
        if self.train_on_inputs:
            raise ValueError(f"`train_on_inputs: true` with `rl: {self.rl}`: a preference loss compares the replies, "
                             "and the prompt is never part of it; remove it")

    @property
    def beta(self) -> float:
        """DPO/IPO's beta: rl_beta (or dpo_beta), 0.1 by default as in TRL."""
        return self.rl_beta if self.rl_beta is not None else self.dpo_beta if self.dpo_beta is not None else 0.1

    # ---- derived values -------------------------------------------------------------------
    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    @property
    def resolved_eval_sample_packing(self) -> bool:
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing

    def check_batch_size(self, world_size: int) -> None:
        """`batch_size` is axolotl's global batch; it must agree with the other three knobs."""
        if self.batch_size is None:
            return
        implied = self.micro_batch_size * self.gradient_accumulation_steps * world_size
        if self.batch_size != implied:
            raise UserError(
                f"config: `batch_size: {self.batch_size}` disagrees with micro_batch_size × "
                f"gradient_accumulation_steps × world size = {self.micro_batch_size} × "
                f"{self.gradient_accumulation_steps} × {world_size} = {implied}. "
                "Remove `batch_size` or change one of the others."
            )


# keys that change when or how a run is observed, saved or stopped, not what it trains: a run may resume from
# a checkpoint written with other values of these. max_steps and num_epochs change the run's length, which a
# resume may extend (resume.py); every other key must agree with the checkpoint's.
NOT_RESULT_CHANGING = {
    "output_dir", "logging_steps", "eval_steps", "evals_per_epoch", "eval_on_start", "eval_batch_size",
    "eval_sample_packing", "save_steps", "saves_per_epoch", "save_strategy", "save_total_limit",
    "resume_from_checkpoint", "auto_resume_from_checkpoints", "dataset_prepared_path", "loss_watchdog_threshold",
    "loss_watchdog_patience", "early_stopping_patience",
    # speed only: compiling rounds widths up (more padding, the same rows and loss) and peak_tflops scales MFU
    "torch_compile", "torch_compile_mode", "torch_compile_backend", "torch_compile_options", "peak_tflops",
    # how fast the data is prepared (the cache's bytes are the same for any process count)
    "dataset_processes",
    # where the metrics go
    "use_tensorboard", "use_wandb", "wandb_project", "wandb_entity", "wandb_name", "wandb_run_id", "wandb_mode",
    "use_mlflow", "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name",
}
RUN_LENGTH_KEYS = {"max_steps", "num_epochs"}


def result_settings(cfg: TuneloopConfig) -> dict:
    """The settings that decide what a run trains (JSON-ready), to compare a run with a checkpoint's."""
    return {key: value for key, value in cfg.model_dump(mode="json").items() if key not in NOT_RESULT_CHANGING}


def changed_settings(before: dict, now: dict, ignore: set[str] = frozenset()) -> list[str]:
    """`key (old → new)` for each setting that differs; long values are named, not printed."""
    changed = []
    for key in sorted(set(before) | set(now)):
        # a key an older tuneloop did not have was, in effect, at its default
        old = before[key] if key in before else _default_setting(key)
        new = now.get(key)
        if key in ignore or old == new:
            continue
        if isinstance(old, (list, dict)) or isinstance(new, (list, dict)):
            changed.append(f"{key} (changed)")
        else:
            changed.append(f"{key} ({old} → {new})")
    return changed


def _default_setting(key: str):
    """A top-level key's default as result_settings writes it (JSON), or None for a key it does not know."""
    field = TuneloopConfig.model_fields.get(key)
    if field is None or field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


TOP_LEVEL_KEYS = set(TuneloopConfig.model_fields)
DATASET_KEYS = set(DatasetConfig.model_fields)
CUSTOM_FORMAT_KEYS = set(CustomFormat.model_fields) | set(PreferenceFormat.model_fields)
# axolotl's other names for keys tuneloop implements (its remapped and deprecated spellings)
ALIASES = {"type_of_model": "model_type", "model_revision": "revision_of_model",
           "dataset_num_proc": "dataset_processes", "model_config": "overrides_of_model_config",
           "evaluation_strategy": "eval_strategy"}
AXOLOTL_TOP_LEVEL = (set(axolotl_keys.SPEED_OR_LOGGING) | axolotl_keys.LAUNCHER | set(axolotl_keys.REFUSED)
                     | axolotl_keys.REMOVED)


def _compiled(written: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{written!r} is not a valid regular expression ({error})") from None


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def without_blanks(value: Any) -> Any:
    """A blank YAML value (`key:` with nothing after it) means "not set", at every depth, as in axolotl."""
    if isinstance(value, dict):
        return {key: without_blanks(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_blanks(item) for item in value]
    return value


def _nearest(key: str, known: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else ""


def _triage_top_level(raw: dict, problems: list[str]) -> dict:
    """Keys tuneloop implements are kept (axolotl's aliases renamed); every other axolotl key is handled as
    axolotl_keys.py classifies it. Problems are collected, so a config shows all of them at once."""
    kept = {}
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name in TOP_LEVEL_KEYS:
            if name in kept:
                problems.append(f"`{key}` and `{name}` are the same setting: keep one of them")
            kept[name] = value
        elif key in axolotl_keys.LAUNCHER:
            continue  # set by launchers (torchrun gives each rank its own), not a training setting
        elif key in axolotl_keys.SPEED_OR_LOGGING:
            if not _is_empty(value):
                warnings.warn(f"`{key}` is an axolotl key tuneloop does not implement; it only affects speed, memory "
                              "or logging, so it is ignored.", UserWarning, stacklevel=3)
        elif key in axolotl_keys.REFUSED or key in axolotl_keys.REMOVED:
            if not _is_empty(value):
                problems.append(axolotl_keys.refusal(key, value))
        else:
            problems.append(f"unknown key `{key}`.{_nearest(key, TOP_LEVEL_KEYS | AXOLOTL_TOP_LEVEL | set(ALIASES))}")
    return kept


def _triage_dataset(entry: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(entry, dict):
        return entry  # pydantic names the type error
    kept = {}
    for key, value in entry.items():
        if key in DATASET_KEYS:
            kept[key] = value
        elif key in axolotl_keys.DATASET_REFUSED:
            if not _is_empty(value):
                problems.append(axolotl_keys.refusal(key, value, where))
        else:
            known = DATASET_KEYS | set(axolotl_keys.DATASET_REFUSED)
            problems.append(f"unknown key {where}`{key}`.{_nearest(key, known)}")
    if isinstance(kept.get("type"), dict):
        for key in kept["type"]:
            if key not in CUSTOM_FORMAT_KEYS:
                problems.append(f"unknown key {where}type.`{key}`.{_nearest(key, CUSTOM_FORMAT_KEYS)}")
    return kept


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` → (["a", "b"], value parsed as YAML)."""
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected KEY=VALUE, e.g. --set learning_rate=1e-4")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError as error:
        raise UserError(f"--set {text!r}: the value is not valid YAML ({error.problem})") from None
    return key.strip().split("."), parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = raw
        for part in path[:-1]:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                raise UserError(f"--set {text!r}: cannot descend into `{part}`")
        last = path[-1]
        if isinstance(node, list) and last.isdigit() and int(last) < len(node):
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise UserError(f"--set {text!r}: `{last}` is not an entry of that list")
    return raw


def _validation_lines(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"] if not str(part).startswith(("function-", "literal["))
                       and part not in (PRETRAINING_FORM, DATASET_FORM))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "is required"
        elif item["type"].startswith("literal_error"):
            message = f"got {item.get('input')!r}; {message.lower()}"
        elif "input" in item and item["type"] not in ("value_error",):
            message = f"got {item['input']!r}; {message}"
        lines.append(f"`{key}` {message}" if key else message)
    return lines


def config_from_dict(raw: Any, overrides: list[str] = ()) -> TuneloopConfig:
    if not isinstance(raw, dict):
        raise UserError("config: the YAML file must be a mapping of keys to values")
    raw = without_blanks(apply_overrides(dict(raw), list(overrides)))
    problems: list[str] = []
    kept = _triage_top_level(raw, problems)
    for list_key in ("datasets", "test_datasets"):
        if isinstance(kept.get(list_key), list):
            kept[list_key] = [_triage_dataset(entry, f"{list_key}[{i}].", problems)
                              for i, entry in enumerate(kept[list_key])]
    try:
        cfg = TuneloopConfig.model_validate(kept)
    except ValidationError as error:
        problems += _validation_lines(error)
        cfg = None
    if problems:
        raise UserError("config: " + "\n  ".join(dict.fromkeys(problems)))
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> TuneloopConfig:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config: no such file {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"config: {path} is not valid YAML: {error}") from None
    raw = raw or {}
    if isinstance(raw, dict) and isinstance(raw.get("deepspeed"), str):  # a DeepSpeed file beside the config
        given, beside = Path(raw["deepspeed"]).expanduser(), path.parent / raw["deepspeed"]
        if not given.is_file() and not given.is_absolute() and beside.is_file():
            raw = dict(raw, deepspeed=str(beside.resolve()))
    return config_from_dict(raw, overrides)
