"""DDP (no `fsdp`/`deepspeed` key): every rank holds the whole model, Accelerate averages the gradients in the last
micro-batch's backward of each step. One process is this engine too, with no gradients to average.

Under bf16 with fp32 masters (resolved.master_weights) the model computes with bf16 weights and the optimizer steps
fp32 masters (masters.py): the model is then not wrapped in DDP, and the masters' fp32 gradients are averaged over
the ranks once per step instead."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from tuneloop.engines.base import Engine, EngineSpec


@dataclass(frozen=True, kw_only=True)
class DDPSpec(EngineSpec):
    name = "ddp"

    def describe(self, world_size: int | None = None) -> str:
        if (world_size or 2) == 1:
            return "one process"
        words = "DDP (a whole copy of the model on each rank)"
        if world_size and self.mesh_keys.cp:
            from tuneloop.engines.context_parallel import context_parallel_words

            words += "; " + context_parallel_words(self.mesh_keys.cp)
        return words

    def build(self, cfg, plan, accelerator) -> Engine:
        return DDPEngine(self, cfg, plan, accelerator)


class DDPEngine(Engine):
    masters = None  # the fp32 masters (masters.MasterWeights), under bf16 with masters
    frozen_bf16: list = []  # an adapter's frozen base weights held in bf16 (masters.hold_frozen_in_bf16)
    last = True  # the micro-batch being run is its step's last (set by `accumulating`)

    def prepare(self, module):
        from tuneloop.optim import build_optimizer

        self.module = module
        if self.plan.resolved.precision.masters:
            from tuneloop.engines.masters import MasterWeights

            module.to(self.accelerator.device)
            self.masters = MasterWeights(module.model, self.plan.world_size, self.cfg)
            self.optimizer = build_optimizer(self.cfg, module.model, self.masters.named_masters(module.model))
            self.runner = module
            return self.runner, self.optimizer
        if self.plan.resolved.precision.frozen_bf16:
            from tuneloop.engines.masters import hold_frozen_in_bf16

            self.frozen_bf16 = hold_frozen_in_bf16(module.model, self.cfg)
        optimizer = build_optimizer(self.cfg, module.model)
        self.runner, self.optimizer = self.accelerator.prepare(module, optimizer)
        return self.runner, self.optimizer

    def eval_runner(self):
        return self.module  # unwrapped: DDP's forward would broadcast buffers, a collective

    def accumulating(self, last: bool):
        self.last = last
        if self.masters is not None:  # the masters' gradients are averaged after the last backward
            self.masters.before_micro_batch()
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.runner)

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)
        if self.masters is not None and self.last:
            self.masters.finish_gradients()

    def clip_grad_norm(self, max_norm: float | None):
        if self.masters is not None:
            import torch

            return torch.nn.utils.clip_grad_norm_(self.masters.stepped, max_norm or float("inf"))
        return self.accelerator.clip_grad_norm_(self.runner.parameters(), max_norm or float("inf"))

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if self.masters is not None:
            self.masters.write_compute_weights()

    def zero_grad(self) -> None:
        if self.masters is not None:  # (their gradients are views of one buffer: overwritten, never set to None)
            self.masters.zero_grad()
        else:
            super().zero_grad()

    def training_ended(self) -> None:
        if self.masters is not None:
            self.masters.release()
        if self.frozen_bf16:
            from tuneloop.engines.masters import restore_fp32

            restore_fp32(self.frozen_bf16)
            self.frozen_bf16 = []

    def full_state_dict(self) -> dict | None:
        """With masters: the model's weights as the masters hold them (fp32), for checkpoints and the saved model."""
        return None if self.masters is None else self.masters.state_dict(self.module.model)
