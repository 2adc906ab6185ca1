"""Each dataset type renders and masks exactly as specified: we decode the prompt and the trained
tokens and compare them with the text we expect, and we check bad rows name file and line."""

from __future__ import annotations

import json

import pytest
from conftest import assert_user_error, base_config, run_in_process, write_config, write_jsonl
from transformers import AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.formats import ALPACA_SYSTEM_NO_INPUT, ALPACA_SYSTEM_WITH_INPUT
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.prepare import prepare
from tuneloop.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def prepared_rows(tmp_path, tokenizer, rows, dataset: dict, **keys):
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(data), **dataset}],
                            "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 512, **keys})
    result = prepare(cfg, tokenizer)
    return [result.train[i] for i in range(len(result.train))], result


def split(row, tokenizer) -> tuple[str, str]:
    """(all text, trained text) decoded from a prepared row."""
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    return tokenizer.decode(row["input_ids"]), tokenizer.decode(trained)


def test_alpaca_with_and_without_input_renders_axolotls_prompt_and_trains_only_the_response(tmp_path, tokenizer):
    rows = [{"instruction": "Add two numbers.", "input": "one two", "output": "three"},
            {"instruction": "Name three colours.", "input": "", "output": "red, green and blue"}]
    prepared, _ = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"})
    text, trained = split(prepared[0], tokenizer)
    assert text == (ALPACA_SYSTEM_WITH_INPUT + "\n\n### Instruction:\nAdd two numbers.\n\n### Input:\none two\n\n"
                    "### Response:\nthree<|endoftext|>")
    assert ALPACA_SYSTEM_WITH_INPUT.startswith("Below is an instruction that describes a task, paired with an input")
    assert trained == "three<|endoftext|>"
    text, trained = split(prepared[1], tokenizer)
    assert text == (ALPACA_SYSTEM_NO_INPUT + "\n\n### Instruction:\nName three colours.\n\n### Response:\n"
                    "red, green and blue<|endoftext|>")
    assert trained == "red, green and blue<|endoftext|>"
    # labels sit at the positions of the response tokens and nowhere else
    labels = prepared[1]["labels"]
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert all(label == IGNORE_INDEX for label in labels[:first])
    assert labels[first:] == prepared[1]["input_ids"][first:]


def test_train_on_inputs_trains_every_token(tmp_path, tokenizer):
    rows = [{"instruction": "Add two numbers.", "output": "three"}]
    prepared, _ = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"}, train_on_inputs=True)
    assert prepared[0]["labels"] == prepared[0]["input_ids"]


def test_completion_trains_the_whole_text_of_the_named_field(tmp_path, tokenizer):
    rows = [{"body": "The quick brown fox jumps over the lazy dog."}]
    prepared, _ = prepared_rows(tmp_path, tokenizer, rows, {"type": "completion", "field": "body"})
    text, trained = split(prepared[0], tokenizer)
    assert text == trained == "The quick brown fox jumps over the lazy dog.<|endoftext|>"


def test_custom_format_uses_axolotls_fields_and_formats(tmp_path, tokenizer):
    dataset = {"type": {"field_instruction": "q", "field_input": "ctx", "field_output": "a",
                        "system_prompt": "Be brief.", "system_format": "System: {system}\n",
                        "format": "User: {instruction} {input}\nAssistant: ", "no_input_format": "User: {instruction}\nAssistant: "}}
    rows = [{"q": "Count.", "ctx": "one two", "a": "three four"}, {"q": "Say hello.", "a": "Hello there"}]
    prepared, _ = prepared_rows(tmp_path, tokenizer, rows, dataset)
    text, trained = split(prepared[0], tokenizer)
    assert text == "System: Be brief.\nUser: Count. one two\nAssistant: three four<|endoftext|>"
    # the format ends in a space that BPE merges into the first response token ("Ġthree"): a token
    # that straddles the boundary produces response text, so it is trained
    assert trained == " three four<|endoftext|>"
    text, trained = split(prepared[1], tokenizer)
    assert text == "System: Be brief.\nUser: Say hello.\nAssistant: Hello there<|endoftext|>"
    assert trained == " Hello there<|endoftext|>"


