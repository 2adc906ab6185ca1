"""The export: the model folder (a LoRA adapter merged into its base in memory) as one GGUF file, and an Ollama
Modelfile beside it; how the two files are kept safe is files.py's.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tuneloop import __version__, run_files
from tuneloop.errors import UserError
from tuneloop.use.folders import ModelFolder
from tuneloop.use.gguf.architectures import (FileTensor, add_metadata, architecture_of, check_exportable, file_tensors,
                                             head_dim)
from tuneloop.use.gguf.chat import ChatFacts, chat_facts, modelfile
from tuneloop.use.gguf.files import (MARKER_KEY, WritingLock, check_outputs, gguf_marker, interrupted_by_termination,
                                     make_folder, modelfile_path, modelfile_text, publish, stale_temporaries,
                                     write_temporary)
from tuneloop.use.gguf.quantize import QUANTIZATIONS, encode, stored_bytes, tensor_type
from tuneloop.use.gguf.vocab import GgufVocab, add_vocab, read_vocab


@dataclass(frozen=True)
class Export:
    gguf: Path
    modelfile: Path
    tensors: int
    bytes: int


def export_gguf(folder: ModelFolder, output: Path, quant: str, *, overwrite: bool = False,
                trust_remote_code: bool = False, base_quantization=None, say=print) -> Export:
    """`base_quantization`: the bitsandbytes config a QLoRA run's base was loaded with (the adapter is merged into that
    base dequantized, as merge-lora does). `output` is written by one export at a time (files.WritingLock)."""
    check_outputs(output, overwrite)
    lock = WritingLock(output)
    with interrupted_by_termination():  # (SIGTERM releases the lock and removes its file, and the temporaries)
        lock.take()  # (before the model loads: a second export of the file is refused at once)
        try:
            return _export(folder, output, quant, lock, overwrite, trust_remote_code, base_quantization, say)
        finally:
            lock.release()


def _export(folder: ModelFolder, output: Path, quant: str, lock: WritingLock, overwrite: bool,
            trust_remote_code: bool, base_quantization, say) -> Export:
    from transformers import AutoConfig

    from tuneloop.use.folders import load_model_from, load_tokenizer_of

    quantization = QUANTIZATIONS[quant]
    config_source = folder.base if folder.is_adapter else folder.path
    try:
        config = AutoConfig.from_pretrained(config_source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(f"export: cannot read the model config of {config_source}: {error}") from None
    arch = architecture_of(config)  # an unknown family, or a setting llama.cpp would not follow, is said before
    check_exportable(config, arch)  # the weights load
    tokenizer = load_tokenizer_of(folder)
    if folder.is_adapter and base_quantization is not None:
        from tuneloop.use.merge import adapter_on_dequantized_base

        model = adapter_on_dequantized_base(folder, base_quantization, trust_remote_code, len(tokenizer))
    else:
        model = load_model_from(folder, "auto", trust_remote_code=trust_remote_code, vocabulary=len(tokenizer))
    if folder.is_adapter:
        model = model.merge_and_unload()  # in memory: the adapter folder is left as it is
    config = model.config
    vocab = read_vocab(tokenizer, config.vocab_size)
    facts = chat_facts(tokenizer)
    if facts.turn_end is not None and tokenizer.convert_tokens_to_ids(facts.turn_end) != vocab.special_ids.get("eos"):
        vocab.special_ids["eot"] = tokenizer.convert_tokens_to_ids(facts.turn_end)
    tensors = file_tensors(model.state_dict(), config, arch)
    types = [tensor_type(tensor.name, tensor.shape, quantization) for tensor in tensors]
    total = sum(stored_bytes(tensor.shape, kind) for tensor, kind in zip(tensors, types))
    for line in header(folder, output, quant, config, arch.gguf_name, vocab, facts, tensors, types, total):
        say(line)
    check_free_space(output.parent, total)
    make_folder(output.parent)
    lock.take()  # (now that the folder exists, where it did not)
    for stale in stale_temporaries(output):
        if lock.unguarded:  # (whether its writer is still running cannot be known)
            say(f"note: left {stale}: this file system gives no locks, so whether the export that wrote it still "
                "runs cannot be known; remove it yourself once none does")
            continue
        stale.unlink(missing_ok=True)  # (its writer is gone: every export holds the lock while its temporaries exist)
        say(f"removed {stale}, what an earlier export that was killed left")
    stops = [token for token in dict.fromkeys([facts.turn_end, tokenizer.eos_token]) if token]
    text = modelfile_text(modelfile(output.name, modelfile_path(output).name, facts, stops))
    written = []
    try:
        gguf_temp, warnings = write_temporary(output, lambda path: _write_file(
            path, folder, quantization, config, arch, vocab, facts, tensors, types, total))
        written.append(gguf_temp)
        modelfile_temp, _ = write_temporary(modelfile_path(output),
                                            lambda path: path.write_text(text, encoding="utf-8"))
        written.append(modelfile_temp)
        check_outputs(output, overwrite)  # again: the paths may have been taken while the model loaded
        publish([(gguf_temp, output), (modelfile_temp, modelfile_path(output))])
    except BaseException:
        for temp in written:
            temp.unlink(missing_ok=True)
        raise
    for warning in warnings:
        say(f"warning: {warning}")
    if run_files.is_tuneloop_run(output.parent):
        run_files.record(output.parent, output.name, modelfile_path(output).name)  # `train --overwrite` may clear
    return Export(output, modelfile_path(output), len(tensors), total)


def header(folder, output, quant, config, gguf_arch, vocab: GgufVocab, facts: ChatFacts, tensors, types, total):
    from collections import Counter

    counts = Counter(kind.name for kind in types)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    special = ", ".join(f"{name} {vocab.tokens[index]}" for name, index in vocab.special_ids.items())
    template = ("none: prompts are plain text" if facts.template is None else
                f"the run's ({len(facts.template)} characters); Ollama TEMPLATE: "
                + (f"{facts.family.name}, checked by rendering" if facts.family else "not translated"))
    source = f"{folder.path} (LoRA adapter merged into {folder.base})" if folder.is_adapter else str(folder.path)
    yield f"export      {source} -> {output}"
    yield (f"  model     {gguf_arch} ({config.model_type}): {config.num_hidden_layers} layers, hidden "
           f"{config.hidden_size}, {config.num_attention_heads} heads ({kv_heads} kv, dim {head_dim(config)}), "
           f"context {config.max_position_embeddings}"
           + (", head tied to the embedding" if getattr(config, "tie_word_embeddings", False) else ""))
    yield (f"  tensors   {len(tensors)}, {total / 1e6:.1f} MB as {quant}: "
           + ", ".join(f"{count} {name}" for name, count in sorted(counts.items())))
    yield (f"  tokenizer {vocab.model}" + (f" (pre {vocab.pre})" if vocab.pre else "")
           + f", {len(vocab.tokens) - vocab.padded} tokens" + (f" + {vocab.padded} padding" if vocab.padded else "")
           + f", {len(vocab.merges)} merges; {special}; adds bos: {'yes' if vocab.add_bos else 'no'}")
    yield f"  template  {template}"
    if vocab.note:
        yield f"  note      {vocab.note}"


def check_free_space(folder: Path, needed: int) -> None:
    existing = next((parent for parent in [folder, *folder.parents] if parent.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    if free < needed + (64 << 20):  # the file and some room for everything else
        raise UserError(f"export: the file needs {needed / 1e9:.2f} GB and {existing} has {free / 1e9:.2f} GB free; "
                        "free some space or choose another --output (nothing was written)")


def _write_file(path: Path, folder: ModelFolder, quantization, config, arch, vocab: GgufVocab, facts: ChatFacts,
                tensors: list[FileTensor], types: list, total: int) -> list[str]:
    import gguf
    import numpy as np
    from tqdm.auto import tqdm

    writer = gguf.GGUFWriter(path, arch.gguf_name)
    writer.add_name(folder.path.resolve().name)
    file_type = gguf.LlamaFileType[quantization.file_type]
    writer.add_string(MARKER_KEY, gguf_marker(__version__, int(file_type), len(tensors), total))
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    warnings = add_metadata(writer, config, arch)
    add_vocab(writer, vocab)
    if facts.template:
        writer.add_chat_template(facts.template)
    for tensor, kind in zip(tensors, types):
        byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor.shape, kind) if kind.name not in ("F32", "F16") \
            else tensor.shape
        dtype = {"F32": np.float32, "F16": np.float16}.get(kind.name, np.uint8)
        writer.add_tensor_info(tensor.name, byte_shape, np.dtype(dtype), stored_bytes(tensor.shape, kind),
                               raw_dtype=None if kind.name in ("F32", "F16") else kind)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=None, leave=False) as bar:
        for tensor, kind in zip(tensors, types):
            data = encode(tensor.values(), kind)
            writer.write_tensor_data(data)
            bar.update(data.nbytes)
    writer.close()
    return warnings
