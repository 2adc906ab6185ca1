"""The weights of every optimizer step, sent to the vLLM server before it generates from them.

Three ways, one per kind of run, each through files the server reads (it must see the run's output_dir: the same
machine or a shared filesystem), so one channel works on a CPU and on GPUs:
- full fine-tuning: every weight, in one safetensors file, loaded by vLLM's `reload_weights` (its /collective_rpc
  development endpoint), then the prefix cache reset (its KV entries were computed by the old weights);
- LoRA, `trl.vllm_lora_sync: false` (axolotl's default): the adapter merged into the base weights out of place
  (W + scale·B·A per adapted layer; the training weights are never touched), sent as full weights. The server then
  runs its plain compiled path, which its LoRA path turns off (0.5–0.8× as fast on these CPUs, as issue 51 measured);
- LoRA, `trl.vllm_lora_sync: true`: the adapter folder, loaded under a new name each step (/v1/load_lora_adapter;
  a reused name would be served from vLLM's cache), the previous one unloaded; the base weights once a session
  first (a server another run synced holds that run's weights).

Only the main process writes and calls; every rank waits for it (one gather carries its error, if any), so no rank
generates from the weights of the step before. The full weights go into one safetensors file laid out once and
rewritten in place through a memory map (WeightsFile: 0.04 s for the embedded model in bf16, against 0.4 s to
build and save a new file each step); an adapter goes into a folder per step, the last one removed. Where: for a
server on this machine (a loopback address) in /dev/shm, memory the server reads as a file (no disk writes a
step); else output_dir/vllm_weights, which the server must see (a shared filesystem).

`TUNELOOP_TEST_SKIP_VLLM_SYNC` (tests only) leaves the server's weights as they were: the log-prob gap check must
then stop the run.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import uuid
from pathlib import Path

import torch

from tuneloop import run_files
from tuneloop.errors import UserError

SKIP_SYNC_ENV = "TUNELOOP_TEST_SKIP_VLLM_SYNC"
MEMORY_FOLDER = Path("/dev/shm")  # Linux's shared memory, a filesystem in RAM


def sync_mode(cfg) -> str:
    if cfg.adapter in ("lora", "qlora"):
        return "adapter" if cfg.trl_settings.vllm_lora_sync else "merged"
    return "full"


class WeightSync:
    def __init__(self, cfg, accelerator, local_server: bool):
        self.mode = sync_mode(cfg)
        # the server's dtype, as `tuneloop vllm-serve` picks it: a bf16 run's server computes in bf16, and gets its
        # weights rounded as it would round them itself (half the bytes to write and read)
        asked = cfg.vllm.dtype if cfg.vllm is not None else "auto"
        self.dtype = torch.bfloat16 if (asked == "bfloat16" or asked in (None, "auto") and
                                        accelerator.mixed_precision == "bf16") else None
        self.folder = Path(cfg.output_dir) / run_files.VLLM_WEIGHTS
        self.in_memory = local_server and MEMORY_FOLDER.is_dir() and os.access(MEMORY_FOLDER, os.W_OK)
        if self.in_memory:  # a server on this machine reads from memory: no disk writes a step (see the module)
            self.folder = MEMORY_FOLDER / f"tuneloop-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            atexit.register(shutil.rmtree, self.folder, True)
        self.accelerator = accelerator
        self.model_name = None  # the adapter's name on the server (adapter mode), else the served model
        self.weights_file = None
        self.sent_step = None

    def send(self, server, policy, step: int) -> None:
        error = None
        if self.accelerator.is_main_process:
            try:
                self._send(server, policy, step)
            except UserError as raised:
                error = str(raised)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            errors = gather_object([error])
            error = next((item for item in errors if item), None)
            self.model_name = f"tuneloop-step-{step}" if self.mode == "adapter" else None
        if error:
            raise UserError(error)

    def _send(self, server, policy, step: int) -> None:
        if os.environ.get(SKIP_SYNC_ENV) and self.sent_step is not None:
            return
        if not self.folder.exists() and not self.in_memory:
            run_files.record(self.folder.parent, run_files.VLLM_WEIGHTS)
        try:
            if self.mode == "adapter":
                if self.sent_step is None:  # the base once a session: another run may have left its own weights
                    self._reload(server, policy, merged=False)
                target = self.folder / f"adapter-step-{step}"
                shutil.rmtree(target, ignore_errors=True)
                policy.save_pretrained(target)
                name = f"tuneloop-step-{step}"
                server.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
                if self.model_name is not None:
                    server.call("/v1/unload_lora_adapter", {"lora_name": self.model_name})
                if self.sent_step is not None:
                    shutil.rmtree(self.folder / f"adapter-step-{self.sent_step}", ignore_errors=True)
                self.model_name = name
            else:
                self._reload(server, policy, merged=self.mode == "merged")
        except OSError as error:  # (refused, reset, timed out: the server is gone)
            raise UserError(f"train: the vLLM server at {server.url} stopped answering while taking step {step}'s "
                            f"weights ({error}); no weight changed since, and the last checkpoint is as it was: "
                            "start it again with `tuneloop vllm-serve CONFIG` and rerun the same command to resume"
                            ) from None
        except RuntimeError as error:  # (it answered: an endpoint is missing or refused the call)
            raise UserError(f"train: the vLLM server at {server.url} did not take step {step}'s weights ({error}); "
                            "the last checkpoint is as it was. Was it started by `tuneloop vllm-serve CONFIG` (its "
                            "development endpoints and, for vllm_lora_sync, --enable-lora)?") from None
        self.sent_step = step

    def _reload(self, server, policy, merged: bool) -> None:
        """The weights written into the run's weights file, which the server then reads whole."""
        if self.weights_file is None:
            self.weights_file = WeightsFile(self.folder / "weights")
        self.weights_file.write(served_weights(policy, merged, self.dtype))
        server.call("/collective_rpc", {"method": "reload_weights",
                                        "kwargs": {"weights_path": str(self.weights_file.folder)}})
        server.call("/reset_prefix_cache", {})


