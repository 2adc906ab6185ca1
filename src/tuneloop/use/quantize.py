"""`tuneloop quantize`: a QAT run's plain model quantized for real by torchao, as axolotl's `quantize` does.

The Linear layers (and the input embedding, with `qat.quantize_embedding`) are quantized with the torchao config the
run's fake quantization was derived from (qat.ptq_configs): int4/int8 weights in groups with their scales, int8
activations quantized per token as the model runs. The folder is saved the way transformers reloads it:
`config.json` carries a TorchAoConfig, and `from_pretrained(folder)` (with torchao installed) rebuilds the
quantized tensors. Tested on CPU with torchao 0.18 and transformers 5.24 (tests/test_qat.py).

How it quantizes is what the run trained for: the `qat:` block the run recorded in its run_config.yml (beside the
model). A CONFIG given instead of --model may only repeat it: edited since (trained at int4, int8 asked), the model
would be quantized to a grid it never trained on, and QAT's point would be lost without a word.

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


# what quantize reads of the `qat:` block (when the fake quantization started changes the weights, not how they are
# quantized)
QUANTIZE_READS = ("weight_dtype", "activation_dtype", "group_size", "quantize_embedding")


def qat_settings(cfg, folder):
    """The config.qat_block.QATBlock to quantize `folder` (a use.folders.ModelFolder) by: the one its run recorded
    in run_config.yml; `cfg` (CONFIG's, None for --model) must agree with it on QUANTIZE_READS. A folder without
    that record (an older tuneloop's run) goes by CONFIG's."""
    run_config = folder.path / run_files.RUN_CONFIG
    recorded = run_files.read_yaml(run_config)
    if cfg is None and recorded is None:
        raise UserError(f"quantize: {folder.path} has no {run_files.RUN_CONFIG} to say how to quantize it; give the "
                        "run's CONFIG instead of --model (its `qat:` block)")
    trained = _recorded_qat(recorded, run_config) if recorded is not None else None
    if cfg is not None and recorded is not None:
        _check_agrees(cfg.qat, trained, folder.path, run_config)
    settings = trained if recorded is not None else cfg.qat
    if settings is None:
        where = run_config if recorded is not None else "CONFIG"
        raise UserError(f"quantize: {where} has no `qat:` block, which says how to quantize (weight_dtype, "
                        "activation_dtype, group_size): quantize is for a model trained with one")
    return settings


def _recorded_qat(recorded: dict, run_config: Path):
    from pydantic import ValidationError

    from tuneloop.config.qat_block import QATBlock

    if recorded.get("qat") is None:
        return None
    try:
        return QATBlock.model_validate(recorded["qat"])
    except ValidationError as error:
        raise UserError(f"quantize: {run_config}'s `qat:` block does not read ({error.errors()[0]['msg']}): it is "
                        "the record of how the run trained; fix it there") from None


def _check_agrees(asked, trained, output_dir: Path, run_config: Path) -> None:
    """CONFIG's `qat:` block against the run's: any difference quantize would follow is refused, naming both."""
    fix = (f"put CONFIG's `qat:` back as the run had it, or give --model {output_dir}, which quantizes as the run "
           "recorded")
    if asked is None and trained is None:
        return
    if asked is None:
        raise UserError(f"quantize: CONFIG has no `qat:` block, and the run in {output_dir} trained with one "
                        f"({words(trained)}; {run_config}): {fix}")
    if trained is None:
        raise UserError(f"quantize: CONFIG's `qat:` block asks for {words(asked)}, and the run in {output_dir} "
                        f"trained without one ({run_config} has none): its model never trained for that grid; "
                        "train with the block (into another output_dir) to quantize it")
    differ = [key for key in QUANTIZE_READS if getattr(asked, key) != getattr(trained, key)]
    if differ:
        said = ", ".join(f"qat.{key}: {_value(getattr(asked, key))}" for key in differ)
        recorded = ", ".join(f"qat.{key}: {_value(getattr(trained, key))}" for key in differ)
        raise UserError(f"quantize: CONFIG says {said}, and the run in {output_dir} trained with {recorded} "
                        f"({run_config}): a model quantized to another grid than it trained on loses what QAT "
                        f"learned; {fix}")


def _value(value) -> str:
    return "none" if value is None else str(value).lower()


def words(settings) -> str:
    """`int4 weights in groups of 32, int8 activations`: what the quantized model holds."""
    activations = ", int8 activations" if settings.activation_dtype else ""
    embedding = ", the embedding too" if settings.quantize_embedding else ""
    return f"{settings.weight_dtype} weights in groups of {settings.group_size}{activations}{embedding}"


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
