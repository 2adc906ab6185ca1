"""Every chat template axolotl names renders its family's text and trains exactly the assistant turns.

The texts below are what each family's published template writes for one conversation (checked against axolotl's
copies of them, commit 067b021), with the tokenizer's bos and eos both `<|endoftext|>` (the tiny tokenizer's);
where tuneloop writes otherwise (chat_template_texts.py says where, and why) the text is tuneloop's. The trained
spans are the assistant contents with the turn's end marker, runs joined by `|`."""

from __future__ import annotations

import pytest
from test_axolotl_keys import CONVERSATION, prepared, trained_text
from transformers import AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.chat_templates import CHAT_TEMPLATES
from tuneloop.errors import UserError

# name -> (rendered text, or (its start, its end) for Command A's 2.4k-character preamble; the trained text)
FAMILY_TEXT = {
    'chatml': ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n'
        'Hello there<|im_end|>\n<|im_start|>assistant\nHi, how are you?<|im_end|>\n'
        '<|im_start|>user\nFine. Count.<|im_end|>\n<|im_start|>assistant\n'
        'one two three<|im_end|>\n',
        'Hi, how are you?<|im_end|>|one two three<|im_end|>'),
    'qwen_25': ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n'
        'Hello there<|im_end|>\n<|im_start|>assistant\nHi, how are you?<|im_end|>\n'
        '<|im_start|>user\nFine. Count.<|im_end|>\n<|im_start|>assistant\n'
        'one two three<|im_end|>\n',
        'Hi, how are you?<|im_end|>|one two three<|im_end|>'),
    'qwen2_vl': ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n'
        'Hello there<|im_end|>\n<|im_start|>assistant\nHi, how are you?<|im_end|>\n'
        '<|im_start|>user\nFine. Count.<|im_end|>\n<|im_start|>assistant\n'
        'one two three<|im_end|>\n',
        'Hi, how are you?<|im_end|>|one two three<|im_end|>'),
    'qwen3': ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n'
        'Hello there<|im_end|>\n<|im_start|>assistant\nHi, how are you?<|im_end|>\n'
        '<|im_start|>user\nFine. Count.<|im_end|>\n<|im_start|>assistant\n'
        'one two three<|im_end|>\n',
        'Hi, how are you?<|im_end|>|one two three<|im_end|>'),
    'qwen3_5': ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n'
        'Hello there<|im_end|>\n<|im_start|>assistant\n<think>\n\n'
        '</think>\n\nHi, how are you?<|im_end|>\n<|im_start|>user\n'
        'Fine. Count.<|im_end|>\n<|im_start|>assistant\n<think>\n'
        '\n</think>\n\none two three<|im_end|>\n',
        '<think>\n\n</think>\n\nHi, how are you?<|im_end|>|<think>\n'
        '\n</think>\n\none two three<|im_end|>'),
    'falcon_h1': ('<|endoftext|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n'
        'Hello there<|im_end|>\n<|im_start|>assistant\nHi, how are you?<|im_end|>\n'
        '<|im_start|>user\nFine. Count.<|im_end|>\n<|im_start|>assistant\n'
        'one two three<|im_end|>\n',
        'Hi, how are you?<|im_end|>|one two three<|im_end|>'),
    'llama3': ('<|endoftext|><|start_header_id|>system<|end_header_id|>\n'
        '\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n'
        '\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n'
        '\nHi, how are you?<|eot_id|><|start_header_id|>user<|end_header_id|>\n'
        '\nFine. Count.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n'
        '\none two three<|eot_id|>',
        'Hi, how are you?<|eot_id|>|one two three<|eot_id|>'),
    'llama3_2_vision': ('<|endoftext|><|start_header_id|>system<|end_header_id|>\n'
        '\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n'
        '\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n'
        '\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n'
        '\nHi, how are you?<|eot_id|><|start_header_id|>user<|end_header_id|>\n'
        '\nFine. Count.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n'
        '\none two three<|eot_id|>',
        'Hi, how are you?<|eot_id|>|one two three<|eot_id|>'),
    'llama4': ('<|endoftext|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|><|header_start|>user<|hea'
        'der_end|>\n\nHello there<|eot|><|header_start|>assistant<|header_end|>\n'
        '\nHi, how are you?<|eot|><|header_start|>user<|header_end|>\n'
        '\nFine. Count.<|eot|><|header_start|>assistant<|header_end|>\n'
        '\none two three<|eot|>',
        'Hi, how are you?<|eot|>|one two three<|eot|>'),
    'llava': ('Be brief. USER: Hello there ASSISTANT: Hi, how are you? USER: Fine. Count. ASSISTANT: one two '
        'three ',
        ' Hi, how are you?| one two three'),
    'gemma3': ('<|endoftext|><start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n'
        '<start_of_turn>model\nHi, how are you?<end_of_turn>\n<start_of_turn>user\n'
        'Fine. Count.<end_of_turn>\n<start_of_turn>model\none two three<end_of_turn>\n',
        'Hi, how are you?<end_of_turn>|one two three<end_of_turn>'),
    'gemma4': ('<|endoftext|><|turn>system\nBe brief.<turn|>\n<|turn>user\n'
        'Hello there<turn|>\n<|turn>model\nHi, how are you?<turn|>\n'
        '<|turn>user\nFine. Count.<turn|>\n<|turn>model\none two three<turn|>\n',
        'Hi, how are you?<turn|>|one two three<turn|>'),
    'mistral': ('<|endoftext|>[INST] Be brief.\n\nHello there [/INST] Hi, how are you?<|endoftext|>[INST] Fine.'
        ' Count. [/INST] one two three<|endoftext|>',
        ' Hi, how are you?<|endoftext|>| one two three<|endoftext|>'),
    'mistral_v1': ('<|endoftext|> [INST] Be brief.\n\nHello there [/INST] Hi, how are you?<|endoftext|> [INST] Fin'
        'e. Count. [/INST] one two three<|endoftext|>',
        ' Hi, how are you?<|endoftext|>| one two three<|endoftext|>'),
    'mistral_v2v3': ('<|endoftext|>[INST] Be brief.\n\nHello there[/INST] Hi, how are you?<|endoftext|>[INST] Fine. '
        'Count.[/INST] one two three<|endoftext|>',
        ' Hi, how are you?<|endoftext|>| one two three<|endoftext|>'),
    'mistral_v3_tekken': ('<|endoftext|>[INST]Be brief.\n\nHello there[/INST]Hi, how are you?<|en'
        'doftext|>[INST]Fine. Cou'
        'nt.[/INST]one two three<|endoftext|>',
        'Hi, how are you?<|endoftext|>|one two three<|endoftext|>'),
    'mistral_v7_tekken': ('<|endoftext|>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hello there'
        '[/INST]Hi, how are you?<'
        '|endoftext|>[INST]Fine. Count.[/INST]one two three<|endoftext|>',
        'Hi, how are you?<|endoftext|>|one two three<|endoftext|>'),
    'phi_3': ('<|endoftext|><|system|>\nBe brief.<|end|>\n<|user|>\nHello there<|end|>\n'
        '<|assistant|>\nHi, how are you?<|end|>\n<|user|>\nFine. Count.<|end|>\n'
        '<|assistant|>\none two three<|end|>\n',
        'Hi, how are you?<|end|>|one two three<|end|>'),
    'phi_35': ('<|system|>\nBe brief.<|end|>\n<|user|>\nHello there<|end|>\n'
        '<|assistant|>\nHi, how are you?<|end|>\n<|user|>\nFine. Count.<|end|>\n'
        '<|assistant|>\none two three<|end|>\n',
        'Hi, how are you?<|end|>|one two three<|end|>'),
    'deepseek_v2': ('<|endoftext|>Be brief.\n\n<｜User｜>Hello there<｜Assistant｜>Hi, how are you?<|endoftext|><｜User｜'
        '>Fine. Count.<｜Assistant｜>one two three<|endoftext|>',
        'Hi, how are you?<|endoftext|>|one two three<|endoftext|>'),
    'deepseek_v3': ('<|endoftext|>Be brief.<｜User｜>Hello there<｜Assistant｜>Hi, how are you?<｜end▁of▁sentence｜><｜Use'
        'r｜>Fine. Count.<｜Assistant｜>one two three<｜end▁of▁sentence｜>',
        'Hi, how are you?<｜end▁of▁sentence｜>|one two three<｜end▁of▁sentence｜>'),
    'cohere': ('<|endoftext|><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|><|START_OF_T'
        'URN_TOKEN|><|USER_TOKEN|>Hello there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKE'
        'N|>Hi, how are you?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Fine. Count.<|END'
        '_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>one two three<|END_OF_TURN_TOKEN|>',
        'Hi, how are you?<|END_OF_TURN_TOKEN|>|one two three<|END_OF_TURN_TOKEN|>'),
    'command_a': (('<|endoftext|><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\n',
          '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|'
          'CHATBOT_TOKEN|><|START_RESPONSE|>Hi, how are you?<|END_RESPONSE|><|END_OF_TURN_TOKEN|><|START_'
          'OF_TURN_TOKEN|><|USER_TOKEN|>Fine. Count.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT'
          '_TOKEN|><|START_RESPONSE|>one two three<|END_RESPONSE|><|END_OF_TURN_TOKEN|>'),
        'Hi, how are you?<|END_RESPONSE|><|END_OF_TURN_TOKEN|>|one two three<|END_RESPONSE|><|END_OF_TU'
        'RN_TOKEN|>'),
    'command_a_rag': (('<|endoftext|><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\n',
          '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|'
          'CHATBOT_TOKEN|><|START_RESPONSE|>Hi, how are you?<|END_RESPONSE|><|END_OF_TURN_TOKEN|><|START_'
          'OF_TURN_TOKEN|><|USER_TOKEN|>Fine. Count.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT'
          '_TOKEN|><|START_RESPONSE|>one two three<|END_RESPONSE|><|END_OF_TURN_TOKEN|>'),
        '<|START_RESPONSE|>Hi, how are you?<|END_RESPONSE|><|END_OF_TURN_TOKEN|>|<|START_RESPONSE|>one '
        'two three<|END_RESPONSE|><|END_OF_TURN_TOKEN|>'),
    'alpaca': ('<|endoftext|>Be brief.\n\n### Instruction:\nHello there\n'
        '\n### Response:\nHi, how are you?<|endoftext|>\n\n### Instruction:\n'
        'Fine. Count.\n\n### Response:\none two three<|endoftext|>',
        'Hi, how are you?<|endoftext|>|one two three<|endoftext|>'),
    'exaone': ('[|system|]Be brief.[|endofturn|]\n[|user|]Hello there\n[|assistant|]Hi, how are you?[|endoftur'
        'n|]\n[|user|]Fine. Count.\n[|assistant|]one two three[|endofturn|]\n',
        'Hi, how are you?[|endofturn|]|one two three[|endofturn|]'),
    'exaone4': ('[|system|]\nBe brief.[|endofturn|]\n[|user|]\nHello there[|endofturn|]\n'
        '[|assistant|]\n<think>\n\n</think>\n\nHi, how are you?[|endofturn|]\n'
        '[|user|]\nFine. Count.[|endofturn|]\n[|assistant|]\n<think>\n'
        '\n</think>\n\none two three[|endofturn|]\n',
        '<think>\n\n</think>\n\nHi, how are you?[|endofturn|]|<think>\n'
        '\n</think>\n\none two three[|endofturn|]'),
    'jamba': ('<|startoftext|><|bom|><|system|> Be brief.<|eom|><|bom|><|user|> Hello there<|eom|><|bom|><|as'
        'sistant|> Hi, how are you?<|eom|><|bom|><|user|> Fine. Count.<|eom|><|bom|><|assistant|> one t'
        'wo three<|eom|>',
        ' Hi, how are you?<|eom|>| one two three<|eom|>'),
    'metharme': ('<|endoftext|><|system|>Be brief.<|user|>Hello there<|model|>Hi, how are you?<|endoftext|><|use'
        'r|>Fine. Count.<|model|>one two three<|endoftext|>',
        'Hi, how are you?<|endoftext|>|one two three<|endoftext|>'),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def render(tmp_path, tokenizer, name: str, messages=CONVERSATION):
    tokenizer.bos_token = "<|endoftext|>"  # the family's bos role, in the tiny vocabulary
    try:
        return prepared(tmp_path, tokenizer, [{"messages": messages}], {"type": "chat_template"},
                        chat_template=name, sequence_len=4096)[0]
    finally:
        tokenizer.bos_token = None


