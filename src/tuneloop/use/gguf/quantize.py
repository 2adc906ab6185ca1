"""The tensor types of each `--quant`, as llama.cpp's conversion script chooses them.

Vectors (norms, biases, rope factors) stay float32 whatever the quantization: they are tiny and llama.cpp
computes with them in float32. A block quantization (q8_0, q4_0) needs each row to be a whole number of
32-value blocks; a matrix whose rows are not is written f16, as llama.cpp falls back. Under q4_0 the token
embedding and the output head are written q8_0: they are the tensors 4-bit hurts most (llama.cpp's own
quantizer gives the head a higher type too), and the `gguf` package cannot write llama.cpp's k-quants.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuneloop.registry import Registry


@dataclass(frozen=True)
class Quantization:
    file_type: str  # gguf.LlamaFileType member: what the file says it mostly is
    matrices: str  # gguf.GGMLQuantizationType member for 2-D weights
    embeddings: str  # ... for token_embd / output (the vocabulary-sized matrices)


QUANTIZATIONS: Registry[Quantization] = Registry("GGUF quantization", "--quant")
QUANTIZATIONS.add("f32", Quantization("ALL_F32", "F32", "F32"))
QUANTIZATIONS.add("f16", Quantization("MOSTLY_F16", "F16", "F16"))
QUANTIZATIONS.add("bf16", Quantization("MOSTLY_BF16", "BF16", "BF16"))
QUANTIZATIONS.add("q8_0", Quantization("MOSTLY_Q8_0", "Q8_0", "Q8_0"))
QUANTIZATIONS.add("q4_0", Quantization("MOSTLY_Q4_0", "Q4_0", "Q8_0"))

VOCABULARY_TENSORS = ("token_embd.weight", "output.weight")


def tensor_type(name: str, shape: tuple[int, ...], quantization: Quantization):
    """The ggml type this tensor is written in."""
    import gguf

    types = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return types.F32
    wanted = types[quantization.embeddings if name in VOCABULARY_TENSORS else quantization.matrices]
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return types.F16  # rows that are not whole blocks: llama.cpp's fallback
    return wanted


def stored_bytes(shape: tuple[int, ...], ggml_type) -> int:
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    count = 1
    for size in shape:
        count *= size
    return count // block * block_bytes


def encode(array, ggml_type):
    """The float32 array in `ggml_type`: (data, the numpy dtype add_tensor_info expects, raw type or None)."""
    import gguf
    import numpy as np

    types = gguf.GGMLQuantizationType
    if ggml_type == types.F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    if ggml_type == types.F16:
        return np.ascontiguousarray(array, dtype=np.float16)
    return np.ascontiguousarray(gguf.quants.quantize(array, ggml_type))  # bytes (uint8), block by block
