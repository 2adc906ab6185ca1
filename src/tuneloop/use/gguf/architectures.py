"""The model families GGUF export writes, in llama.cpp's terms.

What the `gguf` package (llama.cpp's own writer) does not know, and llama.cpp's conversion script does:

* LLaMA-architecture files hold the query and key projections with each head's rows interleaved for llama.cpp's
  rotary kernel (HF stores the two rotary halves one after the other); `permute_qk` entries reorder them.
  Qwen2/3 run llama.cpp's NeoX-style rotary, which reads HF's layout as it is.
* A model whose head is tied to its input embedding has no `output.weight` in the file: llama.cpp (and
  transformers' GGUF reader) then use the embedding as the head.
* Mistral has no architecture of its own in llama.cpp: it is written as `llama`, as the conversion script does.
* Gemma's RMS norms compute x·(1 + w) in transformers and x·w in llama.cpp: the file holds w + 1. llama.cpp
  fixes two things transformers configures for Gemma (the layers that attend within a sliding window, the
  queries' scale): a config that differs is refused rather than written into a file that computes something
  else. Gemma 3's local rope base goes into `rope.freq_base_swa`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

from tuneloop.errors import UserError
from tuneloop.registry import Registry


@dataclass(frozen=True)
class GgufArchitecture:
    gguf_name: str  # llama.cpp's `general.architecture`
    permute_qk: bool  # the query/key rows interleaved per head (llama.cpp's `llama` rotary layout)
    rope_freqs_tensor: bool = False  # LLaMA-3.1's rope scaling is written as a `rope_freqs.weight` tensor
    norm_offset: float = 0.0  # added to every RMS norm weight (Gemma's 1 + w)
    family_metadata: Callable | None = None  # (writer, config) -> None: the family's own keys
    family_check: Callable | None = None  # (config) -> None: a UserError for what llama.cpp would compute otherwise


def _gemma_checks(config, sliding_every: int, layers_27b: int) -> None:
    """What llama.cpp hard-codes for this Gemma, checked against the config."""
    name = config.model_type
    dim = head_dim(config)
    scalar = getattr(config, "query_pre_attn_scalar", dim)
    per_head = config.hidden_size // config.num_attention_heads
    if scalar != dim and not (scalar == per_head and config.num_hidden_layers == layers_27b):
        raise UserError(f"export: this {name} scales its queries by query_pre_attn_scalar {scalar}; llama.cpp "
                        f"scales them by the head dimension {dim} (hidden / heads only for the 27B model), so the "
                        "GGUF would compute another model")
    expected = ["full_attention" if layer % sliding_every == sliding_every - 1 else "sliding_attention"
                for layer in range(config.num_hidden_layers)]
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and list(layer_types) != expected and getattr(config, "sliding_window", None):
        raise UserError(f"export: this {name} attends within a sliding window on layers {layer_types}; llama.cpp's "
                        f"{name} fixes one full-attention layer in {sliding_every}, so the GGUF would compute "
                        "another model")


def _gemma2_check(config) -> None:
    _gemma_checks(config, sliding_every=2, layers_27b=46)


def _gemma2_metadata(writer, config) -> None:
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if config.sliding_window:
        writer.add_sliding_window(int(config.sliding_window))


def _gemma3_check(config) -> None:
    _gemma_checks(config, sliding_every=6, layers_27b=62)
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        raise UserError("export: this gemma3 caps its logits (attn/final_logit_softcapping); llama.cpp's gemma3 "
                        "does not, so the GGUF would compute another model")


def _gemma3_metadata(writer, config) -> None:
    if config.sliding_window:
        writer.add_sliding_window(int(config.sliding_window))
    local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention", {})
    writer.add_rope_freq_base_swa(float(local.get("rope_theta", getattr(config, "rope_local_base_freq", 10000.0))))


# HF `model_type` -> what llama.cpp calls it
GGUF_ARCHITECTURES: Registry[GgufArchitecture] = Registry("GGUF architecture", "model_type")
GGUF_ARCHITECTURES.add("llama", GgufArchitecture("llama", permute_qk=True, rope_freqs_tensor=True))
GGUF_ARCHITECTURES.add("mistral", GgufArchitecture("llama", permute_qk=True))
GGUF_ARCHITECTURES.add("qwen2", GgufArchitecture("qwen2", permute_qk=False))
GGUF_ARCHITECTURES.add("qwen3", GgufArchitecture("qwen3", permute_qk=False))
GGUF_ARCHITECTURES.add("gemma2", GgufArchitecture("gemma2", permute_qk=False, norm_offset=1.0,
                                                  family_metadata=_gemma2_metadata, family_check=_gemma2_check))
GGUF_ARCHITECTURES.add("gemma3_text", GgufArchitecture("gemma3", permute_qk=False, norm_offset=1.0,
                                                       family_metadata=_gemma3_metadata, family_check=_gemma3_check))


def architecture_of(config) -> GgufArchitecture:
    model_type = getattr(config, "model_type", None)
    if model_type not in GGUF_ARCHITECTURES:
        raise UserError(f"export: GGUF export does not know the architecture {model_type!r} "
                        f"({', '.join(config.architectures or [])}); it writes {GGUF_ARCHITECTURES.choices()}")
    return GGUF_ARCHITECTURES[model_type]


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """transformers 5 keeps rope_theta and the scaling in `rope_parameters`; older configs at the top level."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in parameters:  # per layer type (Gemma 3): the file's rope is the full-attention layers'
        parameters = dict(parameters["full_attention"])
    if "rope_theta" not in parameters and getattr(config, "rope_theta", None) is not None:
        parameters["rope_theta"] = config.rope_theta
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        parameters = {**scaling, **parameters}
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    return parameters


