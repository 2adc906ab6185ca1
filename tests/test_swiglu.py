"""tuneloop's gated MLP product (kernels/swiglu.py): given to the LLaMA-formula MLPs of the model a run trains; its
output and every gradient are autograd's to the bit, with one [tokens, intermediate] tensor less kept for the
backward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneloop.kernels import swiglu
from test_rms_norm import saved_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_patched_mlp_gives_autograds_output_and_gradients_to_the_bit(tiny_model_dir, dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    theirs = model.model.layers[0].mlp
    ours = copy.deepcopy(theirs)
    assert swiglu.use_in(ours) == 1
    hidden = torch.randn(2, 9, model.config.hidden_size, dtype=dtype)
    grad = torch.randn(2, 9, model.config.hidden_size, dtype=dtype)
    results = []
    for mlp in (theirs, ours):
        x = hidden.clone().requires_grad_()
        out = mlp(x)
        out.backward(grad)
        results.append([out, x.grad] + [param.grad for param in mlp.parameters()])
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_patched_mlp_keeps_one_intermediate_tensor_less(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    theirs = model.model.layers[0].mlp
    ours = copy.deepcopy(theirs)
    swiglu.use_in(ours)
    hidden = torch.randn(3, 16, model.config.hidden_size, requires_grad=True)
    kept_theirs, kept_ours = (saved_bytes(lambda mlp=mlp: mlp(hidden)) for mlp in (theirs, ours))
    assert kept_theirs - kept_ours == 3 * 16 * model.config.intermediate_size * 4  # SiLU's output, not kept


def test_only_silu_gated_llama_mlps_are_given_it(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert swiglu.use_in(model) == model.config.num_hidden_layers
    gelu = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, hidden_act="gelu")
    assert swiglu.use_in(gelu) == 0  # the same class with another activation
