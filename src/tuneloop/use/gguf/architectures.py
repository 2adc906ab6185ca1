"""The model families GGUF export writes, in llama.cpp's terms.

What the `gguf` package (llama.cpp's own writer) does not know, and llama.cpp's conversion script does:

* LLaMA-architecture files hold the query and key projections with each head's rows interleaved for llama.cpp's
  rotary kernel (HF stores the two rotary halves one after the other); `permute_qk` entries reorder them.
  Qwen2/3 run llama.cpp's NeoX-style rotary, which reads HF's layout as it is.
* A model whose head is tied to its input embedding has no `output.weight` in the file: llama.cpp (and
  transformers' GGUF reader) then use the embedding as the head.
* Mistral has no architecture of its own in llama.cpp: it is written as `llama`, as the conversion script does.
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


# HF `model_type` -> what llama.cpp calls it
GGUF_ARCHITECTURES: Registry[GgufArchitecture] = Registry("GGUF architecture", "model_type")
GGUF_ARCHITECTURES.add("llama", GgufArchitecture("llama", permute_qk=True, rope_freqs_tensor=True))
GGUF_ARCHITECTURES.add("mistral", GgufArchitecture("llama", permute_qk=True))
GGUF_ARCHITECTURES.add("qwen2", GgufArchitecture("qwen2", permute_qk=False))
GGUF_ARCHITECTURES.add("qwen3", GgufArchitecture("qwen3", permute_qk=False))


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
    if "rope_theta" not in parameters and getattr(config, "rope_theta", None) is not None:
        parameters["rope_theta"] = config.rope_theta
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        parameters = {**scaling, **parameters}
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    return parameters


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
    elif kind == "llama3" and arch.rope_freqs_tensor:
        pass  # written as the rope_freqs tensor (extra_tensors)
    elif kind != "default":
        raise UserError(f"export: rope scaling {kind!r} ({config.model_type}) has no GGUF form tuneloop writes; "
                        "it writes default, linear, yarn and (LLaMA) llama3")
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
    source: str | None  # the HF tensor it is made from (None: computed, as rope_freqs)
    values: Callable[[], "numpy.ndarray"]  # float32, in llama.cpp's layout; computed when written


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
        tensors.append(FileTensor(gguf_name, tuple(tensor.shape), name, partial(_as_file_array, tensor, rotary_heads)))
    for name, array in extra_tensors(config, arch).items():
        tensors.append(FileTensor(name, tuple(array.shape), None, lambda array=array: array))
    return tensors


def _as_file_array(tensor, rotary_heads: int | None):
    import torch

    array = tensor.detach().to(torch.float32).cpu().numpy()
    return interleave_rotary_rows(array, rotary_heads) if rotary_heads else array
