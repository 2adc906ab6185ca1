"""Tool-calling chat rows: rendered byte for byte as the model's own template renders them, the assistant's calls
and answers trained, the tool results and the tools preamble never; a template that cannot write tools refuses
the row rather than drop them.

The templates are the families' own texts as TRL ships them (a test dependency; trl/chat_templates holds the
published templates it recognizes models by): Qwen2.5 (Hermes-style `<tool_call>` JSON), Llama 3.1 (tools in the
first user turn, a call as a JSON object) and GLM-4.5 (`<tool_call>name` with `<arg_key>`/`<arg_value>` pairs)."""

from __future__ import annotations

import copy
from importlib import resources

import pytest
from conftest import assert_user_error, base_config, run_in_process, write_config, write_jsonl
from test_axolotl_keys import prepared, trained_text
from transformers import AutoTokenizer

from tuneloop.cli import marked_text
from tuneloop.errors import UserError

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# as an OpenAI export writes it: content null beside the call, the arguments as JSON text
ROW_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny."},
]

# every family's special tokens, so that a trained run decodes to exactly its text
SPECIALS = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>", "<|python_tag|>",
            "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "[gMASK]", "<sop>", "<|system|>",
            "<|user|>", "<|assistant|>", "<|observation|>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<think>", "</think>"]

# family -> what is trained: the call (and the answer), each with its turn's end marker; never the tools preamble,
# the tool result or a header
TRAINED = {
    "qwen2_5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
               '|It is sunny.<|im_end|>',
    "llama3_1": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>|It is sunny.<|eot_id|>',
    # (GLM writes no end marker: the next turn's role token ends a turn)
    "glm4moe": '\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
               '</tool_call>|\n<think></think>\nIt is sunny.',
}


