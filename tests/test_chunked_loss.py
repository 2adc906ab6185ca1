"""The chunked loss: the language-model loss without the [tokens, vocabulary] logits ever whole.

It equals the plain loss from whole logits, value and gradients (fp32 tolerance), over several chunks,
with tied embeddings, through a LoRA adapter; models whose logits are more than hidden @ lm_head (an
adapter on the head, soft-capping) keep the plain loss; the memory estimate follows the path used.
(Two DDP ranks equal one process through it: test_equivalence.py, which runs it.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

import tuneloop.kernels.output_head as output_head_module
import tuneloop.train.chunked_loss as chunked_loss_module
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.train.chunked_loss import chunked_linear_cross_entropy, chunked_loss_and_correct
from tuneloop.train.objectives import language_model_loss, output_head, summed_token_loss


@pytest.fixture
def small_chunks(monkeypatch):
    for device in ("cpu", "gpu"):  # 64 tokens of a 400-token vocabulary a chunk
        monkeypatch.setitem(output_head_module.LOGITS_PER_CHUNK, device, 64 * 400)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_chunked_function_equals_cross_entropy_over_whole_logits(small_chunks):
    torch.manual_seed(0)
    hidden = torch.randn(300, 32, requires_grad=True)
    weight = torch.randn(400, 32, requires_grad=True)
    targets = torch.randint(0, 400, (300,))
    targets[::5] = IGNORE_INDEX
    chunked = chunked_linear_cross_entropy(hidden, weight, targets)
    (chunked * 0.3).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (plain * 0.3).backward()
    assert float(chunked.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
    assert relative(grads[0], hidden.grad) < 1e-5 and relative(grads[1], weight.grad) < 1e-5
    loss, correct = chunked_loss_and_correct(hidden.detach(), weight.detach(), targets)
    logits = hidden.detach() @ weight.detach().t()
    assert float(loss) == pytest.approx(float(plain.detach()), rel=1e-6)
    assert int(correct) == int((logits.argmax(-1).eq(targets) & (targets != IGNORE_INDEX)).sum())


def test_a_second_backward_over_one_forward_is_refused_not_scaled_twice(small_chunks):
    """The backward scales the gradients the forward kept in place (no [vocabulary, hidden] copy a step): a
    retained graph's second backward would scale them again, so it stops with a message instead."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 32, requires_grad=True), torch.randn(400, 32, requires_grad=True)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.randint(0, 400, (50,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_positions_without_a_target_never_meet_the_head_and_get_no_gradient(small_chunks, monkeypatch):
    """The head multiplies only the positions with a target (the plan's FLOPs count only those); a micro-batch
    without any (a rank's share of prompt-only rows) gives a zero loss and zero gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(300, 32, requires_grad=True)
    weight = torch.randn(400, 32, requires_grad=True)
    targets = torch.full((300,), IGNORE_INDEX)
    targets[100:130] = torch.randint(0, 400, (30,))
    rows_met = []
    original = chunked_loss_module._chunk_logits
    monkeypatch.setattr(chunked_loss_module, "_chunk_logits",
                        lambda chunk, projection: rows_met.append(chunk.shape[0]) or original(chunk, projection))
    chunked_linear_cross_entropy(hidden, weight, targets).backward()
    assert rows_met == [30]
    assert hidden.grad[:100].abs().max() == 0 and hidden.grad[100:130].abs().max() > 0
    hidden.grad = weight.grad = None
    none = chunked_linear_cross_entropy(hidden, weight, torch.full((300,), IGNORE_INDEX))
    none.backward()
    assert float(none.detach()) == 0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def model_of(tiny_model_dir, tied: bool):
    if not tied:
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LlamaConfig.from_pretrained(tiny_model_dir, tie_word_embeddings=True)
    torch.manual_seed(1)
    return LlamaForCausalLM(config)


def loss_and_grads(model, inputs, targets, chunked: bool):
    model.zero_grad(set_to_none=True)
    loss = language_model_loss(model, inputs, targets, chunked=chunked)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def batch():
    torch.manual_seed(2)
    input_ids = torch.randint(5, 390, (3, 50))
    targets = torch.cat([input_ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
    targets[:, :10] = IGNORE_INDEX  # a prompt
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}, targets


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_loss_and_every_gradient_equal_the_plain_ones(tiny_model_dir, small_chunks, tied):
    model = model_of(tiny_model_dir, tied)
    model.config.use_cache = False
    assert output_head(model) is not None
    inputs, targets = batch()
    chunked_value, chunked_grads = loss_and_grads(model, inputs, targets, chunked=True)
    plain_value, plain_grads = loss_and_grads(model, inputs, targets, chunked=False)
    assert chunked_value == pytest.approx(plain_value, rel=1e-6)
    assert chunked_grads.keys() == plain_grads.keys()
    assert max(relative(chunked_grads[k], plain_grads[k]) for k in plain_grads) < 1e-5


def test_under_bf16_autocast_the_chunked_loss_matches_the_plain_one_to_bf16_precision(tiny_model_dir, small_chunks):
    """The chunked path casts the head once and runs its three products in bf16, as autograd's lm_head would:
    the same loss and gradients as the plain path under autocast, to bf16's precision (the two differ only in
    rounding), and both near fp32's."""
    model = model_of(tiny_model_dir, tied=False)
    model.config.use_cache = False
    inputs, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_value, chunked_grads = loss_and_grads(model, inputs, targets, chunked=True)
        plain_value, plain_grads = loss_and_grads(model, inputs, targets, chunked=False)
    fp32_value, _ = loss_and_grads(model, inputs, targets, chunked=False)
    assert chunked_value == pytest.approx(plain_value, rel=1e-4)
    assert chunked_value == pytest.approx(fp32_value, rel=1e-3)
    head = "lm_head.weight"  # (measured: 0.2% apart; every other gradient closer still)
    assert chunked_grads[head].dtype == torch.float32 and relative(chunked_grads[head], plain_grads[head]) < 1e-2
    assert max(relative(chunked_grads[k], plain_grads[k]) for k in plain_grads) < 1e-2


