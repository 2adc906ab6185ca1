"""SDPA per sequence on packed rows (kernels/packed_attention.py): the same attention as SDPA under the block-diagonal
mask, forward and backward, fp32 and bf16; it splits only rows that are packed and worth it, and the plan
chooses it for packed CPU runs, and for padded rows on a CPU (each row's real tokens apart)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tuneloop.kernels import packed_attention
from tuneloop.kernels.packed_attention import (PER_SEQUENCE_SDPA, loadable, packed_lengths, per_sequence_sdpa,
                                               worth_splitting)


class Attending(torch.nn.Module):
    """What transformers' attention modules give an attention function: grouping and causality."""

    num_key_value_groups = 2
    is_causal = True


def positions_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def block_diagonal_mask(positions: torch.Tensor) -> torch.Tensor:
    sequence = (positions == 0).cumsum(-1)
    width = positions.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (sequence[:, None, :, None] == sequence[:, None, None, :]) & causal


def test_packed_lengths_reads_packed_rows_and_refuses_everything_else():
    assert packed_lengths(positions_of([[3, 5], [8]]), 8) == [[3, 5], [8]]
    assert packed_lengths(torch.arange(6)[None], 6) == [[6]]
    # HF generate's left padding: pads sit at position 1, the prompt starts after them
    assert packed_lengths(torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]), 5) is None
    assert packed_lengths(torch.tensor([[0, 1, 3, 4]]), 4) is None  # a jump that is not a restart
    assert packed_lengths(torch.arange(6)[None], 1) is None  # decoding: one query against a longer cache
    assert packed_lengths(None, 4) is None
    assert packed_lengths(positions_of([[3, 5]]), 8, rows=2) is None  # one row of positions for a batch of two


def test_splitting_is_chosen_for_long_sequences_in_long_rows_not_for_many_tiny_ones():
    assert worth_splitting([[300] * 7], 2100, "bf16")
    assert not worth_splitting([[8] * 32], 256, "bf16")  # 32 calls cost more than one 256² mask
    assert not worth_splitting([[512], [512]], 512, "fp32")  # one sequence a row: plain causal SDPA already


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_equals_sdpa_under_the_block_diagonal_mask(dtype, monkeypatch):
    monkeypatch.setattr(packed_attention, "_last_split", (None, None))
    torch.manual_seed(0)
    # under bf16: sequences below BF16_FLASH_FROM in fp32, the 520-token one in bf16 beside a short one in its row
    rows = [[300, 40, 172, 128], [520, 120]]
    positions = positions_of(rows)
    q = torch.randn(2, 4, 640, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 640, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 640, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 640, 4, 16, dtype=dtype)
    results = []
    for attend in (lambda: per_sequence_sdpa(Attending(), q, k, v, block_diagonal_mask(positions), scaling=0.25,
                                             position_ids=positions),
                   lambda: sdpa_attention_forward(Attending(), q, k, v, block_diagonal_mask(positions), scaling=0.25)):
        out, _ = attend()
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    assert packed_attention._last_split[1] == rows  # it did split
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for apart, masked in zip(*results):
        assert (apart - masked).abs().max() < tolerance * max(1.0, masked.abs().max())


def test_a_model_loaded_with_it_trains_packed_rows_like_sdpa_and_saves_a_plain_folder(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setattr(packed_attention, "CALL_COST", {"bf16": 0, "fp32": 0})  # split even these short rows
    monkeypatch.setattr(packed_attention, "_last_split", (None, None))
    torch.manual_seed(0)
    rows = [[20, 9, 35], [30, 34]]
    ids = torch.randint(3, 200, (2, 64))
    gradients = {}
    for name in ("sdpa", PER_SEQUENCE_SDPA):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation=loadable(name))
        model.config.use_cache = False
        loss = model(input_ids=ids, position_ids=positions_of(rows), labels=ids).loss
        loss.backward()
        gradients[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert packed_attention._last_split[1] == rows
    assert torch.allclose(gradients["sdpa"], gradients[PER_SEQUENCE_SDPA], atol=1e-6)
    model.save_pretrained(tmp_path)
    assert PER_SEQUENCE_SDPA not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_under_bf16_autocast_the_split_matches_sdpa_to_bf16_precision(tiny_model_dir, monkeypatch):
    """fp32 weights under autocast: RoPE leaves q and k in fp32 and v in bf16; the split casts them once, as
    autocast would for SDPA."""
    monkeypatch.setattr(packed_attention, "CALL_COST", {"bf16": 0, "fp32": 0})
    monkeypatch.setattr(packed_attention, "_last_split", (None, None))
    torch.manual_seed(0)
    rows = [[20, 9, 35], [30, 34]]
    ids = torch.randint(3, 200, (2, 64))
    losses = {}
    for name in ("sdpa", PER_SEQUENCE_SDPA):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation=loadable(name))
        model.config.use_cache = False
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = float(model(input_ids=ids, position_ids=positions_of(rows), labels=ids).loss.detach())
    assert packed_attention._last_split[1] == rows
    assert losses[PER_SEQUENCE_SDPA] == pytest.approx(losses["sdpa"], rel=1e-2)


