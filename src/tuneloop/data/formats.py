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
from tuneloop.data.tool_calls import (TOOL_MESSAGE_KEYS, arguments_for_template, check_rendered, row_tools,
                                      tool_calls_of)
from tuneloop.errors import UserError
from tuneloop.registry import Registry

# The config validates a dataset's `type:` against FORMATS, so this module sits under the config and does
# not import it: `entry` is a dataset entry of the config (DatasetConfig), `fmt` a custom format mapping.

# axolotl's Alpaca prompts (commit 067b021, prompters.py), character for character: the system line, then the turn
# (with or without an input), in each of its prompt styles (`type: alpaca:chat` is style "chat"); the response
# follows the prompt, trained
ALPACA_SYSTEM_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides "
                            "further context. Write a response that appropriately completes the request.")
ALPACA_SYSTEM_NO_INPUT = ("Below is an instruction that describes a task. "
                          "Write a response that appropriately completes the request.")


@dataclass(frozen=True)
class AlpacaStyle:
    system: str  # around the system line: {system}
    turn: str  # {instruction} and {input}
    turn_no_input: str  # {instruction}


ALPACA_STYLES = {
    "instruct": AlpacaStyle("{system}\n\n", "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                            "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": AlpacaStyle("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
    "chatml": AlpacaStyle("<|im_start|>system\n{system}<|im_end|>\n",
                          "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
                          "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    # (axolotl's phi style writes the input straight after `<|end|>`, and no newlines around the assistant tag)
    "phi": AlpacaStyle("<|system|>\n{system}<|end|>\n", "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
                       "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}


def alpaca_prompt(style: str, instruction: str, given_input: str) -> str:
    form = ALPACA_STYLES[style]
    if given_input:
        return (form.system.format(system=ALPACA_SYSTEM_WITH_INPUT)
                + form.turn.format(instruction=instruction, input=given_input))
    return form.system.format(system=ALPACA_SYSTEM_NO_INPUT) + form.turn_no_input.format(instruction=instruction)


CHAT_ROLES = {"system", "user", "assistant", "tool", "function", "ipython", "developer"}
# axolotl's default mapping of dataset roles to template roles (sharegpt's human/gpt included)
DEFAULT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "system": "system", "tool": "tool"}
TURN_END_OPTIONS = ("turn", "all", "last", "none")  # train_on_eos / train_on_eot


@dataclass(frozen=True)
class RenderContext:
    """What a renderer needs beyond the row and its dataset entry."""

    tokenizer: object
    template: str | None = None  # the chat template text, for chat rows
    eot_tokens: tuple[str, ...] = ()  # axolotl's `eot_tokens`: the text that ends a turn
    image_placeholder: str | None = None  # a vision-language model's text for an image part (data/images.py)
    template_name: str | None = None  # the config's `chat_template` value, to name the template in an error


@dataclass
class Rendered:
    text: str
    trained_spans: list[tuple[int, int]] = field(default_factory=list)
    add_special_tokens: bool = True  # False when a chat template already wrote BOS and friends
    append_eos: bool = True  # instruction and completion rows end with a trained EOS, as in axolotl
    images: list = field(default_factory=list)  # a chat row's image parts, in the order the text holds them


def _field(row: SourceRow, name: str, required: bool = True) -> str:
    value = row.values.get(name)
    if value is None:
        if required:
            raise UserError(f"data: {row.where}: missing field `{name}` (fields present: "
                            f"{', '.join(sorted(row.values)) or 'none'})")
        return ""
    return value if isinstance(value, str) else str(value)


def alpaca_fields(row: SourceRow) -> tuple[str, str, str]:
    """(instruction, input, response) of an Alpaca row."""
    return _field(row, "instruction"), _field(row, "input", required=False), _field(row, "output")


def jeopardy_fields(row: SourceRow) -> tuple[str, str, str]:
    """axolotl's `jeopardy` rows: the clue is the instruction, its category the input, and the response answers in
    the game's form ("what is …"). (axolotl's JeopardyPrompter declares a prompt of its own that nothing reads: the
    rows get the Alpaca prompt.)"""
    return _field(row, "question"), _field(row, "category"), "what is " + _field(row, "answer")


def alpaca_renderer(fields: Callable[[SourceRow], tuple[str, str, str]], style: str) -> Callable:
    """A renderer of instruction rows in one of axolotl's Alpaca prompt styles: the prompt, then the trained
    response."""
    def render(row: SourceRow, entry, context: RenderContext) -> Rendered:
        instruction, given_input, output = fields(row)
        prompt = alpaca_prompt(style, instruction, given_input)
        return Rendered(prompt + output, [(len(prompt), len(prompt) + len(output))])
    return render


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


def render_seq2seq(row: SourceRow, entry, context: RenderContext) -> Rendered:
    """A plain pair: `field_source` (default `source`) is the prompt, `field_target` (default `target`) the trained
    text. An encoder-decoder reads them as its encoder's input and its decoder's target; a causal model reads
    the source followed by the target, the target trained."""
    source, target = _field(row, entry.field_source or "source"), _field(row, entry.field_target or "target")
    return Rendered(source + target, [(len(source), len(source) + len(target))])


def render_completion(row: SourceRow, entry, context: RenderContext) -> Rendered:
    text = _field(row, entry.field or "text")
    return Rendered(text, [(0, len(text))])


def _messages(row: SourceRow, entry, context: RenderContext | None = None, images: list | None = None,
              tool_calls: bool = False) -> list[dict]:
    """The row's conversation as template messages: dataset keys mapped (message_property_mappings, or
    message_field_role/content; sharegpt's from/value found by itself), roles mapped (`roles`, else
    human/gpt -> user/assistant), a first system message dropped on request; assistant `tool_calls` kept where
    the caller renders them (`tool_calls`), refused otherwise."""
    sharegpt = entry.type == "sharegpt"
    name = entry.field_messages or ("conversations" if sharegpt or "messages" not in row.values else "messages")
    raw = row.values.get(name)
    if not isinstance(raw, list) or not raw:
        raise UserError(f"data: {row.where}: field `{name}` must be a non-empty list of messages")
    placeholder = context.image_placeholder if context is not None else None
    return convert_messages(raw, row, entry, sharegpt, placeholder, images, tool_calls)


def convert_messages(raw: list, row: SourceRow, entry, sharegpt: bool = False, image_placeholder: str | None = None,
                     images: list | None = None, tool_calls: bool = False) -> list[dict]:
    """Messages as the row writes them -> template messages (the mapping rules of `_messages`); with an
    `image_placeholder` (a vision-language model), image parts become that text and are appended to `images`.
    With `tool_calls`, an assistant message's calls are kept (its content may then be null or absent) and a tool
    message keeps `tool_call_id` and `name`; without, a message with calls is refused: the caller's rendering
    would drop them."""
    mapping = {"role": entry.message_field_role, "content": entry.message_field_content,
               **(entry.message_property_mappings or {})}
    if sharegpt or (not entry.message_property_mappings and isinstance(raw[0], dict)
                    and mapping["role"] not in raw[0] and "from" in raw[0]):
        mapping.update(role="from", content="value")  # sharegpt rows under type chat_template, as axolotl accepts
    thinking_key = entry.template_thinking_key or "reasoning_content"
    mapping.setdefault(thinking_key, entry.field_thinking or thinking_key)
    roles = ({name: role for role, names in entry.roles.items() for name in names} if entry.roles
             else DEFAULT_ROLES)
    messages = []
    for number, message in enumerate(raw, start=1):
        calls = (message.get(mapping.get("tool_calls", "tool_calls")) or None) if isinstance(message, dict) else None
        if not isinstance(message, dict) or mapping["role"] not in message or (mapping["content"] not in message
                                                                               and not calls):
            raise UserError(f"data: {row.where}: message {number} needs `{mapping['role']}` and "
                            f"`{mapping['content']}`")
        converted = {key: message[source] for key, source in mapping.items()
                     if key not in ("role", "content", "tool_calls") and message.get(source) is not None}
        role = roles.get(message[mapping["role"]], message[mapping["role"]])
        content = message.get(mapping["content"])
        if calls:
            if not tool_calls:
                raise UserError(f"data: {row.where}: message {number} carries tool calls, which tuneloop renders "
                                "in supervised chat rows (type chat_template, through a Jinja chat template) only; "
                                "remove them from this row rather than train it without them")
            converted["tool_calls"] = tool_calls_of(calls, row, number)
            content = "" if content is None else content  # (OpenAI writes null beside the calls)
        if role == "tool":
            converted.update({key: message[key] for key in TOOL_MESSAGE_KEYS if message.get(key) is not None})
        converted.update(role=role, content=_content_text(content, row, number, image_placeholder, images))
        messages.append(converted)
    if entry.drop_system_message and messages[0]["role"] == "system":
        messages = messages[1:]
    known = CHAT_ROLES | set(entry.roles_to_train) | set(entry.roles or {})
    unknown = [m["role"] for m in messages if m["role"] not in known]
    if unknown:  # a misspelt role would silently drop the row (no trained turn) or train the wrong text
        seen = ", ".join(dict.fromkeys(str(m["role"]) for m in messages))
        raise UserError(f"data: {row.where}: role {unknown[0]!r} is not a chat role tuneloop knows (roles in this "
                        f"row: {seen}; known: {', '.join(sorted(known))}). Fix the row, or list the role in "
                        "`roles_to_train` if it is meant to be trained.")
    return messages


def _content_text(content, row: SourceRow, number: int, image_placeholder: str | None = None,
                  images: list | None = None) -> str:
    """A message's text; content given as parts ([{type: text, text: ...}], the OpenAI/HF multimodal form) is
    joined. An image part is the model's placeholder text for a vision-language model (the part kept in
    `images`); other parts (images for a text model, audio, video) are refused, naming the row."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif image_placeholder is not None and isinstance(part, dict) and part.get("type") == "image":
                texts.append(image_placeholder)
                images.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                can = "'text' and 'image'" if image_placeholder is not None else "'text' (this is a text-only model)"
                # (Gemma 4's and Gemma 3n's audio towers, video frames: tuneloop trains the image side alone)
                beyond = (f"; {kind} asks for multimodal models beyond images, which tuneloop does not do yet"
                          if kind in ("audio", "input_audio", "video") else "")
                raise UserError(f"data: {row.where}: message {number} has a content part of type {kind!r}; this "
                                f"model takes parts of type {can}{beyond}")
        return "".join(texts)
    if content is None or isinstance(content, dict):
        raise UserError(f"data: {row.where}: message {number} has content {content!r}; expected text")
    return str(content)


def render_chat(row: SourceRow, entry, context: RenderContext) -> Rendered:
    """Render with the chat template; train the turns whose role is in `roles_to_train`.

    A turn's span is found by rendering the conversation up to that turn: the text of `messages[:k]` plus the
    generation prompt ends where turn k starts, and the text of `messages[:k+1]` ends where it ends. Inside it,
    the message's content (reasoning before it included) is followed by the turn's end marker: the first of
    `eot_tokens`, or without them whatever the template writes after the content (`<|im_end|>`, `<|eot_id|>`,
    ...; the newline after it is not the model's to predict). `train_on_eos`/`train_on_eot` say whose end
    markers are trained: the trained turns' (`turn`, the default), every turn's (`all`), the last turn's
    (`last`) or none (`none`).

    A tool-calling row (tools, assistant `tool_calls`, `tool` results: data/tool_calls.py) is rendered with the
    template's own tool format; an assistant turn with calls trains everything from its generation prompt to
    its end marker (its content and its calls), and tool results are another role's turns, trained only when
    `roles_to_train` names `tool`. A template that leaves out the tools or a call refuses the row.
    """
    images = []
    messages = _messages(row, entry, context, images, tool_calls=True)
    tools = row_tools(row, entry)
    tokenizer, template = context.tokenizer, context.template
    if not (template or getattr(tokenizer, "chat_template", None)):
        raise UserError("config: `type: chat_template` needs a chat template, and this tokenizer has none: "
                        "set `chat_template: chatml` (or another name, or `jinja` with `chat_template_jinja`)")

    def render(upto: int, generation_prompt: bool) -> str:
        return _apply_template(tokenizer, messages[:upto], template, generation_prompt, row, tools)

    def render_some(some: list[dict], given_tools: list[dict] | None) -> str:
        return _apply_template(tokenizer, some, template, False, row, given_tools) if some else ""

    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = arguments_for_template(messages, lambda some: tokenizer.apply_chat_template(
            some, tools=tools, tokenize=False, chat_template=template))
        check_rendered(messages, tools, render_some, row, context.template_name)
    full = render(len(messages), False)
    option = entry.train_on_eot or entry.train_on_eos or "turn"
    spans, markers = [], []
    for k, message in enumerate(messages):
        trained = message["role"] in entry.roles_to_train
        if not trained and option not in ("all", "last"):
            continue
        before = render(k, False) if k else ""  # (transformers refuses to render an empty conversation)
        end_text = render(k + 1, False)
        # an assistant turn starts where the generation prompt ends (reasoning before the content is trained
        # with it); another role's turn starts at its content (its header is the template's, not the model's)
        assistant = k > 0 and message["role"] == "assistant"
        header_end = len(render(k, True)) if assistant else len(before)
        if not (full.startswith(before) and full.startswith(end_text)
                and (not assistant or full.startswith(render(k, True)))):
            raise UserError(f"data: {row.where}: the chat template does not render conversations as growing "
                            "prefixes, so trained turns cannot be located; use `chat_template: chatml`")
        end = len(end_text.rstrip())
        if assistant and message.get("tool_calls"):
            content = (header_end, _tool_turn_content_end(messages, k, end_text, header_end, end, tokenizer,
                                                          template, tools, context.eot_tokens, row))
        else:
            content = _content_span(messages, k, end_text, header_end, tokenizer, template, row, tools)
        if content is None:  # the template rewrote the content: train the whole turn, end marker included
            if trained:
                spans.append((header_end, end))
            continue
        content_start, content_end = content
        if trained:
            spans.append((header_end if assistant else content_start, content_end))
        marker = _end_marker(end_text, content_end, end, context.eot_tokens, row, k)
        if marker:
            markers.append((marker, trained))
    if option == "turn":
        spans += [marker for marker, trained in markers if trained]
    elif option == "all":
        spans += [marker for marker, _ in markers]
    elif option == "last" and markers:
        spans.append(markers[-1][0])
    return Rendered(full, spans, add_special_tokens=False, append_eos=False, images=images)


CONTENT_MARK = "\u27e6tuneloop-content\u27e7"  # stands in for a message's content to find where the template puts it


def _apply_template(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool,
                    row: SourceRow, tools: list[dict] | None = None) -> str:
    """The conversation rendered by the template; a template that refuses it (`raise_exception`: a role it does
    not write, roles that do not alternate) is the row's error, not a traceback."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=template,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as error:
        raise UserError(f"data: {row.where}: the chat template refuses this conversation: {error}") from None
    except TypeError as error:  # the template's own expression fails on the row's values (text + a mapping)
        raise UserError(f"data: {row.where}: the chat template fails on this conversation ({error}); is the "
                        "row in the form the template expects?") from None


def _content_span(messages: list[dict], k: int, end_text: str, header_end: int, tokenizer,
                  template: str | None, row: SourceRow, tools: list[dict] | None = None) -> tuple[int, int] | None:
    """Where message k's content sits in `end_text` (the conversation rendered through turn k): rendered once
    more with a mark in place of the content, the text around the mark is what the template adds, so the
    content is what lies between (a template that trims it included). Searching for the content itself would
    find an earlier copy of it (in the reasoning, or the role's header). None when the template transforms
    the content beyond that."""
    marked = [*messages[:k], {**messages[k], "content": CONTENT_MARK}]
    text = _apply_template(tokenizer, marked, template, False, row, tools)
    if text.count(CONTENT_MARK) != 1:
        return None
    head, tail = text.split(CONTENT_MARK)
    start, end = len(head), len(end_text) - len(tail)
    if not (end_text.startswith(head) and end_text.endswith(tail) and header_end <= start <= end):
        return None
    return start, end


def _tool_turn_content_end(messages: list[dict], k: int, end_text: str, header_end: int, turn_end: int, tokenizer,
                           template: str | None, tools: list[dict] | None, eot_tokens: tuple[str, ...],
                           row: SourceRow) -> int:
    """Where the model's words end in an assistant turn with tool calls (its content and its calls, in the
    template's tool format), so the end marker after them goes by `train_on_eos`. The calls are not content, so
    the content mark cannot find them; the marker is what the template writes after a plain assistant turn in
    the same place (or the first of `eot_tokens`). A turn that does not end with it is trained whole."""
    if eot_tokens:
        found = [at for at in (end_text.find(token, header_end, turn_end + len(token)) for token in eot_tokens)
                 if at >= 0]
        return min(found, default=turn_end)
    probe = [*messages[:k], {"role": "assistant", "content": CONTENT_MARK}]
    text = _apply_template(tokenizer, probe, template, False, row, tools)
    if text.count(CONTENT_MARK) != 1:
        return turn_end
    marker = text.split(CONTENT_MARK)[1].rstrip()
    if marker and end_text[header_end:turn_end].endswith(marker):
        return turn_end - len(marker)
    return turn_end


def _end_marker(text: str, content_end: int, turn_end: int, eot_tokens: tuple[str, ...], row: SourceRow,
                turn: int) -> tuple[int, int] | None:
    """The characters that end a turn, after its content."""
    if not eot_tokens:
        return (content_end, turn_end) if turn_end > content_end else None
    found = [(text.find(token, content_end, turn_end + len(token)), token) for token in eot_tokens]
    found = [(at, token) for at, token in found if at >= 0]
    if not found:
        raise UserError(f"data: {row.where}: turn {turn + 1} does not end with any of eot_tokens "
                        f"{list(eot_tokens)} (the template writes {text[content_end:turn_end]!r} after it); set "
                        "eot_tokens to the template's end-of-turn text")
    at, token = min(found)
    return at, at + len(token)


# dataset `type:` -> its renderer, (row, dataset entry, RenderContext) -> Rendered
FORMATS: Registry[Callable] = Registry("dataset type", "type")
# instruction / input / output in axolotl's Alpaca prompt, and its jeopardy rows, in each prompt style (`:chat` is
# USER:/ASSISTANT: turns, `:chatml` and `:phi` those families' tags)
FORMATS.add("alpaca", alpaca_renderer(alpaca_fields, "instruct"), aliases=("alpaca:instruct",))
FORMATS.add("alpaca:chat", alpaca_renderer(alpaca_fields, "chat"), aliases=("alpaca_chat",))
FORMATS.add("alpaca:chatml", alpaca_renderer(alpaca_fields, "chatml"))
FORMATS.add("alpaca:phi", alpaca_renderer(alpaca_fields, "phi"))
FORMATS.add("jeopardy", alpaca_renderer(jeopardy_fields, "instruct"), aliases=("jeopardy:instruct",))
for _style in ("chat", "chatml", "phi"):
    FORMATS.add(f"jeopardy:{_style}", alpaca_renderer(jeopardy_fields, _style))
FORMATS.add("completion", render_completion)  # one text field, all of it trained
FORMATS.add("seq2seq", render_seq2seq)  # a source and a target field: the encoder's input, the decoder's target
FORMATS.add("chat_template", render_chat, aliases=("chat_template.default",))  # messages through the template
FORMATS.add("sharegpt", render_chat)  # `conversations` of from/value through the chat template


def render_row(row: SourceRow, entry, context: RenderContext) -> Rendered:
    """(A dataset without `type` holds tokens, not text: prepare.py reads it as it is.)"""
    if not isinstance(entry.type, str):  # a mapping: axolotl's user-defined format
        return render_custom(row, entry.type)
    return FORMATS[entry.type](row, entry, context)
