"""`tuneloop quantize`: a QAT run's plain model quantized for real by torchao, as axolotl's `quantize` does.

The Linear layers (and the input embedding, with `qat.quantize_embedding`) are quantized with the torchao config the
run's fake quantization was derived from (qat.ptq_configs): int4/int8 weights in groups with their scales, int8
activations quantized per token as the model runs. The folder is saved the way transformers reloads it:
`config.json` carries a TorchAoConfig, and `from_pretrained(folder)` (with torchao installed) rebuilds the
quantized tensors. Tested on CPU with torchao 0.18 and transformers 5.24 (tests/test_qat.py).

A model with tied input and output embeddings is untied in the quantized folder: its output layer is quantized as
a Linear while the embedding stays as it is (or is quantized as an embedding), so the two are different tensors,
and transformers' loader would otherwise try to tie them back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tuneloop import run_files
from tuneloop.errors import UserError


def check_output_free(output: Path) -> None:
    """Never written over: the folder may hold something that is not ours."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"quantize: {output} exists and is not empty; choose another folder with --output, or "
                        "remove it yourself")


def quantize_folder(folder, settings, output: Path, trust_remote_code: bool = False) -> Path:
    """`folder` (a use.folders.ModelFolder holding a full model) quantized as `settings` (a
    config.qat_block.QATBlock) say, with its tokenizer, written whole into `output`."""
    from tuneloop.quant.qat import check_fits, is_embedding, ptq_configs, torchao_quantization
    from tuneloop.use.folders import load_model_from, load_tokenizer_of

    if folder.is_adapter:
        raise UserError(f"quantize: {folder.path} holds a LoRA adapter; a QAT run trains the whole model (merge an "
                        "adapter first with `tuneloop merge-lora`)")
    check_output_free(output)
    tokenizer = load_tokenizer_of(folder)
    model = load_model_from(folder, "auto", trust_remote_code=trust_remote_code)
    check_fits(settings, model)
    quantization = torchao_quantization()
    from transformers import TorchAoConfig
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    linear, embedding = ptq_configs(settings)
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    quantization.quantize_(model, linear)
    if embedding is not None:
        quantization.quantize_(model, embedding, filter_fn=is_embedding)
    if tied:
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    # (as axolotl does: a torchao quantizer on the model makes save_pretrained write the quantized tensors' parts)
    ao_config = TorchAoConfig(quant_type=linear, include_input_output_embeddings=embedding is not None)
    model.config.quantization_config = ao_config
    model.hf_quantizer = TorchAoHfQuantizer(ao_config)
    model.config.use_cache = True  # for whoever generates next
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}-", dir=output.parent))
    try:
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        run_files.make_readable(temp)  # mkdtemp's folder is private (0700)
        run_files.fsync_files(temp)
        check_output_free(output)  # again: the folder may have been filled meanwhile
        if output.parent.resolve() == folder.path.resolve() and run_files.is_tuneloop_run(folder.path):
            run_files.record(folder.path, output.name)  # the run's: `train --overwrite` may clear it
        os.replace(temp, output)
        run_files.fsync_folder_entry(output.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return output
