"""`tokenizer_use_mistral_common: true` (data/mistral_chat.py): the tokenizer is mistral-common's (tekken.json) and
chat rows are mistral-common's own encoding, with exactly the assistant turns trained.

Nothing is downloaded: the tests write a tiny Tekken tokenizer (256 byte tokens, a few merges, Mistral's control
tokens, version v13, which has [THINK]) and a tiny Mistral model sized to it."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_in_process, write_config, write_jsonl

from tuneloop.config import config_from_dict
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.load import SourceRow

# mistral-common's control tokens, in the ranks its tokenizers give them (SpecialTokens)
CONTROL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                  "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
                  "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]
NUM_SPECIAL = 32  # the rest are fillers (<SPECIAL_24>, ...), as in Mistral's files
MERGES = [b"he", b"th", b"the", b" the", b"in", b"an", b"er", b"on", b"re", b" a", b"ou", b"ll", b"is", b" is"]
PATTERN = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the river in Paris?"},
    {"role": "assistant", "content": "The Seine.", "reasoning_content": "Paris lies on the Seine"},
    {"role": "user", "content": "And in London?"},
    {"role": "assistant", "content": "The Thames."},
]


def write_tekken(folder: Path) -> Path:
    """A Tekken tokenizer file as mistral-common reads it: byte-level BPE ranks (base64 bytes), control tokens
    first in the id space, the pre-tokenizing pattern and the version."""
    vocab = [bytes([value]) for value in range(256)] + MERGES
    data = {
        "config": {"pattern": PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": len(vocab) + NUM_SPECIAL,
                   "default_num_special_tokens": NUM_SPECIAL, "version": "v13"},
        "vocab": [{"rank": rank, "token_bytes": base64.b64encode(piece).decode(), "token_str": piece.decode("latin-1")}
                  for rank, piece in enumerate(vocab)],
        "special_tokens": [{"rank": rank, "token_str": text, "is_control": True}
                           for rank, text in enumerate(CONTROL_TOKENS)],
        "version": 1, "type": "Tekken",
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tekken.json").write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    """A tiny MistralForCausalLM (random weights) with the tiny tekken.json beside it."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    folder = write_tekken(tmp_path_factory.mktemp("tiny_mistral"))
    config = MistralConfig(vocab_size=256 + len(MERGES) + NUM_SPECIAL, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=11)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(folder)
    return folder


def mistral_tokenizer(folder: Path):
    """mistral-common's own tokenizer for the file, in finetuning mode (a conversation ends with the answer)."""
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(folder / "tekken.json"), mode=ValidationMode.finetuning)


def own_encoding(folder: Path) -> list[int]:
    """CONVERSATION encoded by mistral-common alone, built from its message classes."""
    from mistral_common.protocol.instruct.chunk import TextChunk, ThinkChunk
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[
        SystemMessage(content="You answer in one line."), UserMessage(content="What is the river in Paris?"),
        AssistantMessage(content=[ThinkChunk(thinking="Paris lies on the Seine"), TextChunk(text="The Seine.")]),
        UserMessage(content="And in London?"), AssistantMessage(content="The Thames.")])
    return mistral_tokenizer(folder).encode_chat_completion(request).tokens


def encoded_row(folder: Path, messages: list[dict], **entry_keys) -> tuple[np.ndarray, np.ndarray]:
    """One chat row through tuneloop's loader and encoder."""
    from tuneloop.data.mistral_chat import MistralChats, load_mistral_common_tokenizer

    cfg = config_from_dict({"base_model": str(folder), "tokenizer_use_mistral_common": True,
                            "datasets": [{"path": "rows.jsonl", "type": "chat_template", **entry_keys}]})
    chats = MistralChats(load_mistral_common_tokenizer(str(folder), "base_model"))
    return chats.tokens(SourceRow({"messages": messages}, "rows.jsonl:1"), cfg.datasets[0], False)


def trained_texts(folder: Path, ids: np.ndarray, labels: np.ndarray) -> list[str]:
    """Each run of trained tokens, decoded with its control tokens."""
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

    trained = labels != IGNORE_INDEX
    assert np.array_equal(labels[trained], ids[trained])  # a trained position is trained on its own token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(int), [0]])))
    decode = mistral_tokenizer(folder).decode
    return [decode(ids[start:end].tolist(), special_token_policy=SpecialTokenPolicy.KEEP)
            for start, end in zip(edges[::2], edges[1::2])]


