"""`tokenizer_use_mistral_common: true`: the tokenizer and the chat encoding of mistral-common (Mistral's own library).
axolotl's Mistral configs (Magistral, Devstral, Ministral, Mistral-Small, Voxtral) ask for it.

Those models are trained on mistral-common's encoding of a conversation (a `ChatCompletionRequest` turned into
tokens: `[INST]…[/INST]`, `[SYSTEM_PROMPT]`, `[THINK]…[/THINK]` as control tokens), not on a Jinja template's
text, so a chat row here never becomes text: its tokens are mistral-common's own `encode_chat_completion` output,
and the trained tokens are found in them directly.

The run's tokenizer is transformers' `MistralCommonBackend` (transformers' wrapper of a mistral-common tokenizer):
decode, eos/pad ids, `save_pretrained` (it copies tekken.json) and generation work as for any tokenizer, and a
saved folder reloads with it. The rows are encoded by a second mistral-common tokenizer on the same tekken.json in
finetuning mode (the wrapper's test mode refuses a conversation that ends with the assistant's answer).

mistral-common is an optional extra (`pip install tuneloop[mistral]`), imported only here and only when a config
asks for it. Like every module of data/, this one sits under the config and does not import it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tuneloop.data.formats import _messages
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.load import SourceRow
from tuneloop.data.tool_calls import row_tools
from tuneloop.errors import UserError

TEKKEN_FILE = "tekken.json"  # mistral-common's Tekken tokenizer: vocabulary, control tokens, pattern, version
CHAT_TYPES = ("chat_template", "chat_template.default", "sharegpt")  # the dataset types encoded as chats here
MISSING_PACKAGE = ("`tokenizer_use_mistral_common: true` needs the mistral-common package: "
                   "pip install 'tuneloop[mistral]' (or pip install 'mistral-common>=1.13')")


def is_mistral_common(tokenizer) -> bool:
    """transformers' mistral-common tokenizer (known by its class, so that nothing is imported to ask)."""
    return any(cls.__name__ == "MistralCommonBackend" for cls in type(tokenizer).__mro__)


def saved_with_mistral_common(folder) -> bool:
    """A folder a tuneloop run saved with a mistral-common tokenizer: tekken.json and no transformers tokenizer
    files (a hub checkpoint that ships both is read through transformers, as its config asks)."""
    folder = Path(folder).expanduser()
    return (folder / TEKKEN_FILE).is_file() and not (folder / "tokenizer_config.json").is_file()


def load_mistral_common_tokenizer(source: str, key: str, revision: dict | None = None):
    """The run's tokenizer from `source` (a folder with tekken.json, or a hub id), as transformers'
    MistralCommonBackend."""
    try:
        import mistral_common  # noqa: F401  (transformers' class imports without it, and fails later, less clearly)
        from transformers.tokenization_mistral_common import MistralCommonBackend
    except ImportError:
        raise UserError(f"config: {MISSING_PACKAGE}") from None
    folder = Path(source).expanduser()
    if folder.is_dir() and not (folder / TEKKEN_FILE).is_file():
        raise UserError(f"model: `{key}: {source}` holds no {TEKKEN_FILE}, and `tokenizer_use_mistral_common: true` "
                        f"reads the tokenizer from it: point `tokenizer_config` at the folder of the model's "
                        f"{TEKKEN_FILE}, or remove tokenizer_use_mistral_common to use tokenizer.json")
    try:
        tokenizer = MistralCommonBackend.from_pretrained(str(folder) if folder.is_dir() else source,
                                                         **(revision or {}))
    except (OSError, ValueError, AssertionError, KeyError) as error:
        raise UserError(f"model: mistral-common cannot load a tokenizer from `{key}: {source}`: "
                        f"{type(error).__name__}: {error}") from None
    if type(_inner(tokenizer)).__name__ != "Tekkenizer":  # (a hub id may hold tokenizer.model.v3 alone)
        raise UserError(f"model: `{key}: {source}` holds a SentencePiece mistral-common tokenizer; tuneloop reads "
                        f"Tekken ones ({TEKKEN_FILE}): remove tokenizer_use_mistral_common to use the transformers "
                        "tokenizer")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.unk_token_id:
        # padded positions never reach the loss or attention, so any id will do; eos is the convention
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _inner(tokenizer):
    """mistral-common's own tokenizer inside transformers' wrapper (a Tekkenizer, or a SentencePiece one)."""
    return tokenizer.tokenizer.instruct_tokenizer.tokenizer


def tekken_path(tokenizer) -> Path:
    return Path(_inner(tokenizer).file_path)


def fingerprint(tokenizer) -> bytes:
    """What the prepared tokens depend on: the tokenizer file's bytes and the library's version (its encoding
    rules can change between releases)."""
    import mistral_common

    digest = hashlib.sha256(tekken_path(tokenizer).read_bytes())
    digest.update(f"mistral-common {mistral_common.__version__}".encode())
    return digest.hexdigest().encode()


