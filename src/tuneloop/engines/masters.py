"""bf16 compute weights with fp32 masters: the DDP engine's bf16 (one process, or DDP ranks).

Under autocast, fp32 weights are cast to bf16 in every forward and their gradients cast back in every backward, and
the norms, residuals and activations between the matmuls run in fp32. Here, as in Megatron and DeepSpeed's bf16
optimizer, the model holds bf16 weights and the optimizer steps fp32 master copies of them:

- the trained weights' masters live in one flat fp32 buffer and their gradients in another; the model's bf16
  weights are views of one flat bf16 buffer, so writing them from the masters after a step is one copy;
- a hook on each trained weight adds its bf16 gradient into its master's fp32 gradient as soon as the backward has
  it, and drops the bf16 one: the micro-batches of a step accumulate in fp32, and no bf16 gradients are held whole;
- over ranks the flat fp32 gradient is all-reduced once, after the step's last backward (DDP would reduce the bf16
  gradients the weights now have);
- a checkpoint and the saved model hold the masters (fp32), so a resume starts from exactly the weights it left.

Frozen weights stay as they were loaded (autocast casts them as before).
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, model: torch.nn.Module, world_size: int):
        self.world_size = world_size
        self.params = [p for p in {id(p): p for p in model.parameters()}.values()
                       if p.requires_grad and p.is_floating_point()]
        device = self.params[0].device if self.params else torch.device("cpu")
        total = sum(p.numel() for p in self.params)
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.flat_grad = torch.zeros(total, dtype=torch.float32, device=device)
        self.flat_bf16 = torch.empty(total, dtype=torch.bfloat16, device=device)
        self.masters: list[torch.nn.Parameter] = []
        offset = 0
        for param in self.params:
            count = param.numel()
            self.flat[offset:offset + count].copy_(param.detach().reshape(-1))
            master = torch.nn.Parameter(self.flat[offset:offset + count].view_as(param))  # shares `flat`
            master.grad = self.flat_grad[offset:offset + count].view_as(param)
            self.masters.append(master)
            param.data = self.flat_bf16[offset:offset + count].view_as(param)  # (the fp32 weight is freed here)
            param.register_post_accumulate_grad_hook(self._fold_into(master.grad))
            offset += count
        if world_size > 1:  # every rank starts from rank 0's weights, as DDP makes them
            torch.distributed.broadcast(self.flat, src=0)
        self.write_compute_weights()
        self._master_of = {id(param): master for param, master in zip(self.params, self.masters)}

    @staticmethod
    def _fold_into(master_grad: torch.Tensor):
        def fold(param: torch.Tensor) -> None:
            master_grad.add_(param.grad)  # bf16 into fp32
            param.grad = None
        return fold

    def named_masters(self, model: torch.nn.Module):
        """(name, the tensor the optimizer steps for it): the master of a trained weight, the weight itself for
        anything else; in the model's order, so the optimizer's parameter groups are the same at every start."""
        return [(name, self._master_of.get(id(param), param)) for name, param in model.named_parameters()]

    def reduce_gradients(self) -> None:
        """After the step's last backward: the ranks' fp32 gradients averaged (the loop scales every rank's loss as
        for DDP's average)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(self.flat_grad)
            self.flat_grad.div_(self.world_size)

    def write_compute_weights(self) -> None:
        """The model's bf16 weights from the masters (once per optimizer step)."""
        self.flat_bf16.copy_(self.flat)

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    def state_dict(self, model: torch.nn.Module) -> dict:
        """The model's state dict with each trained weight's fp32 master in place of its bf16 copy."""
        return {name: self._master_of.get(id(tensor), tensor).detach()
                for name, tensor in model.state_dict(keep_vars=True).items()}