def test_every_name_axolotl_gives_a_template_is_a_template_here():
    axolotl_names = {"alpaca", "chatml", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken",
                     "gemma", "cohere", "llama3", "llama3_2_vision", "llama4", "phi_3", "phi_35", "deepseek_v2",
                     "deepseek_v3", "jamba", "qwen_25", "qwen3", "qwen3_5", "falcon_h1", "nemotron_h", "exaone",
                     "exaone4", "metharme", "pixtral", "llava", "qwen2_vl", "gemma3", "gemma3n", "gemma4",
                     "gemma4_unified", "command_a", "command_a_tool_use", "command_a_rag", "aya"}  # (+ jinja, default)
    assert axolotl_names <= set(CHAT_TEMPLATES.names())
    assert set(FAMILY_TEXT) == {CHAT_TEMPLATES.canonical(name) for name in CHAT_TEMPLATES.names()}


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES.names()))
def test_a_named_template_renders_its_familys_text_and_trains_exactly_the_assistant_turns(tmp_path, tokenizer, name):
    text, trained = FAMILY_TEXT[CHAT_TEMPLATES.canonical(name)]
    row = render(tmp_path, tokenizer, name)
    rendered = tokenizer.decode(row["input_ids"])
    if isinstance(text, tuple):
        start, end = text
        assert rendered.startswith(start) and rendered.endswith(end), rendered
    else:
        assert rendered == text
    assert trained_text(row, tokenizer) == trained