# ---- the encoding and its mask -------------------------------------------------------------------

def test_ids_are_mistral_commons_and_exactly_the_assistant_turns_are_trained(mistral_dir):
    ids, labels = encoded_row(mistral_dir, CONVERSATION)
    assert ids.tolist() == own_encoding(mistral_dir)
    # each answer (its reasoning in [THINK] blocks first) and its </s>, and nothing else
    assert trained_texts(mistral_dir, ids, labels) == ["[THINK]Paris lies on the Seine[/THINK]The Seine.</s>",
                                                      "The Thames.</s>"]


def test_train_on_eos_picks_which_answers_end_is_trained(mistral_dir):
    ids, labels = encoded_row(mistral_dir, CONVERSATION[1:], train_on_eos="last")
    assert trained_texts(mistral_dir, ids, labels) == ["[THINK]Paris lies on the Seine[/THINK]The Seine.",
                                                      "The Thames.</s>"]
    ids, labels = encoded_row(mistral_dir, CONVERSATION[1:], train_on_eos="none")
    assert trained_texts(mistral_dir, ids, labels) == ["[THINK]Paris lies on the Seine[/THINK]The Seine.",
                                                      "The Thames."]


def test_an_answer_repeated_in_a_question_is_trained_where_the_assistant_says_it(mistral_dir):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"}]
    ids, labels = encoded_row(mistral_dir, messages)
    assert trained_texts(mistral_dir, ids, labels) == ["hello</s>", "hello</s>"]
    first_trained = np.flatnonzero(labels != IGNORE_INDEX)[0]
    assert ids[first_trained - 1] == CONTROL_TOKENS.index("[/INST]")  # the first answer, not the first question


