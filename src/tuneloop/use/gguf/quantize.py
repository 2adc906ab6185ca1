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


def llama_cpp_type(name: str) -> str | None:
    """`name` as llama.cpp's `llama-quantize` spells a type it writes (Q4_K_M, IQ4_XS, Q5_1, ...), or None."""
    import gguf

    spelled = name.upper()
    types = {member.removeprefix("MOSTLY_") for member in gguf.LlamaFileType.__members__ if
             member.startswith("MOSTLY_")}
    types |= {kind.removesuffix("_M") for kind in types if kind.endswith("_K_M")}  # (Q4_K: llama-quantize's Q4_K_M)
    return spelled if spelled in types else None


def elsewhere(name: str, output_for) -> str | None:
    """For a --quant export does not write but llama.cpp does: export f16 and quantize that file with llama.cpp's
    own tool. `output_for(quant)`: the file `export` at that --quant writes."""
    kind = llama_cpp_type(name)
    if kind is None:
        return None
    f16 = output_for("f16")
    target = f16.with_name(f"model-{kind}{f16.suffix}" if f16.name == f"model-f16{f16.suffix}" else
                           f"{f16.stem}-{kind}{f16.suffix}")
    return (f"--quant {name} is a llama.cpp quantization that the gguf package export writes with has no encoder for "
            f"(export writes {QUANTIZATIONS.choices()}): export with --quant f16 (into {f16}), then run llama.cpp's "
            f"`llama-quantize {f16} {target} {kind}`")


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