def test_reasoning_goes_where_each_family_writes_it(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "Add one and two."},
                {"role": "assistant", "content": "three", "reasoning_content": "one plus two"}]
    expected = {"qwen3_5": "<think>\none plus two\n</think>\n\nthree<|im_end|>",
                "exaone4": "<think>\none plus two\n</think>\n\nthree[|endofturn|]",
                "gemma4": "<|channel>thought\none plus two\n<channel|>three<turn|>"}
    for name, trained in expected.items():
        assert trained_text(render(tmp_path / name, tokenizer, name, messages), tokenizer) == trained


def test_a_template_that_writes_fixed_roles_refuses_another_role_naming_the_row(tmp_path, tokenizer):
    """A `tool` turn through Cohere's template would vanish from the text: the row is refused instead."""
    messages = [*CONVERSATION[1:3], {"role": "tool", "content": "42"}, CONVERSATION[4]]
    with pytest.raises(UserError, match=r"rows.jsonl:1.*the chat template refuses this conversation: this chat "
                                        r"template writes system, user and assistant turns, not tool"):
        render(tmp_path, tokenizer, "cohere", messages)


def test_a_name_axolotl_does_not_have_either_is_refused_naming_the_ones_tuneloop_has():
    with pytest.raises(UserError, match="'qwen9', a chat template tuneloop does not have.*'qwen3_5'"):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "chat_template": "qwen9"})
