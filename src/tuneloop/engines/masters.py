"""bf16 compute weights with fp32 masters: the DDP engine's bf16 (one process, or DDP ranks).

Under autocast, every matmul casts its fp32 weight to bf16 in every forward, and its bf16 weight gradient back to fp32
in every backward. Here, as in Megatron and DeepSpeed's bf16 optimizer, those weights are held in bf16 and the
optimizer steps fp32 master copies of them: the same products in the same dtypes as under autocast (a weight
rounded to bf16 from the same fp32 value, its gradient added into fp32), without a cast per micro-batch.

- Which weights: those only matmuls read (a Linear's, GPT-2's Conv1D's; not an embedding, not one tied to an
  embedding, not norms or biases), because those are the ones autocast casts. Everything else stays fp32 and is
  stepped as it is: the embeddings' output, the norms and the residual stream keep autocast's fp32. So does an
  output head the chunked loss meets directly: it casts the head once per forward and sums the head's gradient
  over its chunks in fp32, which a bf16 head would round.
- Their masters are the fp32 weights as loaded (each its own tensor); the model's bf16 weights are views of one flat
  bf16 buffer, written from the masters once per optimizer step. Their fp32 gradients are views of one flat buffer
  over ranks (one all-reduce), and tensors of their own in one process (a freed activation's place fits one; a
  single 0.4 GB block would not, and the process would grow by it: the quickstart's resident size measured
  4.36 GB with one block, 4.08 GB with a tensor each, 4.45 GB before, with the buffer held throughout).
- The fp32 gradients exist only while a step needs them. The step's first micro-batch leaves each weight's gradient
  in bf16 (a hook takes it off the weight, so a second backward cannot add to it in bf16); the fp32 buffer is made,
  and those gradients cast into it, when the step's backwards are over (one micro-batch a step) or before its next
  micro-batch runs (the first micro-batch's activations are freed by then); later micro-batches' gradients are
  added into it by the same hook as the backward has them. The buffer goes after the optimizer step. A bf16
  gradient cast to fp32 is exact, so this is the sum it was, in the same order; the memory is not: with one
  micro-batch a step the backward's peak holds 2 bytes a weight of gradients instead of 4 (SmolLM2-135M: 0.21 GB
  less; a 7B model's 14 GB), and the fp32 gradients take the place the activations left (the plan counts both).
- Over ranks the fp32 gradients are all-reduced once, after the step's last backward (DDP would reduce the bf16
  gradients the weights now have).
- A checkpoint and the saved model hold the masters (fp32), so a resume starts from exactly the weights it left.
"""

from __future__ import annotations

import torch


def matmul_only_weights(model: torch.nn.Module, cfg=None, trained: bool = True) -> list[torch.nn.Parameter]:
    """The trained (or, `trained=False`, the frozen) fp32 weights that only matmuls read: what autocast would cast in
    every forward and backward (less the output head where the run's loss meets it in chunks)."""
    from tuneloop.kernels.output_head import loss_meets_head_in_chunks, output_head

    matmul_only: dict[int, bool] = {}
    if loss_meets_head_in_chunks(cfg, model):
        matmul_only[id(output_head(model)[1])] = False
    # what the model's class keeps in fp32 whatever the dtype it is loaded in (T5's `wo`, some routers)
    kept = getattr(getattr(model, "get_base_model", lambda: model)(), "_keep_in_fp32_modules", None) or ()
    for module_name, module in model.named_modules():
        matmul = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        matmul = matmul and not any(key in module_name.split(".") for key in kept)
        for name, param in module.named_parameters(recurse=False):
            matmul_only[id(param)] = matmul_only.get(id(param), True) and matmul and name == "weight"
    return [param for param in _trained(model, trained)
            if matmul_only.get(id(param)) and param.dtype == torch.float32]


def _trained(model: torch.nn.Module, trained: bool = True) -> list[torch.nn.Parameter]:
    return [p for p in {id(p): p for p in model.parameters()}.values()
            if p.requires_grad == trained and p.is_floating_point()]


