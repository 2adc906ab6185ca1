"""The chat side of an exported model: the token that ends an assistant turn (llama.cpp stops there), and an
Ollama Modelfile whose TEMPLATE renders conversations as the run's chat template does.

Ollama templates are Go templates, not Jinja. A template family is translated only when rendering probe
conversations through the run's Jinja template and through the family's Ollama template (mirrored here in
Python) gives the same text, byte for byte; otherwise the Modelfile has no TEMPLATE and says so, and Ollama
picks its closest built-in template from the Jinja one inside the GGUF (`ollama show --template` shows which).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

_PROBES = (
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}],
)


@dataclass(frozen=True)
class OllamaFamily:
    name: str
    template: str  # Ollama's Go template
    render: Callable[[list[dict]], str]  # what `template` renders for these messages (generation prompt included)
    system_block: str  # regex: a system turn at the start of a rendering, its content in group 1


def _chatml(messages: list[dict]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _llama3(messages: list[dict]) -> str:
    turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
    return turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"


FAMILIES = (
    OllamaFamily("chatml", "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                           "<|im_start|>assistant\n", _chatml, r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n"),
    OllamaFamily("llama3", "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
                           "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
                 _llama3, r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
)


@dataclass(frozen=True)
class ChatFacts:
    template: str | None  # the Jinja template the run trained with
    turn_end: str | None  # the special token after an assistant turn ("<|im_end|>")
    family: OllamaFamily | None  # the Ollama template that renders as the Jinja one does
    default_system: str | None  # the system prompt the template adds to a conversation without one


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]  # the tokenizer adds it (llama.cpp's add_bos), so Ollama's template must not
    return text


def chat_facts(tokenizer) -> ChatFacts:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one is what apply_chat_template uses
        template = template.get("default")
    if not template:
        return ChatFacts(None, None, None, None)
    try:
        turn_end = turn_end_token(tokenizer)
    except Exception:  # a template that cannot render a plain user/assistant exchange: no turn end to name
        turn_end = None
    return ChatFacts(template, turn_end, *_ollama_family(tokenizer))


def turn_end_token(tokenizer) -> str | None:
    """The first special token the template writes after an assistant's reply."""
    marker = "TUNELOOP-REPLY"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = text[text.index(marker) + len(marker):]
    specials = sorted(set(tokenizer.all_special_tokens) | {str(t) for t in tokenizer.added_tokens_decoder.values()
                                                           if getattr(t, "special", False)}, key=len, reverse=True)
    found = [(after.find(token), token) for token in specials if token and after.find(token) >= 0]
    return min(found)[1] if found else None


def _ollama_family(tokenizer) -> tuple[OllamaFamily | None, str | None]:
    try:
        renderings = [_render(tokenizer, probe, True) for probe in _PROBES]
        alone = _render(tokenizer, [{"role": "user", "content": "x"}], True)
    except Exception:  # a template that refuses a probe (no system role, tools required): not translated
        return None, None
    for family in FAMILIES:
        match = re.match(family.system_block, alone, re.S)
        default_system = match.group(1) if match else None
        if all(family.render(_with_system(probe, default_system)) == rendering
               for probe, rendering in zip(_PROBES, renderings)):
            return family, default_system
    return None, None


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    """As Ollama sends a conversation: the Modelfile's SYSTEM first when the conversation has none."""
    if system is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}] + messages


def modelfile(gguf_name: str, modelfile_name: str, facts: ChatFacts, stops: list[str]) -> str:
    """The Modelfile's lines (files.modelfile_text puts the line that says who wrote them first)."""
    lines = [f"# Create the model with:  ollama create NAME -f {modelfile_name}", f"FROM ./{gguf_name}"]
    if facts.family is not None:
        lines.append(f'TEMPLATE """{facts.family.template}"""')
        if facts.default_system is not None:
            lines.append(f'SYSTEM """{facts.default_system}"""')
    elif facts.template:
        lines.append("# The run's chat template has no Ollama translation here; Ollama picks its closest built-in "
                     "template from the one inside the GGUF (check it with `ollama show NAME --template`).")
    else:
        lines.append("# The model has no chat template: prompts are completed as plain text.")
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"