class MistralChats:
    """Chat rows -> (token ids, labels) through mistral-common: the ids are `encode_chat_completion`'s, and the
    trained ids are each assistant message's tokens (its reasoning and tool calls, its content, its end-of-turn
    token `</s>` per `train_on_eos`)."""

    def __init__(self, tokenizer):
        from mistral_common.protocol.instruct.normalize import get_normalizer
        from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.mistral = MistralTokenizer.from_file(str(tekken_path(tokenizer)), mode=ValidationMode.finetuning)
        tekken = self.mistral.instruct_tokenizer.tokenizer
        # the same validation and normalization encode_chat_completion runs: its normalized messages are what
        # each turn's tokens are encoded from
        self.validator = get_validator(tekken.version, mode=ValidationMode.finetuning)
        self.normalizer = get_normalizer(tekken.version, tekken.model_settings_builder)
        self.eos = tekken.eos_id

    def tokens(self, row: SourceRow, entry, train_on_inputs: bool) -> tuple[np.ndarray, np.ndarray]:
        if entry.type not in CHAT_TYPES:  # (config/rules.py refuses these first; a row must never miss it)
            raise UserError(f"config: `tokenizer_use_mistral_common: true` encodes chat rows (type "
                            f"{', '.join(CHAT_TYPES)}), and {entry.path} is `type: {entry.type}`")
        # (tools and calls in OpenAI's form: mistral-common writes [AVAILABLE_TOOLS], [TOOL_CALLS] and [TOOL_RESULTS])
        messages = [_as_openai(message, entry) for message in _messages(row, entry, tool_calls=True)]
        ids, turns = self._encoded(messages, row_tools(row, entry), row)
        labels = np.array(ids, dtype=np.int64) if train_on_inputs else self._labels(ids, turns, entry, row)
        return np.asarray(ids, dtype=np.int64), labels

    def _encoded(self, messages: list[dict], tools: list[dict] | None, row: SourceRow) -> tuple[list[int], list]:
        """mistral-common's tokens of the conversation (and the row's tools), and its normalized messages."""
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.from_openai(messages, tools=tools)
            ids = self.mistral.encode_chat_completion(request).tokens
            turns = self.normalizer.from_chat_completion_request(self.validator.validate_request(request)).messages
        except (MistralCommonException, ValueError, AssertionError, TypeError) as error:  # (pydantic's: ValueError)
            text = " ".join(str(error).split()) or type(error).__name__
            raise UserError(f"data: {row.where}: mistral-common refuses this conversation: {text}") from None
        return ids, turns

    def _labels(self, ids: list[int], turns: list, entry, row: SourceRow) -> np.ndarray:
        """Each assistant message's tokens trained; its closing `</s>` by `train_on_eos`/`train_on_eot`: the
        trained turns' (turn, the default), the last turn's (last) or none."""
        option = entry.train_on_eot or entry.train_on_eos or "turn"
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        spans = self._assistant_spans(ids, turns, row)
        for number, (start, end) in enumerate(spans):
            content_end = end - 1 if ids[end - 1] == self.eos else end
            labels[start:content_end] = ids[start:content_end]
            closing = option == "turn" or (option == "last" and number == len(spans) - 1)
            if content_end < end and closing:
                labels[content_end] = ids[content_end]
        return labels

    def _assistant_spans(self, ids: list[int], turns: list, row: SourceRow) -> list[tuple[int, int]]:
        """Where each assistant message's tokens lie in `ids`. Each is encoded on its own, as encode_instruct
        encodes it, and found after the previous one: it ends with `</s>`, which no other message writes, so the
        first match is the message itself. A message it does not find is an error, never a guess."""
        from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage

        instruct = self.mistral.instruct_tokenizer
        last_user = max((index for index, turn in enumerate(turns) if isinstance(turn, UserMessage)), default=-1)
        spans, cursor = [], 0
        for index, turn in enumerate(turns):
            if not isinstance(turn, AssistantMessage):
                continue
            expected = instruct.encode_assistant_message(turn, is_before_last_user_message=index < last_user)
            if not expected:  # (older versions leave out tool calls before the last user message)
                continue
            start = _find(ids, expected, cursor)
            if start < 0:
                raise UserError(f"data: {row.where}: assistant message {index + 1} is not where mistral-common's "
                                "encoding of the conversation should hold it, so its trained tokens cannot be "
                                "located; please report this row")
            spans.append((start, start + len(expected)))
            cursor = start + len(expected)
        return spans


def _find(ids: list[int], part: list[int], start: int) -> int:
    """The first index at or after `start` where `part` occurs in `ids`, or -1."""
    last = len(ids) - len(part)
    position = start
    while position <= last:
        try:
            position = ids.index(part[0], position, last + 1)
        except ValueError:
            return -1
        if ids[position:position + len(part)] == part:
            return position
        position += 1
    return -1


def _as_openai(message: dict, entry) -> dict:
    """A converted message (formats.convert_messages) in the OpenAI form mistral-common reads: the reasoning,
    under whatever key the dataset names it, is `reasoning_content` (mistral-common writes it as [THINK]…[/THINK]
    on tokenizers that have those tokens, and refuses it on older ones)."""
    thinking_key = entry.template_thinking_key or "reasoning_content"
    converted = {key: value for key, value in message.items() if key != thinking_key}
    if message.get(thinking_key) is not None:
        converted["reasoning_content"] = message[thinking_key]
    return converted