def hold_frozen_in_bf16(model: torch.nn.Module, cfg=None) -> list[torch.nn.Parameter]:
    """An adapter's frozen base, under bf16: its matmul-only weights held in bf16 (they never change, so they need no
    master). Autocast casts a frozen weight in every forward, and again in a checkpointed layer's recompute (its
    cast cache keeps only weights that require a gradient); the bf16 weight is that cast, made once: the products,
    and so the adapter's gradients, are autocast's to the bit, and the base takes half its bytes. Returns the weights
    cast, for `restore_fp32`.

    On a CPU the loaded weights are views of the checkpoint file, mapped into memory (safetensors), and the casts
    read all of its pages: while any tensor still views the file (the frozen embeddings and norms), the whole
    mapping stays, and its pages with it (the DPO example: 0.53 GB of resident memory beside the bf16 copies; clean
    page cache the kernel can reclaim, but the process's size says otherwise). Those few frozen tensors are copied
    out of the file, so its mapping goes."""
    frozen = matmul_only_weights(model, cfg, trained=False)
    for param in frozen:
        param.data = param.data.to(torch.bfloat16)
    cast = {id(param) for param in frozen}
    for param in _trained(model, trained=False):
        if id(param) not in cast and param.device.type == "cpu":
            param.data = param.data.clone()
    return frozen


def restore_fp32(frozen: list[torch.nn.Parameter]) -> None:
    """Training is over: the frozen weights fp32 again, as a caller that runs the model without autocast needs them
    (their values stay the bf16 ones; what the run saves, the adapter, never held them)."""
    for param in frozen:
        param.data = param.data.float()


