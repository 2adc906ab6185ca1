"""The tokenizer in llama.cpp's terms. Which tokenizer model (byte-level BPE `gpt2`, or sentencepiece-style BPE
`llama`), how text is split before the merges (`tokenizer.ggml.pre`), the tokens with their types, the merges, the
special tokens and whether BOS/EOS are added.

llama.cpp's conversion script recognises the pre-tokenizer by hashing how the tokenizer encodes a test string,
which only knows released vocabularies. We read the pre-tokenizer itself from tokenizer.json instead, so a
tokenizer trained from scratch is recognised by what it does; a split llama.cpp has no name for is refused
(a wrong name tokenizes numbers and punctuation differently, silently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tuneloop.errors import UserError

# token types, as llama.cpp numbers them (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The splitting regexes of the published tokenizers (tokenizer.json `Split` patterns), by llama.cpp's name.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_NAMES = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


@dataclass
class GgufVocab:
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre (byte-level BPE only)
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float] | None = None  # sentencepiece-style: llama.cpp merges by score
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad/eot -> id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    padded: int = 0  # rows of the embedding with no token: written as [PADn] tokens (UNUSED)
    note: str | None = None  # where llama.cpp will tokenize differently, said in the header


def read_vocab(tokenizer, vocab_size: int) -> GgufVocab:
    """`tokenizer`: a fast (tokenizers-backed) HF tokenizer; `vocab_size`: the model's embedding rows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError("export: the tokenizer is not a fast (tokenizer.json) tokenizer; GGUF export reads the "
                        "tokenizer from tokenizer.json")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise UserError(f"export: the tokenizer is a {model.get('type')} model; GGUF export writes BPE tokenizers "
                        "(byte-level, as GPT-2/LLaMA-3/Qwen, or with byte fallback, as LLaMA-2/Mistral)")
    if _mentions(spec.get("pre_tokenizer"), "ByteLevel") or _mentions(spec.get("decoder"), "ByteLevel"):
        kind, pre = "gpt2", byte_level_pre(spec.get("pre_tokenizer"))
    elif model.get("byte_fallback"):
        kind, pre = "llama", None
        check_sentencepiece_split(spec.get("pre_tokenizer"), spec.get("normalizer"))
    else:
        raise UserError("export: the tokenizer is BPE but neither byte-level nor with byte fallback; llama.cpp "
                        "has no tokenizer that splits text as it does")
    normalizer_note = check_normalizer(spec.get("normalizer"), kind)
    tokens = _tokens_by_id(model["vocab"], spec.get("added_tokens") or [])
    if len(tokens) > vocab_size:
        raise UserError(f"export: the tokenizer has {len(tokens)} tokens but the model only {vocab_size} embedding "
                        "rows; the tokenizer is not this model's")
    added = {entry["id"]: entry for entry in spec.get("added_tokens") or []}
    unk = model.get("unk_token") or getattr(tokenizer, "unk_token", None)
    types = [_token_type(index, token, added, unk, kind) for index, token in enumerate(tokens)]
    padded = vocab_size - len(tokens)
    tokens += [f"[PAD{index}]" for index in range(len(tokens), vocab_size)]
    types += [UNUSED] * padded
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges") or []]
    vocab = GgufVocab(kind, pre, tokens, types, merges, padded=padded, note=normalizer_note)
    if kind == "llama":
        vocab.scores = merge_scores(tokens, merges)
        vocab.add_space_prefix, prefix_note = space_prefix(spec, chat=bool(tokenizer.chat_template))
        vocab.note = "; ".join(note for note in (vocab.note, prefix_note) if note) or None
    vocab.special_ids = special_ids(tokenizer)
    vocab.add_bos, vocab.add_eos = adds_bos_eos(tokenizer)
    return vocab


