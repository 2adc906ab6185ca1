"""The weights of every optimizer step, sent to the vLLM server before it generates from them.

Three ways, one per kind of run, each through files the server reads (it must see the run's output_dir: the same
machine or a shared filesystem), so one channel works on a CPU and on GPUs:
- full fine-tuning: every weight, in one safetensors file, loaded by vLLM's `reload_weights` (its /collective_rpc
  development endpoint), then the prefix cache reset (its KV entries were computed by the old weights);
- LoRA, `trl.vllm_lora_sync: false` (axolotl's default): the adapter merged into the base weights out of place
  (W + scale·B·A per adapted layer; the training weights are never touched), sent as full weights. The server then
  runs its plain compiled path: vLLM's LoRA path turns it off, and on this CPU generated 0.5–0.8× as fast;
- LoRA, `trl.vllm_lora_sync: true`: the adapter folder, loaded under a new name each step (/v1/load_lora_adapter;
  a reused name would be served from vLLM's cache), the previous one unloaded; the base weights once a session
  first (a server another run synced holds that run's weights).

Only the main process writes and calls; every rank waits for it (one gather carries its error, if any), so no rank
generates from the weights of the step before. Each step's folder replaces the last one (tuneloop's own files, in
output_dir/vllm_weights). `TUNELOOP_TEST_SKIP_VLLM_SYNC` (tests only) leaves the server's weights as they were: the
log-prob gap check must then stop the run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tuneloop import run_files
from tuneloop.errors import UserError

SKIP_SYNC_ENV = "TUNELOOP_TEST_SKIP_VLLM_SYNC"


def sync_mode(cfg) -> str:
    if cfg.adapter in ("lora", "qlora"):
        return "adapter" if cfg.trl_settings.vllm_lora_sync else "merged"
    return "full"


class WeightSync:
    def __init__(self, cfg, accelerator):
        self.mode = sync_mode(cfg)
        self.folder = Path(cfg.output_dir) / run_files.VLLM_WEIGHTS
        self.accelerator = accelerator
        self.model_name = None  # the adapter's name on the server (adapter mode), else the served model
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
        target = self.folder / f"step-{step}"
        if not self.folder.exists():
            run_files.record(self.folder.parent, run_files.VLLM_WEIGHTS)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        try:
            if self.mode == "adapter":
                if self.sent_step is None:  # the base once a session: another run may have left its own weights
                    self._reload(server, served_weights(policy, merged=False), target)
                policy.save_pretrained(target)
                name = f"tuneloop-step-{step}"
                server.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
                if self.model_name is not None:
                    server.call("/v1/unload_lora_adapter", {"lora_name": self.model_name})
                self.model_name = name
            else:
                self._reload(server, served_weights(policy, merged=self.mode == "merged"), target)
        except (OSError, RuntimeError) as error:
            raise UserError(f"the vLLM server at {server.url} did not take step {step}'s weights ({error}); was it "
                            "started by `tuneloop vllm-serve CONFIG` (its development endpoints and, for "
                            "vllm_lora_sync, --enable-lora)?") from None
        if self.sent_step is not None:
            shutil.rmtree(self.folder / f"step-{self.sent_step}", ignore_errors=True)
        self.sent_step = step


    @staticmethod
    def _reload(server, weights: dict, target: Path) -> None:
        from safetensors.torch import save_file

        save_file(weights, str(target / "model.safetensors"))
        server.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}})
        server.call("/reset_prefix_cache", {})
        (target / "model.safetensors").unlink()  # (read; the adapter, when there is one, is written beside it next)


@torch.no_grad()
def served_weights(policy, merged: bool) -> dict:
    """The model's weights under their checkpoint names, each storage once (tied embeddings: the first name), a LoRA
    adapter merged into its layers' weights when `merged`."""
    deltas = adapter_deltas(policy) if merged else {}
    weights, seen = {}, set()
    for name, tensor in policy.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".modules_to_save." in plain:  # a layer the adapter trains whole: its trained copy
            head, _, tail = plain.partition(".modules_to_save.")
            plain = f"{head}.{tail.partition('.')[2]}"
        key = (tensor.data_ptr(), tensor.shape)
        if key in seen:
            continue
        seen.add(key)
        layer = name.removesuffix(".base_layer.weight") if name.endswith(".base_layer.weight") else None
        if layer in deltas:
            tensor = tensor + deltas[layer].to(tensor.dtype)
        weights[plain] = tensor.detach().to("cpu").contiguous()
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
