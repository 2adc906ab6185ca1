"""Chat templates by name (axolotl's `chat_template:` values): the registry, and how a name resolves against the
tokenizer's own template. What each family writes, and where tuneloop writes it otherwise, is in
chat_template_texts.py."""

from __future__ import annotations

from tuneloop.data import chat_template_texts as texts
from tuneloop.registry import Registry

CHAT_TEMPLATES: Registry[str] = Registry("chat template", "chat_template")
CHAT_TEMPLATES.add("chatml", texts.CHATML, aliases=("nemotron_h",))
CHAT_TEMPLATES.add("qwen_25", texts.QWEN_25)
CHAT_TEMPLATES.add("qwen2_vl", texts.QWEN2_VL)
CHAT_TEMPLATES.add("qwen3", texts.QWEN3)
CHAT_TEMPLATES.add("qwen3_5", texts.QWEN3_5)
CHAT_TEMPLATES.add("falcon_h1", texts.FALCON_H1)
CHAT_TEMPLATES.add("llama3", texts.LLAMA3)
CHAT_TEMPLATES.add("llama3_2_vision", texts.LLAMA3_2_VISION)
CHAT_TEMPLATES.add("llama4", texts.LLAMA4)
CHAT_TEMPLATES.add("llava", texts.LLAVA)
CHAT_TEMPLATES.add("gemma3", texts.GEMMA3, aliases=("gemma", "gemma3n"))
CHAT_TEMPLATES.add("gemma4", texts.GEMMA4, aliases=("gemma4_unified",))
CHAT_TEMPLATES.add("mistral", texts.MISTRAL)
CHAT_TEMPLATES.add("mistral_v1", texts.MISTRAL_V1)
CHAT_TEMPLATES.add("mistral_v2v3", texts.MISTRAL_V2V3)
CHAT_TEMPLATES.add("mistral_v3_tekken", texts.MISTRAL_V3_TEKKEN, aliases=("pixtral",))
CHAT_TEMPLATES.add("mistral_v7_tekken", texts.MISTRAL_V7_TEKKEN)
CHAT_TEMPLATES.add("phi_3", texts.PHI_3)
CHAT_TEMPLATES.add("phi_35", texts.PHI_35)
CHAT_TEMPLATES.add("deepseek_v2", texts.DEEPSEEK_V2)
CHAT_TEMPLATES.add("deepseek_v3", texts.DEEPSEEK_V3)
CHAT_TEMPLATES.add("cohere", texts.COHERE, aliases=("aya",))
CHAT_TEMPLATES.add("command_a", texts.COMMAND_A)
CHAT_TEMPLATES.add("command_a_rag", texts.COMMAND_A_RAG, aliases=("command_a_tool_use",))
CHAT_TEMPLATES.add("alpaca", texts.ALPACA)
CHAT_TEMPLATES.add("exaone", texts.EXAONE)
CHAT_TEMPLATES.add("exaone4", texts.EXAONE4)
CHAT_TEMPLATES.add("jamba", texts.JAMBA)
CHAT_TEMPLATES.add("metharme", texts.METHARME)

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
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eot|>", "<end_of_turn>", "<turn|>", "<|end|>", "<|eom|>",
             "<|END_OF_TURN_TOKEN|>", "[|endofturn|]", "<｜end▁of▁sentence｜>", "</s>")


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
