"""The dataset entries of a config (`datasets`, `test_datasets`, `pretraining_dataset`), and the format
mappings a `type:` may be, as axolotl writes them. Each entry checks its own keys; what an entry means for the
run as a whole (preference data under `rl:`, a stream) is a rule of config/rules.py.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tuneloop.config import axolotl
from tuneloop.data.chat_templates import check_template_name
from tuneloop.data.formats import FORMATS, TURN_END_OPTIONS
from tuneloop.data.load import parse_split
from tuneloop.online_rl.prompts import is_transform_type
from tuneloop.data.preference import PREFERENCE_CHAT_TYPES, PREFERENCE_FORMATS, REWARD_FORMATS, UNPAIRED_FORMATS
from tuneloop.data.stepwise import STEPWISE_TYPES


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def home_expanded(value: Any) -> Any:
    """A path that starts with `~` (the user's home), expanded, as a shell would; environment variables are not
    (as in axolotl). Lists of paths are expanded one by one; anything else is left as it is."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [home_expanded(item) for item in value]
    return value


def given(model: BaseModel, key: str) -> bool:
    """The key was written in the YAML with a value other than its default (the same value as the default, which a
    run's run_config.yml writes for every key, says nothing: rerunning that file must give the same run)."""
    if key not in model.model_fields_set:
        return False
    return getattr(model, key) != type(model).model_fields[key].get_default(call_default_factory=True)


class CustomFormat(Strict):
    """axolotl's user-defined instruction format (`type:` given as a mapping)."""

    system_prompt: str = ""
    system_format: str = "{system}"
    field_system: str = "system"
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    format: str = "{instruction} {input} "
    no_input_format: str = "{instruction} "


class PreferenceFormat(Strict):
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


# dataset keys that only a chat dataset reads (set on another type, they would be ignored: refused instead)
CHAT_ONLY_KEYS = ("field_messages", "message_field_role", "message_field_content", "message_property_mappings",
                  "roles", "roles_to_train", "train_on_eos", "train_on_eot", "drop_system_message", "field_thinking",
                  "template_thinking_key", "chat_template", "chat_template_jinja", "field_tools")


def jinja_means_jinja(holder) -> None:
    """A template's text without `chat_template: jinja` means that template, as in axolotl."""
    if holder.chat_template_jinja and holder.chat_template is None:
        holder.chat_template = "jinja"
    elif holder.chat_template_jinja and holder.chat_template != "jinja":
        raise ValueError(f"`chat_template: {holder.chat_template}` and `chat_template_jinja` name two templates: "
                         "keep one of them")


class DatasetConfig(Strict):
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
    field_tools: Optional[str] = None  # the row's key for its tool definitions (default `tools`, data/tool_calls.py)
    template_thinking_key: Optional[str] = None  # the template's name for it (reasoning_content)
    chat_template: Optional[str] = None  # this dataset's own template, instead of the run's
    chat_template_jinja: Optional[str] = None
    # preference data (rl:)
    field_chosen: Optional[str] = None  # the row's key for the chosen reply (default `chosen`)
    field_rejected: Optional[str] = None  # and for the rejected one (default `rejected`)
    # a process reward model's rows (type: stepwise_supervised, data/stepwise.py)
    step_separator: Optional[str] = None  # written after each step; its last token carries the label (default "\n")
    max_completion_length: Optional[int] = None  # the steps' tokens cut to this many
    train_on_last_step_only: Optional[bool] = None  # only the last step's label is trained

    @field_validator("split")
    @classmethod
    def _split(cls, value):
        parse_split(value)  # raises ValueError with the accepted forms
        return value

    @field_validator("path", "data_files")
    @classmethod
    def _home(cls, value):
        return home_expanded(value)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value):
        if isinstance(value, str) and not any(value in known for known in (FORMATS, PREFERENCE_FORMATS,
                                                                            UNPAIRED_FORMATS, REWARD_FORMATS, STEPWISE_TYPES)):
            if is_transform_type(value) and axolotl.dataset_type_feature(value) != "preference":
                return value  # axolotl's `type: module.function` transform (online RL's prompts: rules.py)
            feature = axolotl.FEATURES[axolotl.dataset_type_feature(value)][0]
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
        jinja_means_jinja(self)
        chat = self.type in ("chat_template", "chat_template.default", "sharegpt", *PREFERENCE_CHAT_TYPES)
        set_keys = [key for key in CHAT_ONLY_KEYS if given(self, key)]
        if set_keys and not chat:
            raise ValueError(f"`{set_keys[0]}` applies to chat datasets (type chat_template or sharegpt), and this "
                             f"one is `type: {self.type if isinstance(self.type, str) else 'a custom format'}`; "
                             "remove it")
        paired = [key for key in ("field_chosen", "field_rejected") if given(self, key)]
        if paired and self.type not in ("chat_template", "chat_template.default", *PREFERENCE_CHAT_TYPES):
            raise ValueError(f"`{paired[0]}` names a reply of preference data (`rl:` with type chat_template or "
                             "chat_template.argilla); remove it")
        pair_fields = [key for key in ("field_source", "field_target") if given(self, key)]
        if pair_fields and self.type != "seq2seq":
            raise ValueError(f"`{pair_fields[0]}` names a field of a `type: seq2seq` dataset; remove it")
        if given(self, "field") and self.type != "completion":
            raise ValueError("`field` names the text of a `type: completion` dataset; remove it")
        return self


class PretrainingDataset(Strict):
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

    @field_validator("path", "data_files")
    @classmethod
    def _home(cls, value):
        return home_expanded(value)

    @field_validator("skip")
    @classmethod
    def _no_skip(cls, value):
        if value:
            raise ValueError(f"got {value}: skipping rows at the start of the stream is "
                             f"{axolotl.FEATURES['data_options'][0]} tuneloop does not have; remove it")
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


def pretraining_entry_form(value) -> str:
    """axolotl takes a pretraining entry (path, text_column, ...) or any dataset entry (type, field, ...)."""
    keys = set(value) if isinstance(value, dict) else set(value.model_fields_set)
    return PRETRAINING_FORM if keys <= set(PretrainingDataset.model_fields) else DATASET_FORM