def test_lora_off_the_head_chunks_and_lora_on_the_head_keeps_the_plain_loss(tiny_model_dir, small_chunks):
    from peft import LoraConfig, get_peft_model

    inputs, targets = batch()
    for modules, expect_chunked in ((["q_proj", "v_proj"], True), (["q_proj", "lm_head"], False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft's own deprecation notice
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                   LoraConfig(r=4, target_modules=modules, task_type="CAUSAL_LM"))
        assert (output_head(model) is not None) is expect_chunked
        chunked_value, chunked_grads = loss_and_grads(model, inputs, targets, chunked=True)
        plain_value, plain_grads = loss_and_grads(model, inputs, targets, chunked=False)
        assert chunked_value == pytest.approx(plain_value, rel=1e-6)
        assert chunked_grads.keys() == plain_grads.keys() and chunked_grads  # the adapter's, and only those
        assert max(relative(chunked_grads[k], plain_grads[k]) for k in plain_grads if plain_grads[k].norm()) < 1e-5


def test_a_model_with_logit_soft_capping_keeps_the_plain_loss():
    config = Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0)
    model = Gemma2ForCausalLM(config)
    assert output_head(model) is None
    inputs, targets = batch()
    inputs = {key: value % 300 for key, value in inputs.items()}
    targets = torch.where(targets == IGNORE_INDEX, targets, targets % 300)
    with torch.no_grad():
        assert float(language_model_loss(model, inputs, targets)) == pytest.approx(
            float(summed_token_loss(model(**inputs).logits, targets)), rel=1e-6)


def test_the_memory_estimate_follows_the_loss_path(tiny_model_dir):
    from tuneloop.config import config_from_dict
    from tuneloop.plan.memory import estimate_memory
    from tuneloop.resolved import resolve_config
    from tuneloop.model.kinds import MODEL_KINDS
    from tuneloop.plan.model_facts import model_facts

    estimates = {}
    for chunked in (None, False):
        cfg = config_from_dict({"base_model": str(tiny_model_dir), "datasets": [{"path": "x"}],
                                "chunked_cross_entropy": chunked})
        facts = model_facts(cfg, MODEL_KINDS["causal"])
        assert facts.chunked_loss is (chunked is None)
        estimates[chunked] = estimate_memory(cfg, facts, tokens_per_micro_batch=1 << 20, precision="no",
                                             engine=resolve_config(cfg).engine)
    vocab, hidden = 400, 64
    whole_logits = (1 << 20) * vocab * 4 * 2
    one_chunk = output_head_module.chunk_tokens(vocab) * vocab * 4 * 2 + vocab * hidden * 4
    saved = estimates[False].activations_gb - estimates[None].activations_gb
    assert saved == pytest.approx((whole_logits - one_chunk) / 1e9, abs=2e-3)
