"""Tool-calling chat rows read into the form chat templates take, and the check that a template wrote them.

A row's `tools` are JSON-schema function definitions, an assistant message's `tool_calls` its calls, and a
`tool` message a call's result. A template is handed the tools as `apply_chat_template(..., tools=...)` and the
calls as each message's `tool_calls` in OpenAI's shape, `[{"type": "function", "function": {"name",
"arguments"}}]`, with the arguments a mapping: most templates write them with `tojson`, so a row's JSON-text
arguments are parsed first (as axolotl does; a template that wants text gets text back). A template that
ignores the tools or a call (one written for plain turns, such as most named templates) would train an empty
or partial assistant turn: such a row is refused, naming the template, never rendered without them.
"""

from __future__ import annotations

import json
from typing import Callable

from tuneloop.data.load import SourceRow
from tuneloop.errors import UserError

# what a tool message may carry besides role and content (OpenAI's, and the older `name` of a function result)
TOOL_MESSAGE_KEYS = ("tool_call_id", "name")


def row_tools(row: SourceRow, entry) -> list[dict] | None:
    """The row's tools from `field_tools` (default `tools`): a list of definitions, or that list as JSON text.
    None when the row has none."""
    name = getattr(entry, "field_tools", None) or "tools"
    tools = row.values.get(name)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise UserError(f"data: {row.where}: field `{name}` is text that is not JSON; it must be a list of "
                            "tool definitions") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise UserError(f"data: {row.where}: field `{name}` must be a list of tool definitions (JSON schemas, "
                        f"{{\"type\": \"function\", \"function\": {{...}}}}); got {type(tools).__name__}")
    return tools


def tool_calls_of(calls, row: SourceRow, number: int) -> list[dict]:
    """A message's `tool_calls` in OpenAI's shape, each call's arguments a mapping."""
    if not isinstance(calls, list):
        raise UserError(f"data: {row.where}: message {number} has `tool_calls` that is not a list")
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UserError(f"data: {row.where}: message {number} has a tool call without `function.name`; "
                            "expected {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise UserError(f"data: {row.where}: message {number} calls {function['name']!r} with arguments "
                                "that are not JSON") from None
        converted.append({**call, "type": call.get("type", "function"), "function": {**function,
                                                                                    "arguments": arguments}})
    return converted


def arguments_for_template(messages: list[dict], render: Callable) -> list[dict]:
    """Templates disagree on a call's arguments: most write a mapping with `tojson` (transformers' convention,
    and axolotl parses JSON text into one), some concatenate JSON text (DeepSeek-V3's). The mapping is tried
    first; a template that fails on it (a TypeError) or writes it as Python's repr of a dict gets the arguments
    as JSON text instead. `render(messages)` is the template's text, its errors unhandled."""
    from jinja2.exceptions import TemplateError

    mappings = [call["function"]["arguments"] for message in messages for call in message.get("tool_calls", ())
                if isinstance(call["function"]["arguments"], dict) and call["function"]["arguments"]]
    if not mappings:
        return messages
    try:
        if not any(repr(arguments) in render(messages) for arguments in mappings):
            return messages
    except TypeError:
        pass
    except TemplateError:
        return messages  # (refused for another reason: the caller's rendering says why)

    def as_text(call: dict) -> dict:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {**call, "function": {**call["function"], "arguments": arguments}}

    return [{**message, "tool_calls": [as_text(call) for call in message["tool_calls"]]}
            if message.get("tool_calls") else message for message in messages]


def describe_template(name: str | None) -> str:
    """A template as the config names it, for an error."""
    if name is None or name == "tokenizer_default":
        return "the tokenizer's own chat template"
    if name == "jinja":
        return "the chat template in `chat_template_jinja`"
    return f"chat template `{name}`"


def check_rendered(messages: list[dict], tools: list[dict] | None, render: Callable, row: SourceRow,
                   template_name: str | None) -> None:
    """Refuse the row when the template leaves out its tools, a tool call or a tool result. `render(messages,
    tools)` renders a conversation; a part the template writes changes the text, so a render without it
    that comes out the same means the template dropped it."""
    def refuse(what: str) -> UserError:
        return UserError(f"data: {row.where}: {describe_template(template_name)} does not render {what}; use a "
                         "template that writes tools (the model's own, `chat_template: tokenizer_default`, where it "
                         "does, or `chat_template: jinja` with one in `chat_template_jinja`), or remove the tools "
                         "from the row")

    if tools and render(messages, tools) == _without_tools(messages, render):
        raise refuse("the row's `tools`")
    for k, message in enumerate(messages):
        if message.get("tool_calls"):
            with_calls = render(messages[:k + 1], tools)
            plain = {key: value for key, value in message.items() if key != "tool_calls"}
            turn = with_calls[len(render(messages[:k], tools)) if k else 0:]
            missing = [call["function"]["name"] for call in message["tool_calls"]
                       if call["function"]["name"] not in turn]
            if with_calls == render([*messages[:k], plain], tools) or missing:
                raise refuse(f"the tool calls of message {k + 1}")
        elif message["role"] == "tool":
            with_result = render(messages[:k + 1], tools)
            if with_result == (render(messages[:k], tools) if k else ""):
                raise refuse(f"the tool result in message {k + 1}")


def _without_tools(messages: list[dict], render: Callable) -> str | None:
    """The conversation rendered with no tools; None where the template refuses that (it needs them)."""
    try:
        return render(messages, None)
    except UserError:
        return None


def refuse_row_tools(row: SourceRow, entry, rendered_as: str) -> None:
    """For rows a path renders without tools (preference pairs, mistral-common's encoding): a row that has
    them is refused, not trained as if the model had been shown no tools."""
    if row_tools(row, entry):
        raise UserError(f"data: {row.where}: the row has tools (field `{getattr(entry, 'field_tools', None) or 'tools'}"
                        f"`), which {rendered_as} does not render yet; tuneloop renders tools in supervised chat rows "
                        "(type chat_template) through a Jinja chat template. Remove them from the row")
