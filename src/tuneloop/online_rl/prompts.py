"""The prompts of an online RL run: read from the datasets, transformed, templated and tokenized once.

A row gives its prompt in a `prompt` column, as TRL reads it: a text (tokenized as it is, no template), or a list
of messages (rendered through the run's chat template with the assistant's turn opened, `chat_template_kwargs`
passed on). A dataset `type: module.function` is axolotl's transform: `function(cfg)` returns a function of
(row, tokenizer=None) -> the row's new columns (or that function and `{"remove_columns": [...]}`), found as reward
functions are (rewards.py). Every other column goes to the reward functions by name.

A prompt longer than `sequence_len - max_completion_length` is left out (counted in the plan, as rows too long for
SFT are), so a prompt and its longest completion always fit.

A row that carries a reference reply (REPLY_COLUMNS: EBFT's `ground_truth`, or a math set's `solution`/`answer`) has
its length in tokens measured once: the plan compares the typical reply with `max_completion_length`, and EBFT's
adaptive cap reads it. `rl: ebft` needs every row's `ground_truth` (online_rl/feature_matching.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field

import numpy as np

from tuneloop.errors import UserError


@dataclass
class PromptSet:
    ids: list[np.ndarray] = field(default_factory=list)  # each prompt's tokens (template and generation prompt)
    prompts: list = field(default_factory=list)  # as the reward functions see them: a text, or the messages
    columns: list[dict] = field(default_factory=list)  # each row's other columns
    where: list[str] = field(default_factory=list)  # file:row of each
    reply_lengths: list = field(default_factory=list)  # tokens of each row's reference reply (None: it has none)
    dropped_too_long: int = 0

    @property
    def key(self) -> str:
        """What a checkpoint records of the prompts: their tokens and columns."""
        digest = hashlib.sha256()
        for ids, columns in zip(self.ids, self.columns):
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
            digest.update(json.dumps(columns, sort_keys=True, default=str).encode())
        return "prompts-" + digest.hexdigest()[:16]

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(ids) for ids in self.ids], dtype=np.int64)


# columns that hold a row's reference reply, the first found counted (EBFT's, TRL's prompt-completion rows', MATH's,
# GSM8K's)
REPLY_COLUMNS = ("ground_truth", "completion", "solution", "answer")
# columns of axolotl's multi-turn EBFT rows (ebft_chat_multiturn), whose later turns it generates one by one
MULTI_TURN_COLUMNS = ("remaining_turns",)


def reply_length(values: dict, tokenizer) -> int | None:
    reply = next((values[key] for key in REPLY_COLUMNS if isinstance(values.get(key), str)), None)
    return None if reply is None else len(tokenizer(reply, add_special_tokens=False)["input_ids"])


def check_ebft_row(values: dict, where: str) -> None:
    """`rl: ebft` compares completions with the row's `ground_truth`; multi-turn rows are refused by name."""
    from tuneloop.online_rl.feature_matching import ANSWER_COLUMN

    if not isinstance(values.get(ANSWER_COLUMN), str):
        found = type(values[ANSWER_COLUMN]).__name__ if ANSWER_COLUMN in values else "none"
        raise UserError(f"data: {where}: `rl: ebft` compares each completion with the row's reference answer, its "
                        f"`{ANSWER_COLUMN}` text, and this row has {found}: give every row one (or a `type:` "
                        "transform that makes it, e.g. ebft_opencode.transform or ebft_reasoning.transform)")
    multi = [key for key in MULTI_TURN_COLUMNS if values.get(key)]
    if multi:
        raise UserError(f"data: {where}: the row has `{multi[0]}`, later turns of a conversation that axolotl's "
                        "multi-turn EBFT generates one after another, which tuneloop does not do yet (it generates "
                        "one reply per prompt): use rows of one prompt and its reply")


def is_transform_type(name) -> bool:
    """`type: module.function` (a Python name with a dot), as opposed to one of the dataset formats."""
    from tuneloop.data.formats import FORMATS
    from tuneloop.data.preference import PREFERENCE_FORMATS, UNPAIRED_FORMATS

    if not isinstance(name, str) or "." not in name or ":" in name:
        return False
    if any(name in known for known in (FORMATS, PREFERENCE_FORMATS, UNPAIRED_FORMATS)):
        return False  # a format whose name has a dot (chat_template.default, chat_template.argilla)
    return all(part.isidentifier() for part in name.split("."))


def dataset_transform(cfg, entry, index: int):
    """(row -> new columns, columns to remove) of a `type: module.function` entry, or None for a plain entry."""
    from tuneloop.online_rl.builtin_transforms import BUILTIN_TRANSFORMS
    from tuneloop.online_rl.rewards import import_dotted

    if not is_transform_type(entry.type):
        return None
    key = f"datasets[{index}].type"
    factory = (BUILTIN_TRANSFORMS[entry.type] if entry.type in BUILTIN_TRANSFORMS
               else import_dotted(entry.type, key, cfg._config_dir))
    try:
        made = factory(cfg)
    except Exception as error:  # the user's code: what it raised, in one line
        first = (str(error).splitlines() or [""])[0]
        raise UserError(f"config: `{key}: {entry.type}` raised {type(error).__name__}: {first} when called with the "
                        "config (a transform is `function(cfg)` returning the function that maps a row)") from None
    transform, options = (made if isinstance(made, tuple) else (made, {}))
    if not callable(transform):
        raise UserError(f"config: `datasets[{index}].type: {entry.type}` returned {type(transform).__name__}: a "
                        "transform returns a function of (row, tokenizer=None) -> the row's new columns")
    return transform, list((options or {}).get("remove_columns") or [])