def family_template(name: str) -> str:
    return resources.files("trl").joinpath(f"chat_templates/{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS}, replace_extra_special_tokens=False)
    return tokenizer


def with_template(tokenizer, name: str):
    family = copy.copy(tokenizer)
    family.chat_template = family_template(name)
    return family


def reference_messages() -> list[dict]:
    """The row as a template takes it: the arguments a mapping (the row's JSON text parsed)."""
    messages = copy.deepcopy(ROW_MESSAGES)
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    return messages


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_a_tool_calling_row_renders_as_the_models_own_template_and_trains_the_calls_and_answers(tmp_path, tokenizer,
                                                                                              family):
    family_tokenizer = with_template(tokenizer, family)
    row = prepared(tmp_path, family_tokenizer, [{"messages": ROW_MESSAGES, "tools": TOOLS}],
                   {"type": "chat_template"}, sequence_len=4096)[0]
    own = family_tokenizer.apply_chat_template(reference_messages(), tools=TOOLS, tokenize=False)
    assert family_tokenizer.decode(row["input_ids"]) == own
    assert '"description": "The weather in a city"' in own and "sunny, 21 C" in own
    assert trained_text(row, family_tokenizer) == TRAINED[family]
    shown = marked_text(row["input_ids"], row["labels"], family_tokenizer)  # what `preprocess --show` prints
    assert "get_weather" in shown and shown.count("It is sunny.") == 1


@pytest.mark.parametrize(("name", "family"), [("qwen_25", "qwen2_5"), ("qwen3", "qwen3_instruct_2507")])
def test_the_named_qwen_templates_write_their_familys_tool_format(tmp_path, tokenizer, name, family):
    """`chat_template: qwen_25` (`qwen3`) renders a tool row as Qwen2.5's (Qwen3-Instruct-2507's) own template
    does: its system turn with the tools, the calls, consecutive results in one user turn; with and without a
    system message. (Qwen3's thinking template differs from tuneloop's qwen3 in reasoning only, where
    chat_template_texts.py says.)"""
    qwen = with_template(tokenizer, family)
    second = {"role": "tool", "tool_call_id": "c2", "content": "wind 10 km/h"}
    references = [*reference_messages()[:-1], second, ROW_MESSAGES[-1]]
    for folder, first in (("with_system", 0), ("without", 1)):
        messages = [*ROW_MESSAGES[first:-1], second, ROW_MESSAGES[-1]]
        row = prepared(tmp_path / folder, tokenizer, [{"messages": messages, "tools": TOOLS}],
                       {"type": "chat_template"}, chat_template=name)[0]
        reference = references[first:]
        assert tokenizer.decode(row["input_ids"]) == qwen.apply_chat_template(reference, tools=TOOLS, tokenize=False)
        assert trained_text(row, tokenizer) == TRAINED["qwen2_5"]


# written for this test in DeepSeek-V3's call format, whose template concatenates the arguments as JSON text (its own
# template renders no tools list, and its generation prompt opens a <think> block no turn starts with); the second
# writes them with `{{ }}`, which prints a mapping as Python's repr
TEXT_ARGUMENTS = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' + m.content }}"
                  "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + '\n```json\n' + "
                  "c.function.arguments + '\n```</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}{% else %}"
                  "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PRINTED_ARGUMENTS = TEXT_ARGUMENTS.replace("' + c.function.arguments + '", "' }}{{ c.function.arguments }}{{ '")


@pytest.mark.parametrize("template", [TEXT_ARGUMENTS, PRINTED_ARGUMENTS], ids=["concatenated", "printed"])
def test_a_template_that_takes_the_arguments_as_text_gets_json_text(tmp_path, tokenizer, template):
    assert template.count("c.function.arguments") == 1
    messages = with_empty_content(ROW_MESSAGES)  # (the templates concatenate the content: "" rather than null)
    row = prepared(tmp_path, tokenizer, [{"messages": messages}], {"type": "chat_template"},
                   chat_template_jinja=template)[0]
    # the row's arguments as it writes them, JSON text
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(messages, chat_template=template,
                                                                               tokenize=False)
    assert trained_text(row, tokenizer) == ('<tool_call>get_weather\n```json\n{"city": "Paris"}\n```</tool_call>'
                                            '<|im_end|>|It is sunny.<|im_end|>')


def test_a_template_that_needs_tools_is_not_taken_for_one_that_drops_them(tmp_path, tokenizer):
    """The tools are checked by rendering without them; a template that refuses that renders them."""
    template = "{% if not tools %}{{ raise_exception('this template needs tools') }}{% endif %}" + family_template(
        "qwen2_5")
    row = prepared(tmp_path, tokenizer, [{"messages": ROW_MESSAGES, "tools": TOOLS}], {"type": "chat_template"},
                   chat_template_jinja=template)[0]
    assert trained_text(row, tokenizer) == TRAINED["qwen2_5"]


def with_empty_content(messages: list[dict]) -> list[dict]:
    """The call's turn as other exports write it: content "" (a plain template renders it as an empty turn)."""
    messages = copy.deepcopy(messages)
    messages[2]["content"] = ""
    return messages


def test_train_on_eos_none_trains_the_call_without_its_turn_end(tmp_path, tokenizer):
    family_tokenizer = with_template(tokenizer, "qwen2_5")
    row = prepared(tmp_path, family_tokenizer, [{"messages": with_empty_content(ROW_MESSAGES), "functions": TOOLS}],
                   {"type": "chat_template", "field_tools": "functions", "train_on_eos": "none"})[0]
    assert family_tokenizer.decode(row["input_ids"]) == family_tokenizer.apply_chat_template(
        with_empty_content(reference_messages()), tools=TOOLS, tokenize=False)
    assert trained_text(row, family_tokenizer) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                                   '"Paris"}}\n</tool_call>|It is sunny.')


def test_a_template_that_cannot_write_tools_refuses_the_row_naming_it(tmp_path, tokenizer):
    """chatml writes role and content only: the tools and the call would vanish, the call's turn trained empty."""
    with pytest.raises(UserError, match=r"rows.jsonl:1: chat template `chatml` does not render the row's `tools`"):
        prepared(tmp_path / "tools", tokenizer, [{"messages": with_empty_content(ROW_MESSAGES), "tools": TOOLS}],
                 {"type": "chat_template"}, chat_template="chatml")
    with pytest.raises(UserError, match=r"rows.jsonl:1: the tokenizer's own chat template does not render the tool "
                                        r"calls of message 3; use a template that writes tools"):
        prepared(tmp_path / "calls", tokenizer, [{"messages": with_empty_content(ROW_MESSAGES)}],
                 {"type": "chat_template"})


