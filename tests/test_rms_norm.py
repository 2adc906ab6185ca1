"""tuneloop's RMSNorm (kernels/rms_norm.py): given to the LLaMA-formula norms of the model a run trains, with the
module's own forward values, its gradients to fp32 rounding, and less kept for the backward; never to a norm whose
formula differs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tuneloop.kernels import rms_norm


def saved_bytes(function) -> int:
    """Bytes autograd keeps for the backward while `function` runs (each storage once)."""
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_gives_the_modules_forward_to_the_bit_and_its_gradients(dtype):
    torch.manual_seed(0)
    theirs = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    theirs.weight.data.uniform_(0.5, 1.5)
    ours = copy.deepcopy(theirs)
    assert rms_norm.use_in(ours) == 1
    hidden = torch.randn(3, 7, 96, dtype=dtype) * 4
    grad = torch.randn(3, 7, 96, dtype=dtype)
    results = []
    for norm in (theirs, ours):
        x = hidden.clone().requires_grad_()
        out = norm(x)
        out.backward(grad)
        results.append((out, x.grad, norm.weight.grad))
    (out_a, dx_a, dw_a), (out_b, dx_b, dw_b) = results
    assert out_b.dtype == out_a.dtype and torch.equal(out_a, out_b)
    # (ours computes the backward in fp32 throughout; autograd rounds bf16 intermediates)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in ((dx_a, dx_b), (dw_a, dw_b)):
        assert b.dtype == a.dtype
        assert (a.float() - b.float()).abs().max() <= tolerance * a.float().abs().max()


def test_the_norm_keeps_less_for_the_backward():
    theirs = LlamaRMSNorm(256)
    ours = copy.deepcopy(theirs)
    rms_norm.use_in(ours)
    hidden = torch.randn(4, 64, 256, requires_grad=True)
    kept_theirs, kept_ours = (saved_bytes(lambda norm=norm: norm(hidden)) for norm in (theirs, ours))
    # both keep x itself; the module's autograd also keeps the normalised x, an fp32 tensor of x's size
    assert kept_theirs - kept_ours >= hidden.numel() * 4


def test_only_llama_formula_norms_are_given_it(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    assert rms_norm.use_in(model) == 2 * layers + 1  # two a layer and the final one
    gemma = torch.nn.Sequential(GemmaRMSNorm(32))  # `1 + weight`: another formula
    assert rms_norm.use_in(gemma) == 0


def test_a_patched_models_logits_and_gradients_are_the_models(tiny_model_dir):
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ours = copy.deepcopy(theirs)
    rms_norm.use_in(ours)
    ids = torch.randint(0, theirs.config.vocab_size, (2, 16))
    outputs = [model(input_ids=ids, labels=ids) for model in (theirs, ours)]
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    for output in outputs:
        output.loss.backward()
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name
