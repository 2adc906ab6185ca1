"""The run's config: axolotl-named YAML keys, validated by pydantic, with errors a user can act on.

`load_config(path, overrides)` is the only way in. It reads YAML, applies `--set key=value`
overrides, rejects unknown keys naming the nearest known one, triages axolotl keys we do not
implement (see axolotl_keys.py), and turns pydantic's errors into one `UserError` per problem.
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tuneloop.axolotl_keys import RESULT_CHANGING, SPEED_OR_LOGGING_ONLY
from tuneloop.data.formats import FORMATS
from tuneloop.errors import UserError
from tuneloop.optim import OPTIMIZERS, SCHEDULERS


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


class DatasetConfig(_Strict):
    path: str
    type: Union[str, CustomFormat] = "alpaca"
    data_files: Optional[Union[str, list[str]]] = None
    ds_type: Optional[Literal["json", "jsonl", "parquet", "csv", "arrow", "text"]] = None
    split: str = "train"
    # completion
    field: Optional[str] = None
    # chat_template
    field_messages: Optional[str] = None
    message_field_role: str = "role"
    message_field_content: str = "content"
    roles_to_train: list[str] = Field(default_factory=lambda: ["assistant"])

    @field_validator("split")
    @classmethod
    def _local_split(cls, value):
        if value != "train":
            raise ValueError("tuneloop reads local files, which hold one split, `train`; point `path` or "
                             "`data_files` at the file of the split you want")
        return value

    @field_validator("type")
    @classmethod
    def _known_type(cls, value):
        if isinstance(value, str) and value not in FORMATS:
            raise ValueError(f"unknown dataset type {value!r}; tuneloop supports {FORMATS.choices()}, "
                             "or a mapping with field_instruction/field_input/field_output/format")
        return value


class TuneloopConfig(_Strict):
    # model
    base_model: str
    tokenizer_config: Optional[str] = None
    trust_remote_code: bool = False
    attn_implementation: Optional[Literal["sdpa", "eager", "flash_attention_2", "flex_attention"]] = None
    flash_attention: bool = False
    sdp_attention: bool = False
    special_tokens: dict[str, str] = Field(default_factory=dict)
    chat_template: Optional[str] = None
    chat_template_jinja: Optional[str] = None
    # adapters
    adapter: Optional[Literal["lora", "qlora"]] = None
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: Optional[list[str]] = None
    lora_target_linear: bool = False
    lora_modules_to_save: Optional[list[str]] = None
    # data
    datasets: list[DatasetConfig]
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
    max_grad_norm: Optional[float] = 1.0
    # precision and memory
    bf16: Union[bool, Literal["auto"]] = "auto"
    fp16: bool = False
    tf32: bool = False
    gradient_checkpointing: bool = False
    # outputs, logging, eval, saves
    output_dir: str = "./model-out"
    logging_steps: int = 10
    eval_steps: Optional[Union[int, float]] = None
    evals_per_epoch: Optional[int] = None
    eval_on_start: bool = False
    save_steps: Optional[Union[int, float]] = None
    saves_per_epoch: Optional[int] = None
    save_strategy: Optional[Literal["steps", "epoch", "no"]] = None
    save_total_limit: Optional[int] = None
    seed: int = 42
    # resume and failure handling
    resume_from_checkpoint: Optional[str] = None
    auto_resume_from_checkpoints: bool = False
    loss_watchdog_threshold: Optional[float] = None
    loss_watchdog_patience: Optional[int] = None
    early_stopping_patience: Optional[int] = None

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

    @field_validator("max_steps", "eval_batch_size", "batch_size", "evals_per_epoch", "saves_per_epoch",
                     "save_total_limit", "loss_watchdog_patience", "early_stopping_patience")
    @classmethod
    def _positive_or_none(cls, value):
        if value is not None and value < 1:
            raise ValueError("must be at least 1 (or left out)")
        return value

    @field_validator("warmup_steps", "dataset_shard_idx")
    @classmethod
    def _not_negative(cls, value):
        if value is not None and value < 0:
            raise ValueError("must be 0 or more")
        return value

    @field_validator("weight_decay")
    @classmethod
    def _decay_not_negative(cls, value):
        if value < 0:
            raise ValueError("must be 0 or more")
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

    @field_validator("learning_rate", "lr_div_factor", "adam_epsilon", "max_grad_norm", "loss_watchdog_threshold")
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
        if self.save_strategy == "no" and (self.save_steps is not None or self.saves_per_epoch is not None):
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
        if self.chat_template and self.chat_template not in ("tokenizer_default", "chatml", "jinja"):
            raise ValueError(
                f"`chat_template: {self.chat_template}` is not supported: use tokenizer_default, chatml, "
                "or jinja with `chat_template_jinja`"
            )
        if self.lr_div_factor is not None and self.lr_scheduler != "one_cycle":
            raise ValueError(f"`lr_div_factor` only shapes `lr_scheduler: one_cycle`, and this run uses "
                             f"`{self.lr_scheduler}`: remove it or switch the scheduler")
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            raise ValueError("`chat_template: jinja` needs the template text in `chat_template_jinja`")
        return self

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
}
RUN_LENGTH_KEYS = {"max_steps", "num_epochs"}


def result_settings(cfg: TuneloopConfig) -> dict:
    """The settings that decide what a run trains (JSON-ready), to compare a run with a checkpoint's."""
    return {key: value for key, value in cfg.model_dump(mode="json").items() if key not in NOT_RESULT_CHANGING}