def check_exportable(config, arch: GgufArchitecture) -> None:
    """Said before the weights load: a rope the file cannot state, a family setting llama.cpp does not follow."""
    kind = rope_parameters(config)["rope_type"]
    if kind not in ("default", "linear", "yarn") and not (kind == "llama3" and arch.rope_freqs_tensor):
        raise UserError(f"export: rope scaling {kind!r} ({config.model_type}) has no GGUF form tuneloop writes; "
                        "it writes default, linear, yarn and (LLaMA) llama3")
    rope = rope_parameters(config)
    if kind == "yarn" and rope.get("attention_factor") is not None:
        expected = 0.1 * math.log(float(rope["factor"])) + 1.0  # the scale llama.cpp applies, from the factor alone
        if abs(float(rope["attention_factor"]) - expected) > 1e-6:
            raise UserError(f"export: this model's yarn rope sets attention_factor {rope['attention_factor']}; "
                            f"llama.cpp scales attention by 0.1·ln(factor) + 1 = {expected:.4f} whatever the config "
                            "says, so the GGUF would compute another model")
    if arch.family_check is not None:
        arch.family_check(config)


def add_metadata(writer, config, arch: GgufArchitecture) -> list[str]:
    """The architecture's keys (llama.cpp's names) into the writer; returns warnings for what llama.cpp will
    compute differently."""
    import gguf

    warnings = []
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                                 or config.max_position_embeddings))
        # what transformers' yarn takes from the config, when the config sets it (llama.cpp's defaults otherwise)
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    # llama3: written as the rope_freqs tensor (extra_tensors); others were refused by check_exportable
    if arch.family_metadata is not None:
        arch.family_metadata(writer, config)
        return warnings
    window = getattr(config, "sliding_window", None)
    if window and window < config.max_position_embeddings and getattr(config, "use_sliding_window", True):
        warnings.append(f"the model attends within a sliding window of {window} tokens; llama.cpp's "
                        f"{arch.gguf_name} attends over the whole context (the same up to {window} tokens)")
    return warnings


def extra_tensors(config, arch: GgufArchitecture) -> dict:
    """Tensors llama.cpp needs that the HF model computes instead: LLaMA-3.1's rope frequency factors."""
    import numpy as np

    rope = rope_parameters(config)
    if not (arch.rope_freqs_tensor and rope["rope_type"] == "llama3"):
        return {}
    dim = head_dim(config)
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelength, high_wavelength = original / low, original / high
    factors = []
    for index in range(0, dim, 2):
        wavelength = 2 * math.pi * base ** (index / dim)  # 2π / frequency
        if wavelength < high_wavelength:
            factors.append(1.0)
        elif wavelength > low_wavelength:
            factors.append(factor)
        else:  # between the two: interpolated as transformers' llama3 rope does
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.asarray(factors, dtype=np.float32)}


def interleave_rotary_rows(weight, heads: int):
    """HF's rotary halves (rows [0:d/2] pair with [d/2:d] in each head) -> llama.cpp's interleaved pairs."""
    shape = weight.shape
    return (weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape))


@dataclass(frozen=True)
class FileTensor:
    name: str  # llama.cpp's name
    shape: tuple[int, ...]
    values: Callable  # () -> a float32 numpy array in llama.cpp's layout, computed when written


def file_tensors(state: dict, config, arch: GgufArchitecture) -> list[FileTensor]:
    """The file's tensors in order, each computed only when written (one float32 copy at a time in memory); a
    tensor llama.cpp has no name for is an error naming it (the file would load without it)."""
    import gguf

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.gguf_name.upper()), config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tensors = []
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue  # the head is the embedding: llama.cpp reuses token_embd when output.weight is absent
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(f"export: the tensor {name} of this {config.model_type} model has no llama.cpp name; "
                            "the GGUF file would be incomplete")
        rotary_heads = None
        if arch.permute_qk and ".attn_q." in gguf_name:
            rotary_heads = heads
        elif arch.permute_qk and ".attn_k." in gguf_name:
            rotary_heads = kv_heads
        offset = arch.norm_offset if name.endswith("norm.weight") else 0.0
        values = partial(_as_file_array, tensor, rotary_heads, offset)
        tensors.append(FileTensor(gguf_name, tuple(tensor.shape), values))
    for name, array in extra_tensors(config, arch).items():
        tensors.append(FileTensor(name, tuple(array.shape), lambda array=array: array))
    return tensors


def _as_file_array(tensor, rotary_heads: int | None, offset: float):
    import torch

    array = tensor.detach().to(torch.float32).cpu().numpy()
    if offset:
        array = array + offset
    return interleave_rotary_rows(array, rotary_heads) if rotary_heads else array