class MasterWeights:
    def __init__(self, model: torch.nn.Module, world_size: int, cfg=None):
        self.world_size = world_size
        self.compute = matmul_only_weights(model, cfg)  # held in bf16, stepped through their masters
        computed = {id(p) for p in self.compute}
        self.others = [p for p in _trained(model) if id(p) not in computed]  # fp32, stepped as they are
        device = next(model.parameters()).device
        total = sum(p.numel() for p in self.compute)
        self.flat_grad: torch.Tensor | None = None  # the masters' fp32 gradients, while a step needs them
        self.flat_bf16 = torch.empty(total, dtype=torch.bfloat16, device=device)
        self.masters: list[torch.nn.Parameter] = []
        self.compute_views: list[torch.Tensor] = []  # the bf16 weights, as views of flat_bf16
        self.grads: list[torch.Tensor] = []  # the masters' gradients, as views of flat_grad (while it exists)
        self.held: list[torch.Tensor | None] = []  # a weight's bf16 gradient from the step's first micro-batch
        self.hooks: list = []
        offset = 0
        for param in self.compute:
            count = param.numel()
            # the master takes over the fp32 weight's own storage: no copy, and no storage shared between masters
            # (save_pretrained would clone tensors that share one)
            master = torch.nn.Parameter(param.data)
            self.held.append(None)
            self.masters.append(master)
            self.compute_views.append(self.flat_bf16[offset:offset + count].view_as(param))
            param.data = self.compute_views[-1]
            self.hooks.append(param.register_post_accumulate_grad_hook(self._fold_into(len(self.masters) - 1)))
            offset += count
        self.unwritten = [True] * len(self.masters)  # no gradient yet this step: the first is copied in
        if world_size > 1:  # every rank starts from rank 0's weights, as DDP makes them
            for tensor in self.masters + self.others:
                torch.distributed.broadcast(tensor.data, src=0)
        self.write_compute_weights()
        self._master_of = {id(param): master for param, master in zip(self.compute, self.masters)}
        # in the model's order, as the gradient norm is taken over the model's own parameters without masters: the
        # same sum in the same order (the clipped update is then autocast's to the bit)
        self.stepped = [self._master_of.get(id(param), param) for param in _trained(model)]

    def _fold_into(self, index: int):
        def fold(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            if not self.grads and self.held[index] is None:
                self.held[index] = grad  # the step's first: kept in bf16 until the step needs fp32
                return
            self._fp32_gradients()  # (a second gradient within one micro-batch: fp32 from here on)
            if self.unwritten[index]:
                self.grads[index].copy_(grad)
                self.unwritten[index] = False
            else:
                self.grads[index].add_(grad)  # bf16 into fp32
        return fold

    def _fp32_gradients(self) -> None:
        """The fp32 buffer, made if the step has none yet, with every held bf16 gradient cast into it."""
        if self.flat_grad is None and self.world_size > 1:
            self.flat_grad = torch.empty(self.flat_bf16.numel(), dtype=torch.float32, device=self.flat_bf16.device)
            offset, self.grads = 0, []
            for master in self.masters:
                self.grads.append(self.flat_grad[offset:offset + master.numel()].view_as(master))
                offset += master.numel()
        elif not self.grads:
            self.grads = [torch.empty_like(master) for master in self.masters]
        held = [index for index, grad in enumerate(self.held) if grad is not None]
        if held:
            torch._foreach_copy_([self.grads[index] for index in held], [self.held[index] for index in held])
            for index in held:
                self.held[index] = None
                self.unwritten[index] = False

    def before_micro_batch(self) -> None:
        """A micro-batch is about to run: one before it in this step left bf16 gradients, whose activations are
        freed now, so the fp32 buffer takes their place before this one's activations are made."""
        if any(grad is not None for grad in self.held):
            self._fp32_gradients()

    def named_masters(self, model: torch.nn.Module):
        """(name, the tensor the optimizer steps for it): a bf16 weight's master, any other weight itself; in the
        model's order, so the optimizer's parameter groups are the same at every start."""
        return [(name, self._master_of.get(id(param), param)) for name, param in model.named_parameters()]

    def finish_gradients(self) -> None:
        """After the step's last backward: the ranks' fp32 gradients averaged (the loop scales every rank's loss as
        for DDP's average); a weight no micro-batch reached (on any rank) has none, and the optimizer skips it as it
        would skip the weight itself."""
        self._fp32_gradients()
        if self.world_size > 1:
            reached = torch.tensor([not unwritten for unwritten in self.unwritten], dtype=torch.float32,
                                   device=self.flat_grad.device)
            for index, unwritten in enumerate(self.unwritten):
                if unwritten:
                    self.grads[index].zero_()
            torch.distributed.all_reduce(self.flat_grad)
            self.flat_grad.div_(self.world_size)
            torch.distributed.all_reduce(reached)
            self.unwritten = [not bool(value) for value in reached]
        for master, grad, unwritten in zip(self.masters, self.grads, self.unwritten):
            master.grad = None if unwritten else grad
        if self.world_size == 1:
            return
        if self.others:  # (the norms, biases and embeddings: one more collective, of one flat copy)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.others]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            torch.distributed.all_reduce(flat)
            flat.div_(self.world_size)
            offset = 0
            for param in self.others:
                param.grad = flat[offset:offset + param.numel()].view_as(param)
                offset += param.numel()

    def write_compute_weights(self) -> None:
        """The model's bf16 weights from the masters (once per optimizer step)."""
        torch._foreach_copy_(self.compute_views, self.masters)

    def zero_grad(self) -> None:
        """After the optimizer step: the fp32 gradients are let go (the next step makes its own when it needs them)."""
        self.unwritten = [True] * len(self.masters)
        for master in self.masters:
            master.grad = None
        self.flat_grad, self.grads = None, []
        for param in self.others:
            param.grad = None

    def release(self) -> None:
        """Training is over: the model holds its fp32 masters again (what was saved is what a caller holds), and the
        bf16 copies and gradients are freed."""
        for handle in self.hooks:
            handle.remove()
        for param, master in zip(self.compute, self.masters):
            param.data = master.data
            master.grad = None
        self.hooks, self.grads, self.compute_views, self.held = [], [], [], [None] * len(self.masters)
        self.flat_grad = self.flat_bf16 = None

    def state_dict(self, model: torch.nn.Module) -> dict:
        """The model's state dict with each bf16 weight's fp32 master in its place."""
        return {name: self._master_of.get(id(tensor), tensor).detach()
                for name, tensor in model.state_dict(keep_vars=True).items()}
