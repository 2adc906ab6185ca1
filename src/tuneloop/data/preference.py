"""Preference rows (`rl:`): one source row becomes a pair of sequences, the prompt with the chosen reply and
the prompt with the rejected one, each trained on its reply only.

A format returns the prompt and the two replies as text (`PreferenceText`); `as_pair` turns that into two
`Rendered` rows whose trained span is the reply, so tokenizing and masking are the supervised path's
(prepare.py), and a pair is two consecutive sequences of the token store. The reply of a chat-template
format is what the template writes after the generation prompt, its end-of-turn marker included (axolotl
keeps it the same way: the text after the prompt, right-stripped).

Names follow axolotl's `type:` under `rl:` — `chat_template.default` with field_messages / field_chosen /
field_rejected, `chat_template.argilla` (whole conversations in chosen and rejected), the fixed chatml /
llama3 prompt shapes (`chatml.ultra`, `llama3.prompt_pairs`, ...), and the user-defined mapping
(field_prompt, field_system, field_chosen, field_rejected, prompt_format, chosen_format, rejected_format).
A reward model's pairs (`reward_model: true`, REWARD_FORMATS: axolotl's `bradley_terry.chat_template`) are two
whole conversations, scored whole. A pair longer than sequence_len is dropped and counted, as every pair is here
(axolotl truncates such a sequence instead, which cuts off the end its score is read at).
Like every module of data/, this one sits under the config and does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tuneloop.data.formats import RenderContext, Rendered, _field, convert_messages
from tuneloop.data.load import SourceRow
from tuneloop.data.tool_calls import refuse_row_tools
from tuneloop.errors import UserError
from tuneloop.registry import Registry


@dataclass(frozen=True)
class PreferenceText:
    prompt: str
    chosen: str
    rejected: str
    add_special_tokens: bool = True  # False when a chat template already wrote BOS and friends
    append_eos: bool = False  # the user-defined format ends each reply with EOS (its text has no end marker)


def as_pair(text: PreferenceText) -> tuple[Rendered, Rendered]:
    """(chosen, rejected) rows: the prompt then the reply, the reply trained."""
    def row(reply: str) -> Rendered:
        start = len(text.prompt)
        return Rendered(text.prompt + reply, [(start, start + len(reply))], text.add_special_tokens,
                        text.append_eos)

    return row(text.chosen), row(text.rejected)


# ---- chat templates -----------------------------------------------------------------------------------
def _reply_message(value, row: SourceRow, entry, field: str) -> dict:
    """A reply given as text (the assistant's), as one message, or as a conversation (its last message)."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, list) and value:
        value = value[-1]
    if not isinstance(value, dict):
        raise UserError(f"data: {row.where}: field `{field}` must be the reply's text, a message, or a list of "
                        f"messages ending with the reply; got {type(value).__name__}")
    return convert_messages([value], row, entry)[0]


def _check_has_template(context: RenderContext) -> None:
    if not (context.template or getattr(context.tokenizer, "chat_template", None)):
        raise UserError("config: a chat_template preference dataset needs a chat template, and this tokenizer has "
                        "none: set `chat_template: chatml` (or another name)")


def _template_pair(prompt_messages: list[dict], chosen: dict, rejected: dict, row: SourceRow,
                   context: RenderContext) -> PreferenceText:
    tokenizer, template = context.tokenizer, context.template
    _check_has_template(context)

    def render(messages: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                             add_generation_prompt=generation_prompt)

    prompt = render(prompt_messages, True)
    replies = []
    for reply in (chosen, rejected):
        full = render([*prompt_messages, reply], False)
        if not full.startswith(prompt):
            raise UserError(f"data: {row.where}: the chat template does not write a reply after the generation "
                            "prompt it wrote, so the reply cannot be told from the prompt; use `chat_template: "
                            "chatml`")
        replies.append(full[len(prompt):].rstrip())
    return PreferenceText(prompt, *replies, add_special_tokens=False)


def render_chat_pair(row: SourceRow, entry, context: RenderContext) -> PreferenceText:
    """axolotl's `chat_template.default` under rl: the prompt conversation in `field_messages` (or one user
    message as text), the replies in `field_chosen` / `field_rejected`."""
    prompt = _prompt_messages(row, entry, entry.field_messages or "messages")
    replies = [_reply_message(_required(row, field), row, entry, field)
               for field in (entry.field_chosen or "chosen", entry.field_rejected or "rejected")]
    return _template_pair(prompt, *replies, row, context)


def _prompt_messages(row: SourceRow, entry, name: str) -> list[dict]:
    """The prompt's messages from field `name`: a list of messages, or its text as one user message."""
    raw = row.values.get(name)
    if isinstance(raw, str):
        raw = [{entry.message_field_role: "user", entry.message_field_content: raw}]
    if not isinstance(raw, list) or not raw:
        raise UserError(f"data: {row.where}: field `{name}` must be the prompt's messages (a non-empty list) or "
                        "its text")
    return convert_messages(raw, row, entry)


def _required(row: SourceRow, field: str):
    if row.values.get(field) is None:
        raise UserError(f"data: {row.where}: missing field `{field}` (fields present: "
                        f"{', '.join(sorted(row.values))})")
    return row.values[field]


def render_argilla_pair(row: SourceRow, entry, context: RenderContext) -> PreferenceText:
    """axolotl's `chat_template.argilla`: chosen and rejected are whole conversations sharing their prompt;
    the prompt is the chosen conversation without its last message."""
    conversations = []
    for field in (entry.field_chosen or "chosen", entry.field_rejected or "rejected"):
        value = row.values.get(field)
        if not isinstance(value, list) or len(value) < 2:
            raise UserError(f"data: {row.where}: field `{field}` must be a conversation of at least a prompt and a "
                            "reply (a list of messages)")
        conversations.append(convert_messages(value, row, entry))
    chosen, rejected = conversations
    return _template_pair(chosen[:-1], chosen[-1], rejected[-1], row, context)


# ---- fixed prompt shapes: axolotl's chatml.* and llama3.* ------------------------------------------------
CHATML = ("<|im_start|>system\n{system}<|im_end|>\n", "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
          "<|im_end|>")
LLAMA3 = ("<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>",
          "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
          "\n\n", "<|eot_id|>")


def _reply_text(value, row: SourceRow, field: str, conversation: bool) -> str:
    """A reply as text; `conversation`: the row gives [prompt message, reply message] and the reply is the 2nd."""
    if conversation:
        if not (isinstance(value, list) and len(value) >= 2 and all(isinstance(m, dict) for m in value[:2])
                and "content" in value[1]):
            raise UserError(f"data: {row.where}: field `{field}` must be a conversation [prompt, reply] of messages "
                            "with `content`")
        return str(value[1]["content"])
    return _field(row, field)


def fixed_shape(shape: tuple[str, str, str], prompt_field: str | None, conversation: bool = False) -> Callable:
    """A renderer writing axolotl's fixed prompt around the row's fields. `prompt_field` None: the first of
    prompt, input, question and instruction that the row has (axolotl's `default`), "argilla": the first message
    of the chosen conversation. `conversation`: chosen and rejected are [prompt, reply] message lists."""
    system_format, prompt_format, end = shape

    def render(row: SourceRow, entry, context: RenderContext) -> PreferenceText:
        if prompt_field == "argilla":
            chosen_value = row.values.get("chosen")
            _reply_text(chosen_value, row, "chosen", True)  # checks the shape
            prompt_text = str(chosen_value[0].get("content", "")) if isinstance(chosen_value[0], dict) else ""
        else:
            field = prompt_field or next((name for name in ("prompt", "input", "question", "instruction")
                                          if name in row.values), "prompt")
            prompt_text = _field(row, field)
        system = row.values.get("system")
        prompt = (system_format.format(system=system) if system else "") + prompt_format.format(prompt=prompt_text)
        in_messages = conversation or prompt_field == "argilla"
        names = [name if in_messages or name in row.values else f"{name}_response" for name in ("chosen", "rejected")]
        replies = [_reply_text(row.values.get(name), row, name, in_messages) + end for name in names]
        return PreferenceText(prompt, *replies)

    return render


# ---- the user-defined mapping ---------------------------------------------------------------------------
def render_user_defined(row: SourceRow, fmt) -> PreferenceText:
    """`type: {field_prompt, field_system, field_chosen, field_rejected, prompt_format, chosen_format,
    rejected_format}`; each reply ends with EOS, as TRL appends it."""
    system = row.values.get(fmt.field_system) or ""
    try:
        prompt = fmt.prompt_format.format(prompt=_field(row, fmt.field_prompt), system=system)
        chosen = fmt.chosen_format.format(chosen=_field(row, fmt.field_chosen))
        rejected = fmt.rejected_format.format(rejected=_field(row, fmt.field_rejected))
    except (KeyError, IndexError) as error:
        raise UserError(f"config: the preference format uses the placeholder {error}, which is not one of {{prompt}} "
                        "and {system} (prompt_format), {chosen} (chosen_format) and {rejected} "
                        "(rejected_format)") from None
    return PreferenceText(prompt, chosen, rejected, append_eos=True)


# ---- unpaired rows (rl: kto) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnpairedText:
    """A prompt, one reply, and whether the reply is desirable (KTO's label)."""

    prompt: str
    completion: str
    desirable: bool
    add_special_tokens: bool = True
    append_eos: bool = False


def _label(row: SourceRow, field: str) -> bool:
    value = row.values.get(field)
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise UserError(f"data: {row.where}: field `{field}` must be true or false (is the reply desirable?); got "
                    f"{value!r}")


def render_chat_unpaired(row: SourceRow, entry, context: RenderContext) -> UnpairedText:
    """`chat_template` under `rl: kto`: the prompt's messages (`field_messages`, else `prompt`, or its text),
    the reply in `completion` (text, a message, or a conversation ending with it), and `label`."""
    prompt = _prompt_messages(row, entry, entry.field_messages or ("messages" if "messages" in row.values
                                                                   else "prompt"))
    reply = _reply_message(_required(row, "completion"), row, entry, "completion")
    pair = _template_pair(prompt, reply, reply, row, context)
    return UnpairedText(pair.prompt, pair.chosen, _label(row, "label"), add_special_tokens=False)


def fixed_unpaired(shape: tuple[str, str, str], prompt_field: str | None) -> Callable:
    """axolotl's `chatml.*` / `llama3.*` KTO shapes: the prompt from `prompt_field` ("argilla_chat": the first
    message of a [prompt, reply] `completion` conversation, whose second message is the reply), `completion`
    and `label`."""
    system_format, prompt_format, end = shape

    def render(row: SourceRow, entry, context: RenderContext) -> UnpairedText:
        if prompt_field == "argilla_chat":
            completion = _reply_text(row.values.get("completion"), row, "completion", True)
            prompt_text = str(row.values["completion"][0].get("content", ""))
        else:
            completion, prompt_text = _field(row, "completion"), _field(row, prompt_field)
        system = row.values.get("system")
        prompt = (system_format.format(system=system) if system else "") + prompt_format.format(prompt=prompt_text)
        return UnpairedText(prompt, completion + end, _label(row, "label"))

    return render


def render_user_defined_unpaired(row: SourceRow, fmt) -> UnpairedText:
    """`type: {field_prompt, field_system, field_completion, field_label, prompt_format, completion_format}`."""
    system = row.values.get(fmt.field_system) or ""
    try:
        prompt = fmt.prompt_format.format(prompt=_field(row, fmt.field_prompt), system=system)
        completion = fmt.completion_format.format(completion=_field(row, fmt.field_completion))
    except (KeyError, IndexError) as error:
        raise UserError(f"config: the KTO format uses the placeholder {error}, which is not one of {{prompt}} and "
                        "{system} (prompt_format) and {completion} (completion_format)") from None
    return UnpairedText(prompt, completion, _label(row, fmt.field_label), append_eos=True)


# dataset `type:` under `rl: kto` -> its renderer, (row, dataset entry, RenderContext) -> UnpairedText
UNPAIRED_FORMATS: Registry[Callable] = Registry("KTO dataset type", "type")
UNPAIRED_FORMATS.add("chat_template", render_chat_unpaired, aliases=("chat_template.default",))
for _family, _shape in (("chatml", CHATML), ("llama3", LLAMA3)):
    UNPAIRED_FORMATS.add(f"{_family}.argilla", fixed_unpaired(_shape, "instruction"))
    UNPAIRED_FORMATS.add(f"{_family}.argilla_chat", fixed_unpaired(_shape, "argilla_chat"))
    UNPAIRED_FORMATS.add(f"{_family}.intel", fixed_unpaired(_shape, "question"))
    UNPAIRED_FORMATS.add(f"{_family}.prompt_pairs", fixed_unpaired(_shape, "prompt"))
    UNPAIRED_FORMATS.add(f"{_family}.ultra", fixed_unpaired(_shape, "prompt"))


def render_unpaired(rows: list[SourceRow], entry, context: RenderContext) -> tuple[list[Rendered], list[bool]]:
    """A chunk of KTO rows as (2 rendered sequences per row, each row's label). A row's second sequence is its
    prompt with another row's reply (the next row's in the chunk): what KTO's KL estimate compares, as TRL builds
    it from mismatched prompts and completions."""
    for row in rows:
        refuse_row_tools(row, entry, "a preference row")
    texts = [render_user_defined_unpaired(row, entry.type) if not isinstance(entry.type, str)
             else UNPAIRED_FORMATS[entry.type](row, entry, context) for row in rows]
    rendered = []
    for index, text in enumerate(texts):
        other = texts[(index + 1) % len(texts)]
        for reply in (text.completion, other.completion):
            start = len(text.prompt)
            rendered.append(Rendered(text.prompt + reply, [(start, start + len(reply))], text.add_special_tokens,
                                     text.append_eos))
    return rendered, [text.desirable for text in texts]


# dataset `type:` under `rl:` -> its renderer, (row, dataset entry, RenderContext) -> PreferenceText
PREFERENCE_FORMATS: Registry[Callable] = Registry("preference dataset type", "type")
PREFERENCE_FORMATS.add("chat_template", render_chat_pair, aliases=("chat_template.default",))
PREFERENCE_FORMATS.add("chat_template.argilla", render_argilla_pair, aliases=("chat_template.argilla_chat",))
for _family, _shape in (("chatml", CHATML), ("llama3", LLAMA3)):
    PREFERENCE_FORMATS.add(f"{_family}.default", fixed_shape(_shape, None), aliases=(_family,))
    PREFERENCE_FORMATS.add(f"{_family}.prompt_pairs", fixed_shape(_shape, "prompt"))
    PREFERENCE_FORMATS.add(f"{_family}.icr", fixed_shape(_shape, "input"))
    PREFERENCE_FORMATS.add(f"{_family}.intel", fixed_shape(_shape, "question"))
    PREFERENCE_FORMATS.add(f"{_family}.ultra", fixed_shape(_shape, "prompt", conversation=True))
    PREFERENCE_FORMATS.add(f"{_family}.argilla_chat", fixed_shape(_shape, "argilla"))

# preference types whose messages go through the chat template (the chat dataset keys apply to them)
PREFERENCE_CHAT_TYPES = ("chat_template.argilla", "chat_template.argilla_chat")


# ---- reward models (reward_model: true) ---------------------------------------------------------------------
def _text(row: SourceRow, field: str) -> str:
    value = _required(row, field)
    if not isinstance(value, str):
        raise UserError(f"data: {row.where}: field `{field}` must be text; got {type(value).__name__}")
    return value


def render_bradley_terry(row: SourceRow, entry, context: RenderContext) -> tuple[Rendered, Rendered]:
    """axolotl's `bradley_terry.chat_template`: [system], user = `input`, assistant = `chosen` (`rejected`), each
    conversation written whole by the chat template, as axolotl writes it. A reward model scores the whole
    sequence, so all of it is marked trained (nothing is a prompt to mask)."""
    _check_has_template(context)
    prompt = [{"role": "system", "content": _text(row, "system")}] if row.values.get("system") else []
    prompt.append({"role": "user", "content": _text(row, "input")})

    def conversation(field: str) -> Rendered:
        messages = [*prompt, {"role": "assistant", "content": _text(row, field)}]
        text = context.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=context.template)
        return Rendered(text, [(0, len(text))], add_special_tokens=False, append_eos=False)

    return conversation("chosen"), conversation("rejected")


# dataset `type:` under `reward_model: true` -> (row, dataset entry, RenderContext) -> (chosen, rejected) rows
REWARD_FORMATS: Registry[Callable] = Registry("reward model dataset type", "type")
REWARD_FORMATS.add("bradley_terry.chat_template", render_bradley_terry)


def render_preference(row: SourceRow, entry, context: RenderContext) -> tuple[Rendered, Rendered]:
    refuse_row_tools(row, entry, "a preference row")
    if not isinstance(entry.type, str):
        return as_pair(render_user_defined(row, entry.type))
    if entry.type in REWARD_FORMATS:
        return REWARD_FORMATS[entry.type](row, entry, context)
    return as_pair(PREFERENCE_FORMATS[entry.type](row, entry, context))