def _mentions(node, kind: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == kind or any(_mentions(value, kind) for value in node.values())
    if isinstance(node, list):
        return any(_mentions(value, kind) for value in node)
    return False


def _steps(node) -> list[dict]:
    return node.get("pretokenizers", node.get("normalizers", [])) if node and node["type"] == "Sequence" \
        else [node] if node else []


def _refuse(what: str, node) -> UserError:
    return UserError(f"export: the tokenizer {what} ({json.dumps(node)[:160]}), which llama.cpp's tokenizer does "
                     "not do; the GGUF would tokenize text differently, so it is not written")


def check_normalizer(normalizer, kind: str) -> str | None:
    """What llama.cpp's tokenizers do before splitting: nothing for byte-level BPE, "▁" for spaces (and a
    prefix) for sentencepiece-style. Any other normalizer is refused; NFC, which Qwen's tokenizers apply and
    llama.cpp does not, is accepted with a note (it changes only text that is not NFC already)."""
    steps = _steps(normalizer)
    if not steps:
        return None
    if kind == "gpt2" and [step["type"] for step in steps] == ["NFC"]:
        return "llama.cpp does not NFC-normalize as this tokenizer does: text not already in NFC tokenizes differently"
    spaces = [step for step in steps if step["type"] == "Replace" and step.get("pattern") == {"String": " "}
              and step.get("content") == "\u2581"]
    prefix = [step for step in steps if step["type"] == "Prepend" and step.get("prepend") == "\u2581"]
    if kind == "llama" and spaces and len(spaces) + len(prefix) == len(steps) and len(prefix) <= 1:
        return None
    raise _refuse("normalizes text first", normalizer)


def check_sentencepiece_split(pre_tokenizer, normalizer) -> None:
    """Sentencepiece-style BPE splits nothing but at "▁": a Metaspace, nothing (LLaMA-2's normalizer does the
    work), or Gemma's split at spaces after its normalizer made them "▁"."""
    steps = _steps(pre_tokenizer)
    if not steps or [step["type"] for step in steps] == ["Metaspace"]:
        return
    if ([step["type"] for step in steps] == ["Split"] and steps[0].get("pattern") == {"String": " "}
            and steps[0].get("behavior") == "MergedWithPrevious" and _steps(normalizer)):
        return
    raise _refuse("splits text before its merges", pre_tokenizer)


def byte_level_pre(pre_tokenizer) -> str:
    """llama.cpp's name for the way this byte-level tokenizer splits text before its merges."""
    steps = _steps(pre_tokenizer)
    shape = [step["type"] for step in steps]
    byte_level = [step for step in steps if step["type"] == "ByteLevel"]
    if any(step.get("add_prefix_space") for step in byte_level):
        raise _refuse("puts a space before the text (ByteLevel add_prefix_space: true)", pre_tokenizer)
    if shape == ["ByteLevel"] and byte_level[0].get("use_regex", True):
        return "gpt-2"  # GPT-2's own regex inside ByteLevel
    if (shape == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and byte_level[0].get("use_regex", True)):
        return "smollm"  # each digit apart, then GPT-2's regex (SmolLM's tokenizer)
    if shape == ["Split", "ByteLevel"] and not byte_level[0].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        if pattern in SPLIT_NAMES:
            return SPLIT_NAMES[pattern]
    raise UserError(f"export: the tokenizer splits text with a pre-tokenizer llama.cpp has no name for "
                    f"({json.dumps(pre_tokenizer)[:160]}); GGUF export knows GPT-2's, SmolLM's, LLaMA-3's and "
                    "Qwen2's, and will not guess (a wrong one tokenizes numbers and punctuation differently)")


def _tokens_by_id(vocab: dict, added: list[dict]) -> list[str]:
    by_id = {index: token for token, index in vocab.items()}
    for entry in added:
        by_id[entry["id"]] = entry["content"]
    size = max(by_id) + 1 if by_id else 0
    missing = [index for index in range(size) if index not in by_id]
    if missing:
        raise UserError(f"export: the tokenizer has no token for id {missing[0]} (and {len(missing) - 1} more); a "
                        "GGUF vocabulary is one token per id")
    return [by_id[index] for index in range(size)]


def _token_type(index: int, token: str, added: dict, unk: str | None, kind: str) -> int:
    if index in added:
        return CONTROL if added[index].get("special") else USER_DEFINED
    if token == unk:
        return UNKNOWN
    if kind == "llama" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return BYTE
    return NORMAL


def merge_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """Sentencepiece-style vocabularies are merged by llama.cpp in order of the tokens' scores: the token the
    earliest merge makes scores highest, so the score order replays the merge order; others score 0."""
    made_at = {}
    for rank, merge in enumerate(merges):
        made_at.setdefault(merge.replace(" ", ""), rank)
    return [-float(made_at[token] + 1) if token in made_at else 0.0 for token in tokens]


def space_prefix(spec: dict, chat: bool) -> tuple[bool, str | None]:
    """(tokenizer.ggml.add_space_prefix, a note): whether llama.cpp puts "▁" before text, as this tokenizer does.

    llama.cpp prefixes the text at the start and after every special token, as sentencepiece itself (and HF's
    legacy Prepend normalizer, and Metaspace's "always") does. Metaspace's "first" prefixes only the start of the
    whole input, which llama.cpp cannot do: a model with a chat template is prompted through it, where every
    turn's text follows a special token, so the file says no prefix (chat prompts tokenize as in HF; a plain prompt
    differs in its first word); without a template, the other way round."""
    metaspace = _find(spec.get("pre_tokenizer"), "Metaspace")
    if metaspace is None:
        return _find(spec.get("normalizer"), "Prepend") is not None, None
    scheme = metaspace.get("prepend_scheme", "always" if metaspace.get("add_prefix_space", True) else "never")
    if scheme == "always":
        return True, ("llama.cpp adds the space prefix also to text that starts with a space (this tokenizer does "
                      "not): such text gets one more \u2581")
    if scheme != "first":
        return False, None
    if chat:
        return False, ("llama.cpp cannot prefix only the start of the input (Metaspace prepend_scheme 'first'): "
                       "written without the prefix, so chat prompts tokenize as here and a plain prompt's first "
                       "word differs")
    return True, ("llama.cpp cannot prefix only the start of the input (Metaspace prepend_scheme 'first'): "
                  "written with the prefix, so plain text tokenizes as here and text right after a special token "
                  "differs")


def _find(node, kind: str):
    if isinstance(node, dict):
        if node.get("type") == kind:
            return node
        node = list(node.values())
    if isinstance(node, list):
        for value in node:
            found = _find(value, kind)
            if found is not None:
                return found
    return None


def special_ids(tokenizer) -> dict[str, int]:
    ids = {}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            ids[name] = int(token_id)
    return ids


def adds_bos_eos(tokenizer) -> tuple[bool, bool]:
    """What encoding does, not what a config flag says (flags live in several files and versions)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(full) > len(plain) and full[0] == bos
    add_eos = eos is not None and len(full) > len(plain) and full[-1] == eos
    return add_bos, add_eos


def add_vocab(writer, vocab: GgufVocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    setters = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
               "pad": writer.add_pad_token_id, "eot": writer.add_eot_token_id}
    for name, token_id in vocab.special_ids.items():
        setters[name](token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