def changed_settings(before: dict, now: dict, ignore: set[str] = frozenset()) -> list[str]:
    """`key (old → new)` for each setting that differs; long values are named, not printed."""
    changed = []
    for key in sorted(set(before) | set(now)):
        if key in ignore or before.get(key) == now.get(key):
            continue
        old, new = before.get(key), now.get(key)
        if isinstance(old, (list, dict)) or isinstance(new, (list, dict)):
            changed.append(f"{key} (changed)")
        else:
            changed.append(f"{key} ({old} → {new})")
    return changed


TOP_LEVEL_KEYS = set(TuneloopConfig.model_fields)
DATASET_KEYS = set(DatasetConfig.model_fields)
CUSTOM_FORMAT_KEYS = set(CustomFormat.model_fields)
# axolotl dataset-entry keys we do not implement; each one would change which rows are trained
DATASET_RESULT_CHANGING = {
    "shards", "shards_idx", "preprocess_shards", "conversation", "field_human", "field_model",
    "roles", "revision", "trust_remote_code", "message_property_mappings", "train_on_eos",
    "drop_system_message", "field_tools", "chat_template", "split_thinking", "name", "train_on_split",
}


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _nearest(key: str, known: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else ""


def _triage_keys(raw: dict, known: set[str], where: str, result_changing: set[str],
                 speed_only: set[str] = frozenset()) -> dict:
    """Drop empty or speed-only axolotl keys (warning for the latter), refuse unknown and result-changing ones."""
    kept = {}
    for key, value in raw.items():
        if key in known:
            kept[key] = value
        elif key in speed_only:
            if not _is_empty(value):
                warnings.warn(f"{where}`{key}` is an axolotl key tuneloop does not implement; it only affects "
                              "speed or logging, so it is ignored.", UserWarning, stacklevel=2)
        elif key in result_changing:
            if not _is_empty(value):
                raise UserError(f"config: {where}`{key}: {value!r}` is an axolotl key tuneloop does not implement "
                                "yet, and ignoring it would change what is trained. Remove it (or set it empty).")
        else:
            raise UserError(f"config: unknown key {where}`{key}`.{_nearest(key, known | result_changing | speed_only)}")
    return kept


def _triage_dataset(entry: Any, where: str) -> Any:
    if not isinstance(entry, dict):
        return entry  # pydantic names the type error
    kept = _triage_keys(entry, DATASET_KEYS, where, DATASET_RESULT_CHANGING)
    if isinstance(kept.get("type"), dict):
        _triage_keys(kept["type"], CUSTOM_FORMAT_KEYS, f"{where}type.", set())
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


def _format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"] if not str(part).startswith(("function-", "literal[")))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "is required"
        elif item["type"].startswith("literal_error"):
            message = f"got {item.get('input')!r}; {message.lower()}"
        elif "input" in item and item["type"] not in ("value_error",):
            message = f"got {item['input']!r}; {message}"
        lines.append(f"`{key}` {message}" if key else message)
    unique = list(dict.fromkeys(lines))
    return "config: " + "\n  ".join(unique)


def config_from_dict(raw: Any, overrides: list[str] = ()) -> TuneloopConfig:
    if not isinstance(raw, dict):
        raise UserError("config: the YAML file must be a mapping of keys to values")
    raw = apply_overrides(dict(raw), list(overrides))
    kept = _triage_keys(raw, TOP_LEVEL_KEYS, "", RESULT_CHANGING, SPEED_OR_LOGGING_ONLY)
    for list_key in ("datasets", "test_datasets"):
        if isinstance(kept.get(list_key), list):
            kept[list_key] = [_triage_dataset(entry, f"{list_key}[{i}].") for i, entry in enumerate(kept[list_key])]
    try:
        return TuneloopConfig.model_validate(kept)
    except ValidationError as error:
        raise UserError(_format_validation_error(error)) from None


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> TuneloopConfig:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config: no such file {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"config: {path} is not valid YAML: {error}") from None
    return config_from_dict(raw or {}, overrides)
