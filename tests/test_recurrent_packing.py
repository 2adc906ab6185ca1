"""Packing and models whose layers carry state along the sequence outside attention (Qwen3.5 / Qwen3-Next
linear attention, Mamba, Jamba, LFM2's short convolutions): transformers' kernels here take no sequence
boundaries, so a packed row's second sequence would see the first. Such a run is grouped by length instead, and
the plan says why (the twin configs in test_axolotl_configs.py show it end to end)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tuneloop.model.kinds import recurrent_layers


@pytest.mark.parametrize("model_type, extra, expected", [
    ("llama", {}, None),
    ("gemma3_text", {}, None),
    ("qwen3_5_text", {}, "qwen3_5_text's linear_attention layers"),
    ("qwen3_next", {}, "qwen3_next's linear_attention layers"),
    ("jamba", {}, "jamba's linear_attention layers"),
    ("mamba", {}, "mamba's linear_attention layers"),
    ("lfm2", {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2}, "lfm2's conv layers"),
    ("falcon_h1", {}, "falcon_h1's hybrid layers"),
    ("nemotron_h", {}, "nemotron_h's linear_attention layers"),
    # attention under newer names keeps packing: DeepSeek V3.2's indexed attention, V4's compressed kinds
    ("deepseek_v32", {}, None),
    ("deepseek_v4", {}, None),
])
def test_layers_that_carry_state_outside_attention_are_named(model_type, extra, expected):
    assert recurrent_layers(AutoConfig.for_model(model_type, **extra)) == expected


def test_a_composite_configs_text_part_is_read():
    config = AutoConfig.for_model("qwen3_5", text_config={"num_hidden_layers": 4})
    assert recurrent_layers(config) == "qwen3_5_text's linear_attention layers"


def tiny(model_type: str, **sizes):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, **sizes)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def second_sequence_logits(model, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second sequence's logits packed after the first (positions restart at 0, as tuneloop packs) and alone."""
    packed = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
    with torch.no_grad():
        # (no cache, as in training: transformers finds packed sequences in the positions only without one)
        together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0, len(first):]
        alone = model(input_ids=second[None], use_cache=False).logits[0]
    return together, alone


def test_why_the_packing_is_set_aside_qwen3_5s_layers_carry_the_first_sequence_into_the_second():
    """The trap itself, on this stack: Qwen3.5's gated-delta-net layers ignore where a packed sequence starts. (If
    a later transformers separates them, this fails, and packing these models can come back.)"""
    model = tiny("qwen3_5_text", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                 intermediate_size=64, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16)
    first, second = torch.arange(3, 23), torch.arange(30, 42)
    together, alone = second_sequence_logits(model, first, second)
    assert not torch.allclose(together, alone, atol=1e-3)


def test_an_attention_only_model_keeps_packed_sequences_apart_by_their_positions():
    """The contrast: the same check on a LLaMA passes, so what differs above is the recurrent layers."""
    model = tiny("llama", num_hidden_layers=2, intermediate_size=64)
    together, alone = second_sequence_logits(model, torch.arange(3, 23), torch.arange(30, 42))
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_a_packed_stream_on_a_recurrent_model_is_refused_rather_than_dropping_its_long_documents():
    """Grouped by length, a stream's rows are its documents whole, and every one longer than sequence_len would
    be dropped unseen: the run is refused, pointing to prepared data."""
    from tuneloop.config.load import config_from_dict
    from tuneloop.errors import UserError
    from tuneloop.resolved import resolve_run

    config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=2, layer_types=["linear_attention",
                                                                                     "full_attention"])
    keys = {"base_model": "m", "sequence_len": 64, "micro_batch_size": 1, "max_steps": 2}
    streamed = config_from_dict({**keys, "pretraining_dataset": [{"path": "corpus.jsonl"}], "streaming": True})
    with pytest.raises(UserError, match="streams its documents packed.*qwen3_5_text's linear_attention layers.*"
                                        "prepared data instead"):
        resolve_run(streamed, config)
    prepared = config_from_dict({**keys, "datasets": [{"path": "corpus.jsonl", "type": "completion"}],
                                 "sample_packing": True})
    assert resolve_run(prepared, config).batching == "group_by_length"
