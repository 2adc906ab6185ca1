"""Turn one data row into text plus the character spans the model is trained on.

Masking works on characters, not tokens: a renderer returns the full text and the
`(start, end)` spans that are trained; tokenization (prepare.py) then labels exactly the
tokens that overlap those spans. That keeps each format a few plain lines and makes the
mask independent of how a tokenizer merges characters at a prompt/response boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tuneloop.data.load import SourceRow
from tuneloop.errors import UserError
from tuneloop.registry import Registry

# The config validates a dataset's `type:` against FORMATS, so this module sits under the config and does
# not import it: `entry` is a dataset entry of the config (DatasetConfig), `fmt` a custom format mapping.

# axolotl's alpaca prompt, character for character
ALPACA_SYSTEM_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides "
                            "further context. Write a response that appropriately completes the request.\n\n")
ALPACA_SYSTEM_NO_INPUT = ("Below is an instruction that describes a task. "
                          "Write a response that appropriately completes the request.\n\n")
ALPACA_TURN_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_TURN_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_ROLES = {"system", "user", "assistant", "tool", "function", "ipython", "developer"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}


@dataclass
class Rendered:
    text: str
    trained_spans: list[tuple[int, int]] = field(default_factory=list)
    add_special_tokens: bool = True  # False when a chat template already wrote BOS and friends
    append_eos: bool = True  # instruction and completion rows end with a trained EOS, as in axolotl


def _field(row: SourceRow, name: str, required: bool = True) -> str:
    value = row.values.get(name)
    if value is None:
        if required:
            raise UserError(f"data: {row.where}: missing field `{name}` (fields present: "
                            f"{', '.join(sorted(row.values)) or 'none'})")
        return ""
    return value if isinstance(value, str) else str(value)


def render_alpaca(row: SourceRow, entry, tokenizer, template: str | None) -> Rendered:
    instruction, given_input = _field(row, "instruction"), _field(row, "input", required=False)
    output = _field(row, "output")
    if given_input:
        prompt = ALPACA_SYSTEM_WITH_INPUT + ALPACA_TURN_WITH_INPUT.format(instruction=instruction, input=given_input)
    else:
        prompt = ALPACA_SYSTEM_NO_INPUT + ALPACA_TURN_NO_INPUT.format(instruction=instruction)
    return Rendered(prompt + output, [(len(prompt), len(prompt) + len(output))])


def render_custom(row: SourceRow, fmt) -> Rendered:
    instruction = _field(row, fmt.field_instruction)
    given_input = _field(row, fmt.field_input, required=False)
    output = _field(row, fmt.field_output)
    system = _field(row, fmt.field_system, required=False) or fmt.system_prompt
    try:
        prompt = fmt.system_format.format(system=system) if system else ""
        if given_input:
            prompt += fmt.format.format(instruction=instruction, input=given_input)
        else:
            prompt += fmt.no_input_format.format(instruction=instruction)
    except (KeyError, IndexError) as error:
        raise UserError(f"config: the custom dataset format uses the placeholder {error}, which is not one of "
                        "{system} (system_format), {instruction} and {input} (format, no_input_format)") from None
    return Rendered(prompt + output, [(len(prompt), len(prompt) + len(output))])


def render_completion(row: SourceRow, entry, tokenizer, template: str | None) -> Rendered:
    text = _field(row, entry.field or "text")
    return Rendered(text, [(0, len(text))])


def _messages(row: SourceRow, entry) -> list[dict]:
    sharegpt = entry.type == "sharegpt"
    name = entry.field_messages or ("conversations" if sharegpt or "messages" not in row.values else "messages")
    raw = row.values.get(name)
    if not isinstance(raw, list) or not raw:
        raise UserError(f"data: {row.where}: field `{name}` must be a non-empty list of messages")
    role_key = "from" if sharegpt else entry.message_field_role
    content_key = "value" if sharegpt else entry.message_field_content
    if not sharegpt and isinstance(raw[0], dict) and role_key not in raw[0] and "from" in raw[0]:
        role_key, content_key = "from", "value"  # sharegpt rows under type chat_template, as axolotl accepts
    messages = []
    for number, message in enumerate(raw, start=1):
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise UserError(f"data: {row.where}: message {number} needs `{role_key}` and `{content_key}`")
        role = SHAREGPT_ROLES.get(message[role_key], message[role_key])
        messages.append({"role": role, "content": _content_text(message[content_key], row, number)})
    known = CHAT_ROLES | set(entry.roles_to_train)
    unknown = [m["role"] for m in messages if m["role"] not in known]
    if unknown:  # a misspelt role would silently drop the row (no trained turn) or train the wrong text
        seen = ", ".join(dict.fromkeys(str(m["role"]) for m in messages))
        raise UserError(f"data: {row.where}: role {unknown[0]!r} is not a chat role tuneloop knows (roles in this "
                        f"row: {seen}; known: {', '.join(sorted(known))}). Fix the row, or list the role in "
                        "`roles_to_train` if it is meant to be trained.")
    return messages


def _content_text(content, row: SourceRow, number: int) -> str:
    """A message's text; content given as parts ([{type: text, text: ...}], the OpenAI/HF multimodal form) is
    joined. Other parts (images, audio) cannot be trained by a text model: refused, naming the row."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UserError(f"data: {row.where}: message {number} has a content part of type {kind!r}; "
                                "tuneloop trains text: only parts of type 'text' can be used")
        return "".join(texts)
    if content is None or isinstance(content, dict):
        raise UserError(f"data: {row.where}: message {number} has content {content!r}; expected text")
    return str(content)