def test_chat_template_trains_only_assistant_turns_with_their_end_token(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count."},
                {"role": "assistant", "content": "one two three"}]
    prepared, _ = prepared_rows(tmp_path, tokenizer, [{"messages": messages}], {"type": "chat_template"})
    row = prepared[0]
    text, _ = split(row, tokenizer)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nCount.<|im_end|>\n"
                    "<|im_start|>assistant\none two three<|im_end|>\n")
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    assert runs == ["Hello<|im_end|>", "one two three<|im_end|>"]


def test_sharegpt_conversations_map_roles(tmp_path, tokenizer):
    rows = [{"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hello"}]}]
    prepared, _ = prepared_rows(tmp_path, tokenizer, rows, {"type": "sharegpt"})
    text, trained = split(prepared[0], tokenizer)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    assert trained == "Hello<|im_end|>"


def test_rows_longer_than_sequence_len_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"instruction": "Say hello.", "output": "Hello"}, {"instruction": "Count. " * 200, "output": "one"}]
    prepared, result = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"})
    assert len(prepared) == 1 and result.stats.dropped_too_long == 1 and result.stats.rows_read == 2


def test_missing_field_names_the_file_and_line(tmp_path, tokenizer):
    rows = [{"instruction": "Say hello.", "output": "Hello"}, {"instruction": "Count."}]
    with pytest.raises(UserError, match=r"data\.jsonl:2: missing field `output`"):
        prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"})


def test_malformed_json_line_names_the_file_and_line(tmp_path, tiny_model_dir):
    data = tmp_path / "broken.jsonl"
    data.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n" + '{"instruction": "a", "output": \n')
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data))
    assert_user_error(run_in_process("preprocess", str(config)), "broken.jsonl:2: malformed JSON line")
    missing = write_config(tmp_path / "missing.yml", **base_config(tmp_path, tiny_model_dir, tmp_path / "nope.jsonl"))
    assert_user_error(run_in_process("preprocess", str(missing)), "no such file", "nope.jsonl")


def test_cache_is_reused_and_keyed_by_settings(tmp_path, tokenizer):
    rows = [{"instruction": "Say hello.", "output": "Hello"}] * 4
    _, first = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"})
    _, again = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"})
    assert first.cache_dir == again.cache_dir
    _, other = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"}, train_on_inputs=True)
    assert other.cache_dir != first.cache_dir
    write_jsonl(tmp_path / "data.jsonl", rows + [{"instruction": "New.", "output": "row"}])  # data changed
    _, changed = prepared_rows(tmp_path, tokenizer, rows + [{"instruction": "New.", "output": "row"}],
                               {"type": "alpaca"})
    assert changed.cache_dir != first.cache_dir and len(changed.train) == 5


def test_val_set_size_splits_deterministically_by_seed(tmp_path, tokenizer):
    rows = [{"instruction": f"Count {i}.", "output": "one " * (i % 7 + 1)} for i in range(50)]
    _, first = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"}, val_set_size=0.2, seed=1)
    assert (len(first.train), len(first.eval)) == (40, 10)
    first_eval = list(first.eval["input_ids"])
    import shutil

    shutil.rmtree(first.cache_dir)
    _, rebuilt = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"}, val_set_size=0.2, seed=1)
    assert list(rebuilt.eval["input_ids"]) == first_eval
    _, other_seed = prepared_rows(tmp_path, tokenizer, rows, {"type": "alpaca"}, val_set_size=0.2, seed=2)
    assert list(other_seed.eval["input_ids"]) != first_eval


def test_preprocess_show_marks_the_trained_text(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Say hello.", "output": "Hello there"}])
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data))
    result = run_in_process("preprocess", str(config), "--show", "1")
    assert result.returncode == 0, result.stderr
    assert "### Response:\n⟦Hello there<|endoftext|>⟧" in result.stdout