def transformed(row: dict, where: str, transform, removed: list[str], tokenizer, name: str) -> dict:
    import inspect

    try:
        takes_tokenizer = "tokenizer" in inspect.signature(transform).parameters
    except (TypeError, ValueError):
        takes_tokenizer = True
    try:  # axolotl's transforms take (row, tokenizer=None); one written as f(row) is called so
        made = transform(row, tokenizer=tokenizer) if takes_tokenizer else transform(row)
    except Exception as error:  # the user's code: what it raised, where, in one line
        first = (str(error).splitlines() or [""])[0]
        raise UserError(f"data: {where}: the transform `{name}` raised {type(error).__name__}: {first}") from None
    if not isinstance(made, dict):
        raise UserError(f"data: {where}: the transform `{name}` returned {type(made).__name__}; it must return the "
                        "row's columns as a dict")
    values = {key: value for key, value in row.items() if key not in removed}
    values.update(made)
    return values


def prompt_text(prompt, where: str, tokenizer, template: str | None, template_kwargs: dict, tools=None,
                template_name: str | None = None, values: dict | None = None) -> str:
    """The prompt as the policy reads it. A row's `tools` (and any tool calls and results in its messages) are
    rendered by the template's own tool format (data/tool_calls.py), or the row is refused naming the template:
    never dropped, or the policy would be asked to call tools it was never shown."""
    from tuneloop.data.load import SourceRow
    from tuneloop.data.tool_calls import check_rendered, tool_calls_of

    if isinstance(prompt, str):
        if tools:
            raise UserError(f"data: {where}: the row has `tools`, and its prompt is a text, used as it is (no chat "
                            "template renders the tools into it): give the prompt as a list of messages, or remove "
                            "the tools")
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                               for m in prompt):
        raise UserError(f"data: {where}: `prompt` must be a text or a list of {{role, content}} messages, got "
                        f"{type(prompt).__name__}")
    if template is None:
        raise UserError(f"data: {where}: the prompt is a list of messages and the tokenizer has no chat template: set "
                        "`chat_template` (chatml, llama3, ...) or give the prompt as text")
    row = SourceRow(values or {}, where)
    messages = [{**message, "tool_calls": tool_calls_of(message["tool_calls"], row, number)}
                if message.get("tool_calls") else message for number, message in enumerate(prompt, start=1)]

    def render(conversation, with_tools):
        try:
            return tokenizer.apply_chat_template(conversation, tools=with_tools, chat_template=template,
                                                 tokenize=False, add_generation_prompt=True, **template_kwargs)
        except Exception as error:  # the template's own complaint (Jinja's raise_exception), in one line
            first = (str(error).splitlines() or [""])[0]
            raise UserError(f"data: {where}: the chat template cannot render this prompt: {type(error).__name__}: "
                            f"{first}") from None

    if tools or any(message.get("tool_calls") or message["role"] == "tool" for message in messages):
        check_rendered(messages, tools, render, row, template_name)
    return render(messages, tools)


def read_prompts(cfg, tokenizer) -> PromptSet:
    from tuneloop.data.chat_templates import resolve_template
    from tuneloop.data.load import SourceRow, read_rows
    from tuneloop.data.tool_calls import row_tools
    from tuneloop.rl_methods import matches_features

    settings = cfg.trl_settings
    ebft = matches_features(cfg)
    template = resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)
    longest = cfg.sequence_len - settings.max_completion_length
    found = PromptSet()
    position = itertools.count()  # (axolotl's dataset_shard_num/idx: every N-th row, counted over all the entries)
    for index, entry in enumerate(cfg.datasets):
        transform = dataset_transform(cfg, entry, index)
        for row in read_rows(entry):
            if cfg.dataset_shard_num and next(position) % cfg.dataset_shard_num != cfg.dataset_shard_idx:
                continue
            values = row.values
            if transform is not None:
                values = transformed(values, row.where, *transform, tokenizer, entry.type)
            if "prompt" not in values:
                raise UserError(f"data: {row.where}: an online RL row needs a `prompt` (a text or a list of "
                                f"messages); this one has {', '.join(sorted(values)) or 'no columns'}: give it one, "
                                "or a `type: module.function` transform that makes one")
            if ebft:
                check_ebft_row(values, row.where)
            prompt = values["prompt"]
            tools = row_tools(SourceRow(values, row.where), entry)
            text = prompt_text(prompt, row.where, tokenizer, template, settings.chat_template_kwargs or {}, tools,
                               cfg.chat_template, values)
            # a chat template writes its own BOS; a text prompt gets the tokenizer's special tokens, as TRL's
            ids = np.asarray(tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"], dtype=np.int32)
            if len(ids) == 0:
                raise UserError(f"data: {row.where}: the prompt is empty")
            if len(ids) > longest:
                found.dropped_too_long += 1
                continue
            found.ids.append(ids)
            found.prompts.append(prompt)
            found.columns.append({key: value for key, value in values.items() if key != "prompt"})
            found.where.append(row.where)
            found.reply_lengths.append(reply_length(values, tokenizer))
    if not found.ids:
        raise UserError(f"data: no prompt fits sequence_len {cfg.sequence_len} with room for "
                        f"max_completion_length {settings.max_completion_length} ({found.dropped_too_long} are longer "
                        f"than {longest} tokens): raise sequence_len or lower trl.max_completion_length")
    return found

