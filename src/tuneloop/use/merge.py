"""`tuneloop merge-lora`: a LoRA adapter folded into its base, saved as a plain Hugging Face model folder
that loads without peft (for serving, conversion, or another round of training).

The merged model is written into a hidden sibling folder and renamed into place when complete, so a kill
or a full disk never leaves a half-written folder where `from_pretrained` would find it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tuneloop import run_files
from tuneloop.errors import UserError
from tuneloop.run_files import ADAPTER_CONFIG
from tuneloop.use.folders import ModelFolder, adapter_base


def adapter_folder(path: str | Path, flag: str, base: str | None) -> ModelFolder:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"merge-lora: {flag} {folder} is not a folder")
    if not (folder / ADAPTER_CONFIG).is_file():
        if (folder / "config.json").is_file():
            raise UserError(f"merge-lora: {flag} {folder} is already a full model (config.json, no "
                            f"{ADAPTER_CONFIG}): there is no adapter to merge; use it as it is")
        raise UserError(f"merge-lora: {flag} {folder} holds no LoRA adapter ({ADAPTER_CONFIG} is missing)")
    return ModelFolder(folder, base or adapter_base(folder))


def check_output_free(output: Path) -> None:
    """Never written over: the folder may hold something that is not ours."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"merge-lora: {output} exists and is not empty; choose another folder with --output, or "
                        "remove it yourself")


MERGE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the base's own


def merge_lora(folder: ModelFolder, output: Path, trust_remote_code: bool = False, quantization=None,
               dtype: str = "auto") -> Path:
    """The merged model and the adapter's tokenizer (the run's, with its chat template) in `output`, its weights in
    `dtype` ("auto": the base's own). `quantization`: how a QLoRA / 8-bit run loaded its base
    (adapters.QuantizedBase); the adapter is then merged into that base dequantized (the weights it trained on)."""
    import torch

    check_output_free(output)
    from tuneloop.data.images import is_vision_config
    from tuneloop.use.folders import load_model_from, load_tokenizer_of
    from tuneloop.use.vision import save_processor_of

    tokenizer = load_tokenizer_of(folder)
    wanted = dtype if dtype == "auto" else getattr(torch, dtype)
    if quantization is not None:
        model = adapter_on_dequantized_base(folder, quantization, trust_remote_code, len(tokenizer), wanted)
    else:  # the base in its own dtype (or the one asked): what serving the base in that dtype computes with
        model = load_model_from(folder, wanted, trust_remote_code=trust_remote_code, vocabulary=len(tokenizer))
    merged = model.merge_and_unload()
    merged.config.use_cache = True  # for whoever generates next
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}-", dir=output.parent))
    try:
        merged.save_pretrained(temp)  # (transformers 5 writes safetensors only)
        tokenizer.save_pretrained(temp)
        if is_vision_config(merged.config):  # its processor too, as the run saved it beside the adapter
            save_processor_of(folder, temp, tokenizer, trust_remote_code)
        run_files.make_readable(temp)  # mkdtemp's folder is private (0700); a model is for others to read too
        run_files.fsync_files(temp)
        check_output_free(output)  # again: the folder may have been filled while we merged
        if output.parent.resolve() == folder.path.resolve() and run_files.is_tuneloop_run(folder.path):
            run_files.record(folder.path, output.name)  # the run's: `train --overwrite` may clear it
        os.replace(temp, output)  # over an empty folder, or none: atomic within one file system
        run_files.fsync_folder_entry(output.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # ours alone: the output folder was never touched
        raise
    return output


def adapter_on_dequantized_base(folder: ModelFolder, quantization, trust_remote_code: bool, vocabulary: int,
                                dtype="auto"):
    """The adapter on its base loaded quantized as the run loaded it, then dequantized (transformers' own
    `dequantize`) to `dtype` ("auto": the base's own): merging into the full-precision weights would add the
    adapter to weights it never saw."""
    import torch
    from transformers import AutoConfig

    from tuneloop.quant.quantized_experts import dequantize_experts
    from tuneloop.use.folders import attach_adapter, check_base_reachable, loader_of

    check_base_reachable(folder)
    try:
        own_dtype = getattr(AutoConfig.from_pretrained(folder.base, trust_remote_code=trust_remote_code), "dtype", None)
        # quantized from the weights in the dtype the run loaded them in
        base = loader_of(folder, trust_remote_code=trust_remote_code).from_pretrained(
            folder.base, quantization_config=quantization.bnb_config, dtype=quantization.dtype,
            trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(f"merge-lora: cannot load {folder.base}, the quantized base of the adapter in {folder.path} "
                        f"({type(error).__name__}: {error})") from None
    quantization.quantize_experts(base)  # (quantize_moe_experts: the experts as the run trained on them)
    base = base.dequantize()
    dequantize_experts(base)
    target = own_dtype if dtype == "auto" else dtype
    if isinstance(target, str):  # a config may spell it
        target = getattr(torch, target, None)
    if isinstance(target, torch.dtype):
        base = base.to(target)
    if vocabulary > base.get_input_embeddings().weight.shape[0]:
        from tuneloop.model.load import grow_embeddings

        grow_embeddings(base, vocabulary)
    return attach_adapter(base, folder.path)