class WeightsFile:
    """One safetensors file, laid out once, into which each step's weights are copied (cast on the way) through a
    memory map: no serialised copy of the model a step (safetensors' save_file builds one whole), and no new file.
    The server reads it only inside a sync, when nothing writes it."""

    DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

    def __init__(self, folder: Path):
        self.folder, self.layout, self.map, self.bytes = folder, None, None, None

    def write(self, weights) -> None:
        weights = list(weights)
        layout = [(name, tuple(tensor.shape), dtype) for name, tensor, dtype in weights]
        if layout != self.layout:
            self._lay_out(layout)
        for (name, tensor, dtype), (start, stop) in zip(weights, self.offsets):
            self.bytes[start:stop].view(dtype).view(tensor.shape).copy_(tensor)
        self.map.flush()

    def _lay_out(self, layout: list) -> None:
        import mmap

        if self.map is not None:
            self.map.close()
        header, offset = {}, 0
        for name, shape, dtype in layout:
            size = math.prod(shape) * torch.finfo(dtype).bits // 8
            header[name] = {"dtype": self.DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned)
        start = 8 + len(text)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "model.safetensors"
        with open(path, "wb") as handle:
            handle.write(len(text).to_bytes(8, "little") + text)
            handle.truncate(start + offset)
        with open(path, "r+b") as handle:
            self.map = mmap.mmap(handle.fileno(), start + offset)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.offsets = [(start + header[name]["data_offsets"][0], start + header[name]["data_offsets"][1])
                        for name, _, _ in layout]
        self.layout = layout


@torch.no_grad()
def served_weights(policy, merged: bool, dtype=None) -> list:
    """[(checkpoint name, tensor, dtype to send it in)] of the model's weights (a tied head's under both names), a
    LoRA adapter merged into its layers' weights when `merged`; `dtype` None: each as it is stored."""
    deltas = adapter_deltas(policy) if merged else {}
    weights = []
    for name, tensor in policy.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".modules_to_save." in plain:  # a layer the adapter trains whole: its trained copy
            head, _, tail = plain.partition(".modules_to_save.")
            plain = f"{head}.{tail.partition('.')[2]}"
        layer = name.removesuffix(".base_layer.weight") if name.endswith(".base_layer.weight") else None
        if layer in deltas:
            tensor = tensor + deltas[layer].to(tensor.dtype)
        sent = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        weights.append((plain, tensor.detach(), sent))
    return weights


def adapter_deltas(policy) -> dict:
    """{layer name: scale·B·A} of every LoRA layer's active adapters (peft's own get_delta_weight)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in policy.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    delta = module.get_delta_weight(adapter)
                    deltas[name] = delta if name not in deltas else deltas[name] + delta
    return deltas