def test_a_tool_calling_row_is_mistral_commons_encoding_with_the_calls_trained(mistral_dir):
    """The row's tools, a call (content null, arguments as JSON text) and its result reach mistral-common: the
    ids are its encoding of the same request, the call and the answer are trained, the tools and the result not."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                               "parameters": {"type": "object", "properties": {"city": {}}}}}]
    call = {"id": "abcdefghi", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny."}]
    from tuneloop.data.mistral_chat import MistralChats, load_mistral_common_tokenizer

    cfg = config_from_dict({"base_model": str(mistral_dir), "tokenizer_use_mistral_common": True,
                            "datasets": [{"path": "rows.jsonl", "type": "chat_template"}]})
    chats = MistralChats(load_mistral_common_tokenizer(str(mistral_dir), "base_model"))
    ids, labels = chats.tokens(SourceRow({"messages": messages, "tools": tools}, "rows.jsonl:1"), cfg.datasets[0],
                               False)
    parsed = [messages[0], {**messages[1], "tool_calls": [{**call, "function": {**call["function"],
                                                                                "arguments": {"city": "Paris"}}}]},
              *messages[2:]]
    request = ChatCompletionRequest.from_openai(parsed, tools=tools)
    assert ids.tolist() == mistral_tokenizer(mistral_dir).encode_chat_completion(request).tokens
    assert trained_texts(mistral_dir, ids, labels) == ['[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>',
                                                      "It is sunny.</s>"]


def test_a_conversation_mistral_common_refuses_names_the_row(mistral_dir):
    from tuneloop.errors import UserError

    with pytest.raises(UserError, match=r"rows.jsonl:1: mistral-common refuses this conversation"):
        encoded_row(mistral_dir, CONVERSATION[:2])  # ends with the user: nothing for the model to answer


# ---- the config ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("keys", "entry_keys", "fragment"), [
    ({"chat_template": "chatml"}, {}, "`chat_template` with `tokenizer_use_mistral_common: true`"),
    ({}, {"chat_template": "chatml"}, "`chat_template` with `tokenizer_use_mistral_common: true`"),
    ({}, {"type": "alpaca"}, "is `type: alpaca`"),
    ({}, {"roles_to_train": ["user", "assistant"]}, "`roles_to_train: ['user', 'assistant']`"),
    ({}, {"train_on_eos": "all"}, "`train_on_eos: all`"),
    ({"special_tokens": {"pad_token": "<pad>"}}, {}, "`special_tokens` with `tokenizer_use_mistral_common: true`"),
    ({"eot_tokens": ["<end_of_turn>"]}, {}, "mistral-common ends an assistant turn with </s> alone"),
])
def test_what_mistral_common_cannot_honour_is_refused(tmp_path, keys, entry_keys, fragment):
    entry = {"path": str(tmp_path / "rows.jsonl"), "type": "chat_template", **entry_keys}
    config = write_config(tmp_path / "c.yml", base_model=str(tmp_path), tokenizer_use_mistral_common=True,
                          datasets=[entry], **keys)
    assert_user_error(run_in_process("check", str(config)), fragment)


def test_without_the_key_a_folder_with_tekken_json_keeps_its_transformers_tokenizer(tmp_path, tiny_tokenizer_dir):
    """mistral-common installed must not change the tokenizer of a run that did not ask for it (transformers picks
    it by itself for a Mistral checkpoint holding tekken.json)."""
    from tuneloop.data.mistral_chat import is_mistral_common
    from tuneloop.model.tokenizer import load_tokenizer

    folder = tmp_path / "both"
    shutil.copytree(tiny_tokenizer_dir, folder)
    write_tekken(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    keys = {"base_model": str(folder), "datasets": [{"path": str(tmp_path / "rows.jsonl"), "type": "chat_template"}]}
    plain = load_tokenizer(config_from_dict(keys), encoder_decoder=False)
    assert not is_mistral_common(plain) and plain.chat_template
    asked = load_tokenizer(config_from_dict({**keys, "tokenizer_use_mistral_common": True}), encoder_decoder=False)
    assert is_mistral_common(asked)


# ---- a run ---------------------------------------------------------------------------------------

def run_config(tmp_path: Path, model_dir: Path, **overrides) -> Path:
    rows = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"Question {number}: what is the river?"},
                      {"role": "assistant", "content": f"The answer is {number}."}]} for number in range(16)])
    keys = {"base_model": str(model_dir), "tokenizer_use_mistral_common": True,
            "datasets": [{"path": str(rows), "type": "chat_template"}],
            "dataset_prepared_path": str(tmp_path / "prepared"), "output_dir": str(tmp_path / "out"),
            "sequence_len": 128, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 2,
            "learning_rate": 1e-3, "save_strategy": "no", "seed": 7, "bf16": False, "dataset_processes": 1}
    return write_config(tmp_path / "config.yml", **{**keys, **overrides})


def test_preprocess_shows_the_trained_answer(tmp_path, mistral_dir):
    result = run_in_process("preprocess", str(run_config(tmp_path, mistral_dir)), "--show", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prepared 16 train" in result.stdout
    shown = result.stdout.split("--- row 0")[1]
    assert "<s>[INST]Question" in shown and "[/INST]⟦The answer is" in shown and ".</s>⟧" in shown


def test_two_steps_train_and_save_a_folder_whose_tokenizer_reloads(tmp_path, mistral_dir):
    from tuneloop.data.mistral_chat import is_mistral_common
    from tuneloop.use.folders import find_model_folder, load_tokenizer_of

    result = run_in_process("train", str(run_config(tmp_path, mistral_dir)))
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "tekken.json").read_bytes() == (mistral_dir / "tekken.json").read_bytes()
    reloaded = load_tokenizer_of(find_model_folder(out, "--model"))
    assert is_mistral_common(reloaded) and reloaded.eos_token_id == 2
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is the river?"}])
    answered = run_in_process("infer", "--model", str(out), "--prompts", str(prompts), "--max-new-tokens", "4")
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert isinstance(json.loads(answered.stdout.splitlines()[-1])["completion"], str)


def test_a_tokenizer_folder_without_tekken_json_is_refused(tmp_path, mistral_dir, tiny_tokenizer_dir):
    config = run_config(tmp_path, mistral_dir, tokenizer_config=str(tiny_tokenizer_dir))
    assert_user_error(run_in_process("preprocess", str(config)), "holds no tekken.json", "tokenizer_config")