def render_chat(row: SourceRow, entry, tokenizer, template: str | None) -> Rendered:
    """Render with the chat template; train the turns whose role is in `roles_to_train`.

    A turn's span is found by rendering the conversation up to that turn: the text of
    `messages[:k]` plus the generation prompt ends where turn k's content starts, and the
    text of `messages[:k+1]` ends where the turn (its end-of-turn token included) ends.
    """
    messages = _messages(row, entry)
    if not (template or getattr(tokenizer, "chat_template", None)):
        raise UserError("config: `type: chat_template` needs a chat template, and this tokenizer has none: "
                        "set `chat_template: chatml` (or `jinja` with `chat_template_jinja`)")

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, chat_template=template,
                                             add_generation_prompt=generation_prompt)

    full = render(len(messages), False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] not in entry.roles_to_train:
            continue
        prompt_text, end_text = render(k, True), render(k + 1, False)
        if not (full.startswith(prompt_text) and full.startswith(end_text)):
            raise UserError(f"data: {row.where}: the chat template does not render conversations as growing "
                            "prefixes, so trained turns cannot be located; use `chat_template: chatml`")
        # the newline after an end-of-turn token is not the model's to predict
        spans.append((len(prompt_text), len(end_text.rstrip())))
    return Rendered(full, spans, add_special_tokens=False, append_eos=False)


# dataset `type:` -> its renderer, (row, dataset entry, tokenizer, chat template) -> Rendered
FORMATS: Registry[Callable] = Registry("dataset type", "type")
FORMATS.add("alpaca", render_alpaca)  # instruction / input / output in axolotl's Alpaca prompt
FORMATS.add("completion", render_completion)  # one text field, all of it trained
FORMATS.add("chat_template", render_chat)  # a list of messages through the chat template
FORMATS.add("sharegpt", render_chat)  # `conversations` of from/value through the chat template


def render_row(row: SourceRow, entry, tokenizer, template: str | None) -> Rendered:
    if not isinstance(entry.type, str):  # a mapping: axolotl's user-defined format
        return render_custom(row, entry.type)
    return FORMATS[entry.type](row, entry, tokenizer, template)


def chat_template_of(cfg, tokenizer) -> str | None:
    """The chat template the config asks for: a named one, the config's own jinja, or the tokenizer's."""
    if cfg.chat_template == "chatml":
        return CHATML_TEMPLATE
    if cfg.chat_template == "jinja":
        return cfg.chat_template_jinja
    return tokenizer.chat_template