def test_tool_calls_where_they_are_not_rendered_refuse_the_row(tmp_path, tokenizer):
    """Preference rows are rendered without tools: a call or tools in one are refused, not dropped."""
    row = {"messages": ROW_MESSAGES[:4], "chosen": "It is sunny.", "rejected": "It rains."}
    with pytest.raises(UserError, match=r"rows.jsonl:1: message 3 carries tool calls, which tuneloop renders in "
                                        r"supervised chat rows"):
        prepared(tmp_path, with_template(tokenizer, "qwen2_5"), [row], {"type": "chat_template"}, rl="dpo")
    row = {"messages": ROW_MESSAGES[:2], "tools": TOOLS, "chosen": "It is sunny.", "rejected": "It rains."}
    with pytest.raises(UserError, match=r"rows.jsonl:1: the row has tools \(field `tools`\), which a preference row "
                                        r"does not render yet"):
        prepared(tmp_path / "tools", with_template(tokenizer, "qwen2_5"), [row], {"type": "chat_template"}, rl="dpo")


def test_preprocess_shows_the_trained_call_and_refuses_a_plain_template_with_exit_2(tmp_path, tiny_model_dir):
    """The command line: `--show` marks the call as trained; a template without tools is one error line, exit 2."""
    data = write_jsonl(tmp_path / "rows.jsonl", [{"messages": ROW_MESSAGES, "tools": TOOLS}])
    keys = base_config(tmp_path, tiny_model_dir, data, sequence_len=1024)
    keys["datasets"] = [{"path": str(data), "type": "chat_template"}]
    shown = run_in_process("preprocess", str(write_config(tmp_path / "own.yml", **keys,
                                                          chat_template_jinja=family_template("qwen2_5"))),
                           "--show", "1")
    assert shown.returncode == 0, shown.stderr
    assert '<|im_start|>assistant\n⟦<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>⟧\n<|im_start|>user\n<tool_response>\nsunny, 21 C' in shown.stdout
    keys["dataset_prepared_path"] = str(tmp_path / "prepared_chatml")
    refused = run_in_process("preprocess", str(write_config(tmp_path / "chatml.yml", **keys, chat_template="chatml")))
    assert_user_error(refused, "rows.jsonl:1: chat template `chatml` does not render the row's `tools`",
                      "chat_template: tokenizer_default")


def test_a_grpo_prompts_tools_are_rendered_into_it_or_the_row_is_refused(tmp_path, tiny_model_dir):
    """Online RL's prompts (online_rl/prompts.py): a row's `tools` reach the policy through the template's tool
    format, as SFT rows do; a template that drops them, or a text prompt, refuses the row instead of asking the
    policy to call tools it was never shown."""
    import json

    from test_grpo import grpo_config

    rows = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": ROW_MESSAGES[1:2], "tools": TOOLS, "word": "sunny"}] * 8)
    config = grpo_config(tmp_path, tiny_model_dir, datasets=[{"path": str(rows)}], sequence_len=1024,
                         chat_template="jinja", chat_template_jinja=family_template("qwen2_5"))
    planned = run_in_process("plan", str(config), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tokenizer.apply_chat_template(ROW_MESSAGES[1:2], tools=TOOLS, chat_template=family_template("qwen2_5"),
                                             tokenize=False, add_generation_prompt=True)
    assert "get_weather" in expected
    assert json.loads(planned.stdout)["train_tokens"] == 8 * len(tokenizer(expected, add_special_tokens=False)[
        "input_ids"])
    plain = grpo_config(tmp_path, tiny_model_dir, name="plain.yml", datasets=[{"path": str(rows)}], sequence_len=1024)
    assert_user_error(run_in_process("plan", str(plain)), "prompts.jsonl:1", "does not render the row's `tools`")
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "Weather in Paris?", "tools": TOOLS, "word": "x"}] * 8)
    as_text = grpo_config(tmp_path, tiny_model_dir, name="text.yml", datasets=[{"path": str(text)}])
    assert_user_error(run_in_process("plan", str(as_text)), "text.jsonl:1", "its prompt is a text")
