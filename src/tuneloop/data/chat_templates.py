"""Chat templates by name (axolotl's `chat_template:` values), written from each family's published format.

A template renders a list of `{"role", "content"}` messages (and `reasoning_content` where a family has
reasoning) to text; tuneloop finds the trained turns by rendering growing prefixes (formats.py), so every
template here renders a conversation's first k turns as a prefix of the whole.

Choices where a family's own template does something else:
- qwen3 puts a reasoning block (`<think>…</think>`) on every assistant turn that carries
  `reasoning_content`, and none on a turn without it. Qwen's published template drops the reasoning of
  turns before the last user message and adds an empty block to the last turn, which would make earlier
  renderings no prefix of later ones; training rows keep what the data says.
- gemma and gemma3n use Gemma 3's turn format (`<start_of_turn>`; `model` for the assistant; a system
  message goes before the first user message).
- Special tokens (`bos_token`, `eos_token`) are the tokenizer's; the template writes nothing for one the
  tokenizer does not have.
"""

from __future__ import annotations

from tuneloop.registry import Registry

_BOS = "{{ bos_token if bos_token else '' }}"
_EOS = "{{ eos_token if eos_token else '' }}"


def _generation(prompt: str) -> str:
    """What add_generation_prompt appends: the start of an assistant turn."""
    return "{% if add_generation_prompt %}{{ '" + prompt + "' }}{% endif %}"



CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}" + _generation("<|im_start|>assistant\\n")
)

QWEN_25 = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}" + CHATML
)

QWEN3 = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'].strip('\n') + '\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}" + _generation("<|im_start|>assistant\\n")
)

LLAMA3 = (
    _BOS + "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    + _generation("<|start_header_id|>assistant<|end_header_id|>\\n\\n")
)

LLAMA4 = (
    _BOS + "{% for message in messages %}{{ '<|header_start|>' + message['role'] + '<|header_end|>\n\n' + "
    "message['content'] | trim + '<|eot|>' }}{% endfor %}"
    + _generation("<|header_start|>assistant<|header_end|>\\n\\n")
)

GEMMA3 = (
    _BOS + "{% if messages and messages[0]['role'] == 'system' %}{% set first_prefix = messages[0]['content'] | trim + "
    "'\n\n' %}{% set turns = messages[1:] %}{% else %}{% set first_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}" + _generation("<start_of_turn>model\\n")
)

MISTRAL = (
    _BOS + "{% if messages and messages[0]['role'] == 'system' %}{% set first_prefix = messages[0]['content'] + "
    "'\n\n' %}{% set turns = messages[1:] %}{% else %}{% set first_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (first_prefix if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] }}" + _EOS + "{% endif %}{% endfor %}"
)

PHI_3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}" + _generation("<|assistant|>\\n")
)

CHAT_TEMPLATES: Registry[str] = Registry("chat template", "chat_template")
CHAT_TEMPLATES.add("chatml", CHATML)
CHAT_TEMPLATES.add("qwen_25", QWEN_25)
CHAT_TEMPLATES.add("qwen3", QWEN3)
CHAT_TEMPLATES.add("llama3", LLAMA3)
CHAT_TEMPLATES.add("llama4", LLAMA4)
CHAT_TEMPLATES.add("gemma3", GEMMA3, aliases=("gemma", "gemma3n"))
CHAT_TEMPLATES.add("mistral", MISTRAL)
CHAT_TEMPLATES.add("phi_3", PHI_3)

TOKENIZER_DEFAULT = "tokenizer_default"
FALLBACK_PREFIX = "tokenizer_default_fallback_"  # the tokenizer's own template, else the named one


def check_template_name(name: str) -> str:
    """A `chat_template:` value: a registered name, `tokenizer_default`, a fallback, or `jinja`."""
    if name in (TOKENIZER_DEFAULT, "jinja") or name in CHAT_TEMPLATES:
        return name
    if name.startswith(FALLBACK_PREFIX) and name[len(FALLBACK_PREFIX):] in CHAT_TEMPLATES:
        return name
    raise ValueError(f"got {name!r}, a chat template tuneloop does not have; use tokenizer_default, "
                     f"tokenizer_default_fallback_<name>, jinja (with chat_template_jinja) or one of "
                     f"{CHAT_TEMPLATES.choices()}")


# the tokens chat templates end a turn with, by family (a template's own is found in its text)
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eot|>", "<end_of_turn>", "<|end|>", "</s>")


def end_of_turn_ids(tokenizer, template: str | None, eot_tokens: list[str] | None = None) -> set[int]:
    """The ids that end a row or a turn: eos, the config's `eot_tokens`, and the turn end the template writes."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in [*(eot_tokens or []), *(end for end in TURN_ENDS if template and end in template)]:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


def resolve_template(name: str | None, jinja: str | None, tokenizer) -> str | None:
    """The template text a name stands for (None: the tokenizer has none and none was named)."""
    own = getattr(tokenizer, "chat_template", None)
    if name is None or name == TOKENIZER_DEFAULT:
        return own
    if name == "jinja":
        return jinja
    if name.startswith(FALLBACK_PREFIX):
        return own or CHAT_TEMPLATES[name[len(FALLBACK_PREFIX):]]
    return CHAT_TEMPLATES[name]
