"""`optimizer: muon` as axolotl defines it (tuneloop/muon.py): a step equals axolotl-contribs-mit's own Muon on the
weights it steps, the 1-D weights axolotl's factory leaves out are stepped by the AdamW, the plan counts its states
exactly, a resumed run ends where an uninterrupted one does, and what cannot work is refused."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tuneloop.config.load import config_from_dict
from tuneloop.errors import UserError
from tuneloop.muon import is_hidden_matrix
from tuneloop.optim import build_optimizer
from tuneloop.train.guards import SIGNAL_AT_STEP_ENV


def axolotls_muon_class():
    """axolotl-contribs-mit 0.0.6's Muon, the optimizer axolotl builds for `optimizer: muon`. Its module also
    defines axolotl's factory, whose base class lives in axolotl itself (not installed): a stand-in base class lets
    the module import; the optimizer compared is theirs, unchanged. Its Newton-Schulz is wrapped in torch.compile,
    which is turned off here (the same operations, eagerly)."""
    if "axolotl.integrations.base" not in sys.modules:
        base = types.ModuleType("axolotl.integrations.base")
        base.BaseOptimizerFactory = object
        sys.modules["axolotl.integrations"] = types.ModuleType("axolotl.integrations")
        sys.modules["axolotl.integrations.base"] = base
    from axolotl.contribs.mit.muon.muon import Muon

    return Muon


def model_with_gradients(model_dir, seed: int):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    return model


def step_twice(model_dir, make_optimizer):
    model = model_with_gradients(model_dir, seed=1)
    optimizer = make_optimizer(model)
    optimizer.step()
    grads = model_with_gradients(model_dir, seed=2)  # a second step on other gradients (momentum and bias terms)
    for (name, parameter), (_, other) in zip(model.named_parameters(), grads.named_parameters()):
        parameter.grad = other.grad
    optimizer.step()
    return dict(model.named_parameters())


def test_two_steps_equal_axolotls_muon_and_the_1d_weights_axolotl_leaves_out_take_the_adamw(tiny_model_dir):
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "optimizer": "muon",
                            "learning_rate": 2e-3, "weight_decay": 0.1})
    Muon = axolotls_muon_class()

    def theirs(model):  # as axolotl's MuonOptimizerFactory sorts the weights (1-D ones left out)
        named = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
        return Muon(lr=2e-3, wd=0.1, muon_params=[p for n, p in named if is_hidden_matrix(n, p)],
                    adamw_params=[p for n, p in named if not is_hidden_matrix(n, p)])

    original = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    torch._dynamo.config.disable = True
    try:
        expected = step_twice(tiny_model_dir, theirs)
    finally:
        torch._dynamo.config.disable = False
    ours = step_twice(tiny_model_dir, lambda model: build_optimizer(cfg, model))
    matrices = [name for name, p in ours.items() if is_hidden_matrix(name, p)]
    assert matrices and len(matrices) < len(ours)
    for name, parameter in ours.items():
        if parameter.ndim >= 2:
            torch.testing.assert_close(parameter, expected[name], rtol=0, atol=1e-7, msg=name)
            assert not torch.equal(parameter, original[name]), name
        else:  # axolotl's factory leaves norms out (they never move); tuneloop's AdamW steps them, undecayed
            assert torch.equal(expected[name], original[name]) and not torch.equal(parameter, original[name]), name


def test_a_stack_of_expert_matrices_is_stepped_as_each_expert_alone():
    """transformers 5 holds an MoE layer's experts as one [experts, rows, cols] weight: each expert is its own
    matrix (orthogonalised, and its rate from its own shape), not one flattened matrix of all of them."""
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "optimizer": "muon",
                            "learning_rate": 1e-2})
    torch.manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 8, 16))
    alone = [torch.nn.Parameter(stack.detach()[i].clone()) for i in range(3)]
    gradient = torch.randn(3, 8, 16)
    stack.grad = gradient.clone()
    for i, weight in enumerate(alone):
        weight.grad = gradient[i].clone()
    build_optimizer(cfg, None, [("mlp.experts.gate_up_proj", stack)]).step()
    build_optimizer(cfg, None, [(f"mlp.experts.{i}.weight", w) for i, w in enumerate(alone)]).step()
    for i, weight in enumerate(alone):
        torch.testing.assert_close(stack.detach()[i], weight.detach(), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("muon") / "train.jsonl", tiny_rows(40, seed=5))


def test_a_muon_run_is_planned_exactly_learns_and_resumes_where_it_would_have_been(tmp_path, tiny_model_dir, data,
                                                                                   monkeypatch):
    keys = dict(optimizer="muon", learning_rate=1e-2, max_steps=6, micro_batch_size=2, save_strategy=None,
                save_steps=100, auto_resume_from_checkpoints=True)
    straight = write_config(tmp_path / "straight.yml", **base_config(tmp_path / "straight", tiny_model_dir, data,
                                                                      **keys))
    planned = run_in_process("plan", str(straight))
    assert "optimizer            muon (hidden matrices: momentum 0.95, Nesterov, 5 Newton-Schulz steps" in \
        planned.stdout and "AdamW, betas (0.95, 0.95))" in planned.stdout, planned.stdout
    assert run_in_process("train", str(straight)).returncode == 0
    out = tmp_path / "straight" / "out"
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert losses[-1] < losses[0]
    plan = json.loads((out / "plan.json").read_text())
    held = json.loads((out / "summary.json").read_text())["held_bytes_per_rank"][0]
    # momentum (4 bytes) for each hidden matrix's weight, AdamW's two states (8) for every other trained weight
    weights = load_file(out / "model.safetensors")
    matrices = sum(t.numel() for name, t in weights.items() if is_hidden_matrix(name, t))
    others = sum(t.numel() for t in weights.values()) - matrices
    assert held["optimizer"] == pytest.approx(4 * matrices + 8 * others, rel=1e-3)
    assert held["optimizer"] == pytest.approx(plan["memory"]["per_rank_bytes"]["optimizer"], rel=1e-3)

    stopped = write_config(tmp_path / "stopped.yml", **base_config(tmp_path / "stopped", tiny_model_dir, data,
                                                                    **keys))
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, "0:3")
    assert run_in_process("train", str(stopped)).returncode != 0
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    assert run_in_process("train", str(stopped)).returncode == 0
    resumed = load_file(tmp_path / "stopped" / "out" / "model.safetensors")
    assert all(torch.equal(resumed[name], weights[name]) for name in weights)


@pytest.mark.parametrize("keys, message", [
    ({"deepspeed": "zero2"}, "`optimizer: muon` orthogonalises whole weight matrices, and deepspeed hands"),
    ({"fsdp_version": 2, "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}},
     "`optimizer: muon` orthogonalises whole weight matrices, and fsdp2 hands"),
    ({"adapter": "lora", "lora_target_linear": True, "loraplus_lr_ratio": 16},
     "`loraplus_lr_ratio` sets the learning rates of AdamW's groups"),
    ({"lr_scheduler": "one_cycle"}, "`optimizer: muon` with `lr_scheduler: one_cycle`"),
])
def test_muon_where_it_cannot_work_is_refused(keys, message):
    with pytest.raises(UserError, match=message):
        config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "optimizer": "muon", **keys})


def test_the_adamw_part_takes_muons_betas_unless_both_are_given_and_a_recorded_config_keeps_that():
    from tuneloop.muon import adamw_betas

    keys = {"base_model": "m", "datasets": [{"path": "x"}], "optimizer": "muon"}
    unset = config_from_dict(keys)
    assert adamw_betas(unset) == (0.95, 0.95) and unset.adamw_betas == (0.9, 0.999)  # (AdamW's own, elsewhere)
    assert adamw_betas(config_from_dict(unset.model_dump())) == (0.95, 0.95)  # as run_config.yml reruns it
    assert adamw_betas(config_from_dict({**keys, "adam_beta1": 0.9, "adam_beta2": 0.99})) == (0.9, 0.99)
    with pytest.warns(UserWarning, match=r"`adam_beta2` alone with `optimizer: muon` is not used"):
        alone = config_from_dict({**keys, "adam_beta2": 0.99})
    assert adamw_betas(alone) == (0.95, 0.95)  # (both, as axolotl), and said
    with pytest.warns(UserWarning, match=r"`adam_beta1` alone"):
        config_from_dict({**keys, "adam_beta1": 0.9})
