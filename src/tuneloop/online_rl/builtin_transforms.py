"""axolotl's own dataset transforms that its EBFT configs name (`type: ebft_opencode.transform`), built in.

Those configs run as written: each maps a row to structured EBFT's columns, a `prompt` (messages) and its reference
answer `ground_truth`. A name here wins over a module of the same name (axolotl looks in its own strategies first too).

A transform is called as prompts.py calls any: `factory(cfg)` -> (function of (row, tokenizer=None) -> the row's new
columns, {"remove_columns": [...]}).
"""

from __future__ import annotations

import re

from tuneloop.errors import UserError
from tuneloop.registry import Registry

THINKING = re.compile(r"<think>.*?</think>\s*", flags=re.DOTALL)


def _needs(row: dict, keys: tuple[str, ...], name: str) -> None:
    missing = [key for key in keys if key not in row]
    if missing:
        raise UserError(f"`type: {name}` reads the columns {', '.join(keys)}, and a row has no `{missing[0]}` (it has "
                        f"{', '.join(sorted(row)) or 'none'})")


def opencode(cfg):
    """nvidia/OpenCodeInstruct's rows: `input` is the user's message, `output` the reference solution."""
    def transform(row, tokenizer=None):
        _needs(row, ("input", "output"), "ebft_opencode.transform")
        return {"prompt": [{"role": "user", "content": row["input"]}], "ground_truth": row["output"]}
    return transform, {"remove_columns": ["input", "output"]}


def _last_reply(row: dict, name: str) -> tuple[list, str]:
    """(the messages before the conversation's last assistant turn, that turn's content)."""
    messages = row.get("messages", row.get("conversations"))
    if not isinstance(messages, list) or not messages:
        raise UserError(f"`type: {name}` reads a conversation in `messages` (or `conversations`), and a row has "
                        f"{'none' if messages is None else type(messages).__name__}")
    last = max((index for index, message in enumerate(messages) if message.get("role") == "assistant"),
               default=None)
    if last is None:
        return messages[:-1], ""
    return messages[:last], messages[last]["content"]


def reasoning(cfg):
    """Chat rows whose replies hold <think>…</think>: the prompt is the conversation before the last assistant turn,
    the reference answer that turn whole (thinking included)."""
    def transform(row, tokenizer=None):
        prompt, reply = _last_reply(row, "ebft_reasoning.transform")
        return {"prompt": prompt, "ground_truth": reply}
    return transform, {"remove_columns": ["messages", "conversations"]}


def reasoning_answer_only(cfg):
    """As `reasoning`, with the <think>…</think> blocks taken out of the reference answer: the features are matched
    on the final answer alone."""
    def transform(row, tokenizer=None):
        prompt, reply = _last_reply(row, "ebft_reasoning.transform_answer_only")
        return {"prompt": prompt, "ground_truth": THINKING.sub("", reply).strip()}
    return transform, {"remove_columns": ["messages", "conversations"]}


BUILTIN_TRANSFORMS: Registry = Registry("dataset transform", "datasets[].type")
BUILTIN_TRANSFORMS.add("ebft_opencode.transform", opencode)
BUILTIN_TRANSFORMS.add("ebft_reasoning.transform", reasoning)
BUILTIN_TRANSFORMS.add("ebft_reasoning.transform_answer_only", reasoning_answer_only)
