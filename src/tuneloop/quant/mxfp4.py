"""gpt-oss's MXFP4 checkpoints, loaded as trainable weights: axolotl's `model_quantization_config: Mxfp4Config`
with `model_quantization_config_kwargs: {dequantize: true}`.

gpt-oss ships its MoE experts in MXFP4: each `experts.gate_up_proj` / `experts.down_proj` is stored as `*_blocks`
(FP4 E2M1 values, two a byte, 32 to a block) and `*_scales` (one E8M0 power of two per block), and its config.json
says `quantization_config: {quant_method: mxfp4}`. transformers 5.24 (quantizers/quantizer_mxfp4.py) either keeps
them packed for its Triton kernels, which only run the forward (the quantizer says it is not trainable; on a CPU
without the kernels it falls back to dequantizing), or, with `Mxfp4Config(dequantize=True)`, unpacks them as they
load into the dtype of the parameter they load into (integrations/mxfp4.py, Mxfp4Dequantize): the run's weights
dtype (fp32, or bf16/fp16 with `bfloat16`/`float16`), not always the bf16 its log message says. An FP4 value times a
power of two is exact in any of them, and the loaded model is the dense model, its quantization_config dropped; so
the plan counts it as it counts any model (plan/memory.py) and says the dequantization in its model line.
"""

from __future__ import annotations

from tuneloop.config.schema import MXFP4_CLASS
from tuneloop.errors import UserError


def checkpoint_is_mxfp4(config) -> bool:
    """The checkpoint's config says its weights are stored in MXFP4 (gpt-oss's expert layout)."""
    quantization = getattr(config, "quantization_config", None)
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    return str(getattr(method, "value", method)) == "mxfp4"


def loaded_dtype_words(cfg) -> str:
    """The dtype the dequantized experts load in: model/load.py's weights_dtype, in the plan's words."""
    return "bf16" if cfg.bfloat16 else "fp16" if cfg.float16 else "fp32"


def dequantizes_mxfp4(cfg, config) -> bool:
    """Whether the run's base loads through Mxfp4Config(dequantize=True): its checkpoint is MXFP4 and the config
    says so. Refused where only one of them says it: packed MXFP4 experts would not train (and on a GPU with the
    Triton kernels transformers keeps them packed, so a full fine-tune would leave them out in silence); and on a
    checkpoint without MXFP4 weights the keys would do nothing."""
    if cfg.from_scratch:  # random weights: nothing loads (config/rules.py refuses the keys there)
        return False
    source = cfg.base_model
    stored = checkpoint_is_mxfp4(config)
    asked = cfg.model_quantization_config == MXFP4_CLASS
    if stored and not asked:
        raise UserError(f"model: {source} stores its MoE experts in MXFP4 (its config.json's quantization_config), "
                        "which cannot be trained as they are: set `model_quantization_config: Mxfp4Config` and "
                        "`model_quantization_config_kwargs: {dequantize: true}` to load them as "
                        f"{loaded_dtype_words(cfg)} weights")
    if asked and not stored:
        raise UserError(f"config: `model_quantization_config: {MXFP4_CLASS}` dequantizes MXFP4 weights as they load, "
                        f"and {source} holds none (its config.json has no quantization_config with `quant_method: "
                        "mxfp4`): remove it and `model_quantization_config_kwargs`")
    return stored


def mxfp4_loading_config(cfg):
    """transformers' config that unpacks the MXFP4 experts as they load: Mxfp4Config with the config's settings
    (config/rules.py has held them to `dequantize: true`)."""
    from transformers import Mxfp4Config

    return Mxfp4Config(**cfg.model_quantization_config_kwargs)
