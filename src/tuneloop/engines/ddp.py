"""DDP (no `fsdp`/`deepspeed` key): every rank holds the whole model, Accelerate averages the gradients in the last
micro-batch's backward of each step. One process is this engine too, with no gradients to average."""

from __future__ import annotations

from dataclasses import dataclass

from tuneloop.engines.base import Engine, EngineSpec


@dataclass(frozen=True, kw_only=True)
class DDPSpec(EngineSpec):
    name = "ddp"

    def describe(self, world_size: int | None = None) -> str:
        return "DDP (a whole copy of the model on each rank)" if (world_size or 2) > 1 else "one process"

    def build(self, cfg, plan, accelerator) -> Engine:
        return DDPEngine(self, cfg, plan, accelerator)


class DDPEngine(Engine):
    def prepare(self, module):
        from tuneloop.optim import build_optimizer

        optimizer = build_optimizer(self.cfg, module.model)
        self.module = module
        self.runner, self.optimizer = self.accelerator.prepare(module, optimizer)
        return self.runner, self.optimizer

    def eval_runner(self):
        return self.module  # unwrapped: DDP's forward would broadcast buffers, a collective

    def accumulating(self, last: bool):
        import contextlib

        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.runner)

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, max_norm: float | None):
        return self.accelerator.clip_grad_norm_(self.runner.parameters(), max_norm or float("inf"))