def test_custom_format_with_an_unknown_placeholder_and_chat_data_without_a_template(tmp_path, tokenizer):
    rows = [{"instruction": "Say hello.", "output": "Hello"}]
    with pytest.raises(UserError, match=r"placeholder 'question'"):
        prepared_rows(tmp_path, tokenizer, rows, {"type": {"format": "{question}", "no_input_format": "{question}"}})
    no_template = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    no_template.chat_template = None
    chat = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    (tmp_path / "chat").mkdir()
    (tmp_path / "chatml").mkdir()
    with pytest.raises(UserError, match="needs a chat template.*chat_template: chatml"):
        prepared_rows(tmp_path / "chat", no_template, chat, {"type": "chat_template"})
    prepared, _ = prepared_rows(tmp_path / "chatml", no_template, chat, {"type": "chat_template"},
                                chat_template="chatml")
    assert split(prepared[0], no_template)[1] == "Hello<|im_end|>"


def test_data_files_are_found_relative_to_a_folder_path(tmp_path, tokenizer):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"instruction": "Say hello.", "output": "Hello"}])
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(folder), "data_files": "train.jsonl",
                                                                  "type": "alpaca"}],
                            "dataset_prepared_path": str(tmp_path / "prepared")})
    assert len(prepare(cfg, tokenizer).train) == 1


def test_compressed_json_lines_read_as_the_plain_file(tmp_path, tokenizer):
    """`train.jsonl.gz` / `.xz` / `.bz2` are read as Hugging Face `datasets` reads them: the same prepared rows as
    the plain file (they were refused: a format it cannot tell, or, with `ds_type: json`, text that is not UTF-8 with
    advice to run iconv on a gzip file); a folder of them is a folder of data files, but not beside their plain
    copy."""
    import bz2
    import gzip
    import lzma

    rows = [{"instruction": f"Say {word}.", "output": word} for word in ("hello", "red", "blue", "one")]
    plain = write_jsonl(tmp_path / "train.jsonl", rows)
    compressed = {"gz": gzip.compress, "xz": lzma.compress, "bz2": bz2.compress}
    prepared = {}
    for suffix in ("", *compressed):
        folder = tmp_path / (suffix or "plain")
        folder.mkdir()
        target = folder / f"train.jsonl{'.' + suffix if suffix else ''}"
        target.write_bytes(compressed[suffix](plain.read_bytes()) if suffix else plain.read_bytes())
        for path in (target, folder):
            cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(path), "type": "alpaca"}],
                                    "dataset_prepared_path": str(tmp_path / "prepared" / target.name)})
            result = prepare(cfg, tokenizer, force=True)
            prepared[path] = (result.stats.train_rows, [list(result.train[i]["input_ids"])
                                                        for i in range(len(result.train))])
    expected = prepared[tmp_path / "plain" / "train.jsonl"]
    assert expected[0] == len(rows)
    assert all(found == expected for found in prepared.values()), list(prepared)
    (tmp_path / "gz" / "train.jsonl").write_bytes(plain.read_bytes())  # (a folder of both would read each row twice)
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(tmp_path / "gz"), "type": "alpaca"}],
                            "dataset_prepared_path": str(tmp_path / "prepared" / "twice")})
    with pytest.raises(UserError, match=r"train\.jsonl\.gz is a compressed copy of .*train\.jsonl"):
        prepare(cfg, tokenizer)


def test_a_compression_python_cannot_read_names_it_and_the_fix(tmp_path, tokenizer, monkeypatch):
    """`.jsonl.zst` needs the `zstandard` package (as `datasets` does): without it, one line naming the file, the
    compression and the install."""
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)  # (as if not installed, wherever it is)
    data = tmp_path / "train.jsonl.zst"
    data.write_bytes(b"(\xb5/\xfd")  # zstd's magic number
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(data), "type": "alpaca"}],
                            "dataset_prepared_path": str(tmp_path / "prepared")})
    with pytest.raises(UserError, match=r"train\.jsonl\.zst is compressed with zstd.*pip install zstandard"):
        prepare(cfg, tokenizer)