def test_models_outside_the_attention_interface_keep_sdpa():
    from transformers import FalconConfig, LlamaConfig

    from tuneloop.kernels.packed_attention import model_can_split

    assert model_can_split(LlamaConfig()) and not model_can_split(FalconConfig())
    # attention dropout: neither flash kernel has it, so the rows stay under SDPA's mask (and the plan says sdpa)
    assert not model_can_split(LlamaConfig(attention_dropout=0.1))


def test_with_attention_dropout_the_rows_run_sdpa_under_their_mask(monkeypatch):
    monkeypatch.setattr(packed_attention, "_last_split", (None, None))
    rows = [[300, 40], [200, 140]]
    positions = positions_of(rows)
    q, k, v = torch.randn(2, 4, 340, 16), torch.randn(2, 2, 340, 16), torch.randn(2, 2, 340, 16)
    outputs = []
    for attend in (per_sequence_sdpa, sdpa_attention_forward):
        torch.manual_seed(0)
        outputs.append(attend(Attending(), q, k, v, block_diagonal_mask(positions), dropout=0.3, scaling=0.25,
                              position_ids=positions)[0])
    assert torch.equal(*outputs)
    assert packed_attention._last_split == (None, None)  # not even weighed


def test_sequences_apart_is_sdpa_on_each_sequence_under_autograd_to_the_bit(monkeypatch):
    """As a bf16 run meets it: q and k in fp32 (RoPE's), v in bf16, under autocast; short sequences in fp32, one of
    BF16_FLASH_FROM tokens or more in bf16, and a padded row's padding (zeros out, no gradient). The reference is
    SDPA called on each sequence's slices, in the dtypes autocast would give it, joined by autograd."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from tuneloop.kernels.sequences_apart import sequences_apart

    monkeypatch.setattr(packed_attention, "BF16_FLASH_FROM", 64)
    torch.manual_seed(0)
    pieces = [(0, 0, 70, True), (0, 70, 20, True), (0, 90, 6, True), (1, 0, 33, True), (1, 33, 63, False)]
    q = torch.randn(2, 4, 96, 16, requires_grad=True)
    k = torch.randn(2, 2, 96, 16, requires_grad=True)
    v = torch.randn(2, 2, 96, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 96, 4, 16, dtype=torch.bfloat16)

    def reference():
        parts = []
        for row, start, length, attended in pieces:
            if not attended:
                parts.append(torch.zeros(length, 4, 16, dtype=torch.float32))
                continue
            compute = torch.float32 if length < 64 else torch.bfloat16
            cut = [t[row, :, start:start + length].to(torch.bfloat16).to(compute)[None] for t in (q, k, v)]
            parts.append(sdpa(*cut, is_causal=True, scale=0.25, enable_gqa=True)[0].transpose(0, 1).float())
        return torch.cat(parts).to(torch.bfloat16).view(2, 96, 4, 16)

    results = []
    for attend in (lambda: sequences_apart(q, k, v, pieces, 0.25, torch.bfloat16, 64), reference):
        out = attend()
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    assert [t.dtype for t in results[0]] == [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    for apart, joined in zip(*results):
        assert torch.equal(apart, joined)
    assert not results[0][0][1, 33:].any() and not results[0][1][1, :, 33:].any()  # the padding: zeros, no gradient


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the split also needs torch's varlen kernel and a "
                    "16-bit run (benchmarks/gpu_check.py checks it there)")
def test_resolved_per_sequence_for_packed_runs():
    from tuneloop.config import config_from_dict
    from tuneloop.resolved import attention

    def used(**keys):
        cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], **keys})
        return attention(cfg, packed=bool(cfg.sample_packing)).used

    assert used(sample_packing=True) == PER_SEQUENCE_SDPA
    assert used(sample_packing=True, flash_attention=True) == PER_SEQUENCE_SDPA  # no GPU here: SDPA's stand-in
    assert used(sample_packing=True, eager_attention=True) == "eager"
    assert used(sample_packing=False) == "sdpa"
    assert used(sample_packing=True, attn_implementation="sdpa") == "sdpa"  # transformers' SDPA path, as named
    assert used(sample_packing=False, attn_implementation=PER_SEQUENCE_SDPA) == PER_SEQUENCE_SDPA


# ---- padded rows (no packing), on a CPU: each row's real tokens apart -------------------------------------------
def padding_mask(lengths: list[int], width: int) -> torch.Tensor:
    """What transformers' sdpa_mask builds for right-padded rows: causal, over each row's real keys."""
    real = torch.arange(width) < torch.tensor(lengths)[:, None]
    return torch.ones(width, width, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]


def test_padded_lengths_reads_right_padding_and_refuses_every_other_mask():
    from tuneloop.kernels.packed_attention import padded_lengths

    assert padded_lengths(padding_mask([5, 8, 3], 8), 3, 8) == [5, 8, 3]
    left = padding_mask([8, 8], 8).clone()
    left[0, :, :, :3] = False  # left padding: the first keys are the pads
    assert padded_lengths(left, 2, 8) is None
    window = padding_mask([8], 8) & (torch.arange(8)[:, None] - torch.arange(8)[None, :] < 4)  # a binding window
    assert padded_lengths(window, 1, 8) is None
    assert padded_lengths(padding_mask([5, 8], 8).float(), 2, 8) is None  # an additive mask
    assert padded_lengths(padding_mask([0, 8], 8), 2, 8) is None  # a row of padding only
    assert padded_lengths(padding_mask([5, 8], 8), 3, 8) is None and padded_lengths(None, 2, 8) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_apart_equal_sdpa_under_the_padding_mask(dtype, monkeypatch):
    """Real positions' outputs and every q/k/v gradient equal; the padding's outputs are zeros (in a model nothing
    real reads them, so no gradient reaches them: the upstream gradient is zero there, as here)."""
    monkeypatch.setattr(packed_attention, "_last_padded", (lambda: None, None))
    torch.manual_seed(0)
    lengths, width = [600, 130, 37], 600  # under bf16 the 600-token row runs in bf16, the others in fp32
    mask = padding_mask(lengths, width)
    q = torch.randn(3, 4, width, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(3, 2, width, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(3, 2, width, 16, dtype=dtype, requires_grad=True)
    real = (torch.arange(width) < torch.tensor(lengths)[:, None])[:, :, None, None]  # (batch, width, 1, 1)
    grad = torch.randn(3, width, 4, 16, dtype=dtype) * real
    results = []
    for attend in (lambda: per_sequence_sdpa(Attending(), q, k, v, mask, scaling=0.25),
                   lambda: sdpa_attention_forward(Attending(), q, k, v, mask, scaling=0.25)):
        out, _ = attend()
        out.backward(grad)
        results.append([(out * real).detach().float()] + [t.grad.float() for t in (q, k, v)])
        if len(results) == 1:
            assert packed_attention._last_padded[1] == lengths  # it did split
            assert not out[1, 130:].any() and not out[2, 37:].any()  # the padding's outputs: zeros
        q.grad = k.grad = v.grad = None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for apart, masked in zip(*results):
        assert (apart - masked).abs().max() < tolerance * max(1.0, masked.abs().max())


def test_a_model_trains_padded_rows_like_sdpa(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(packed_attention, "CALL_COST", {"bf16": 0, "fp32": 0})
    monkeypatch.setattr(packed_attention, "_last_padded", (lambda: None, None))
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (3, 48))
    attention = (torch.arange(48) < torch.tensor([48, 30, 11])[:, None]).long()
    labels = ids.masked_fill(attention == 0, -100)
    gradients, losses = {}, {}
    for name in ("sdpa", PER_SEQUENCE_SDPA):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation=loadable(name))
        model.config.use_cache = False
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        losses[name] = float(loss.detach())
        gradients[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert packed_attention._last_padded[1] == [48, 30, 11]
    assert losses[PER_SEQUENCE_SDPA] == pytest.approx(losses["sdpa"], abs=1e-6)
    assert torch.allclose(gradients["sdpa"], gradients[PER_SEQUENCE_SDPA], atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="padded rows split on a CPU only")
def test_an_unpacked_cpu_run_plans_each_rows_real_tokens_apart(tiny_model_dir, tmp_path):
    from conftest import base_config, run_in_process, tiny_rows, write_config, write_jsonl

    data = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(24))
    plans = {}
    for name, extra in (("default", {}), ("sdpa", {"attn_implementation": "sdpa"})):
        config = write_config(tmp_path / f"{name}.yml", **base_config(tmp_path / name, tiny_model_dir, data, **extra))
        planned = run_in_process("plan", str(config), "--json")
        assert planned.returncode == 0, planned.stderr[-3000:]
        plans[name] = json.loads(planned.stdout)
    assert plans["default"]["attention"] == PER_SEQUENCE_SDPA
    assert "each row's real tokens on their own, without its padding," in plans["default"]["attention_split"]
    assert plans["sdpa"]["attention"] == "sdpa" and plans["sdpa"]["attention_split"] is None
