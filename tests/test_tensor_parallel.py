"""Tensor parallel (`tensor_parallel_size`, engines/tensor_parallel.py): each decoder layer's projections split over
the tp ranks by torch's parallelize_module from transformers' own table, under FSDP2 on the mesh's data part.
Refusals name the key at `plan --world-size` (sizes the heads do not divide, an adapter, another engine), the plan
divides the layers' bytes by tp, and 2 real gloo ranks (tp 2) end with one process's weights (fp32)."""

from __future__ import annotations

import json

import pytest
from conftest import (assert_user_error, base_config, read_metrics, run_in_process, run_two_ranks, tiny_rows,
                      write_config, write_jsonl)

from tuneloop.engines.tensor_parallel import _matches, check_tensor_parallel, layer_table
from tuneloop.errors import UserError

FSDP = {"fsdp_version": 2, "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                           "state_dict_type": "SHARDED_STATE_DICT"}}
TP = {**FSDP, "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", tiny_rows(64, seed=5))


def planned(tmp_path, tiny_model_dir, data, world: int, name: str, **keys):
    config = write_config(tmp_path / f"{name}.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    return run_in_process("plan", str(config), "--json", "--world-size", str(world))


# ---- the model's own table, and what it cannot split ------------------------------------------------------------
def test_the_table_is_transformers_own_and_its_patterns_match_layer_names():
    from transformers import LlamaConfig, Qwen3Config

    assert layer_table(LlamaConfig())["layers.*.self_attn.q_proj"] == "colwise"
    assert layer_table(Qwen3Config())["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert _matches("layers.3.self_attn.q_norm", ["layers.*.self_attn.q_norm"])
    assert not _matches("layers.3.self_attn.q_norm.extra", ["layers.*.self_attn.q_norm"])


@pytest.mark.parametrize("sizes, fragment", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, "does not divide the model's num_attention_heads (6)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1}, "num_key_value_heads (1)"),
])
def test_sizes_the_tp_ranks_do_not_divide_are_refused(sizes, fragment):
    from transformers import LlamaConfig

    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(LlamaConfig(hidden_size=96, intermediate_size=128, **sizes), 4)


def test_a_family_without_a_table_is_refused_naming_it():
    from transformers import GPT2Config

    with pytest.raises(UserError, match="gpt2 model has no tensor-parallel table"):
        check_tensor_parallel(GPT2Config(), 2)


@pytest.mark.parametrize("keys, fragment", [
    ({"tensor_parallel_size": 2}, "`tensor_parallel_size: 2` splits the layers over ranks on FSDP2"),
    ({**TP, "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True},
     "`tensor_parallel_size: 2` with `adapter: lora`"),
    ({**TP, "tensor_parallel_size": 4}, "does not divide the model's num_key_value_heads (2)"),
    ({**TP, "dp_shard_size": 2}, "dp_shard_size 2 × tensor_parallel_size 2 does not divide the world size 2"),
])
def test_what_tensor_parallel_cannot_run_stops_the_plan(tmp_path, tiny_model_dir, data, keys, fragment):
    assert_user_error(planned(tmp_path, tiny_model_dir, data, 2 if keys.get("tensor_parallel_size") != 4 else 4,
                              "refused", **keys), fragment)


def test_the_plan_shows_the_mesh_counts_data_ranks_and_divides_the_layers(tmp_path, tiny_model_dir, data):
    tp, fsdp_one = (planned(tmp_path, tiny_model_dir, data, world, name, **keys)
                    for world, name, keys in ((2, "tp", TP), (1, "one", FSDP)))
    for result in (tp, fsdp_one):
        assert result.returncode == 0, result.stderr[-2000:]
    tp, fsdp_one = json.loads(tp.stdout), json.loads(fsdp_one.stdout)
    assert tp["mesh"] == "mesh dp_replicate 1 × dp_shard 1 × tp 2 × cp 1"
    # the two tp ranks read the same rows: the global batch and the steps are one process's
    assert tp["data_ranks"] == 1 and tp["global_batch_size"] == fsdp_one["global_batch_size"]
    assert tp["total_steps"] == fsdp_one["total_steps"]
    whole, split = fsdp_one["memory"]["per_rank_bytes"]["weights"], tp["memory"]["per_rank_bytes"]["weights"]
    assert whole / 2 < split < whole  # the layers halved, the embeddings and head whole


# ---- 2 gloo ranks, tp 2, against one process ------------------------------------------------------------------------
STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-2, "max_grad_norm": 1.0, "max_steps": 4,
         "lr_scheduler": "cosine", "warmup_steps": 1, "num_epochs": 1, "micro_batch_size": 2,
         "gradient_accumulation_steps": 2}


def relative_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


@pytest.mark.slow
def test_two_tensor_parallel_ranks_end_with_one_process_weights(tmp_path, tiny_model_dir, data):
    """Same rows on both tp ranks (one data rank), so the global batch is one process's: 2 × 2 accumulated. The
    weight change after 4 AdamW steps (clipped) agrees too, and the saved folder is one plain HF model. Its
    checkpoint at step 2 (DCP shards of the dp × tp mesh) resumes on one FSDP2 process, resharded, and ends with
    one process's weights too."""
    import shutil

    from safetensors.torch import load_file

    runs, losses = {}, {}
    for name, keys in (("one", {}), ("tp", {**TP, "save_strategy": "steps", "save_steps": 2})):
        run_dir = tmp_path / name
        run_dir.mkdir()
        config = write_config(run_dir / "run.yml", **base_config(run_dir, tiny_model_dir, data, **STEPS, **keys))
        result = run_two_ranks("train", str(config)) if keys else run_in_process("train", str(config))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        out = run_dir / "out"
        runs[name] = (json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text()),
                      load_file(out / "model.safetensors"))
        losses[name] = [line["loss"] for line in read_metrics(out) if "loss" in line and "eval_loss" not in line]
    (_, one_summary, one), (plan, summary, tp) = runs["one"], runs["tp"]
    # the logged losses and the counts are one process's: rows the tp ranks share are counted once
    assert losses["tp"] == pytest.approx(losses["one"], rel=1e-5) and len(losses["tp"]) == STEPS["max_steps"]
    for key in ("real_tokens", "targets_collated"):
        assert summary[key] == one_summary[key], key
    assert summary["steps"] == plan["total_steps"] == STEPS["max_steps"]
    assert summary["mesh"] == plan["mesh"] == "mesh dp_replicate 1 × dp_shard 1 × tp 2 × cp 1"
    held, per_rank = summary["held_bytes_per_rank"], plan["memory"]["per_rank_bytes"]
    print("\nheld", held, "planned", per_rank)
    for rank in held:  # each rank held its half of the layers' projections and whole embeddings, norms and head
        for part in ("weights", "optimizer"):
            assert rank[part] == pytest.approx(per_rank[part], rel=0.03), (part, held, per_rank)
    start = load_file(tiny_model_dir / "model.safetensors")
    difference = relative_difference(tp, one)
    change = relative_difference({k: tp[k] - start[k] for k in start if k in tp},
                                 {k: one[k] - start[k] for k in start if k in one})
    print(f"\ntp 2 vs one process: weights {difference:.3g}, weight change {change:.3g}")
    assert difference < 1e-5 and change < 1e-4

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "tp" / "out" / "checkpoint-2", resumed_dir / "out" / "checkpoint-2")
    config = write_config(resumed_dir / "run.yml", **base_config(
        resumed_dir, tiny_model_dir, data, **STEPS, auto_resume_from_checkpoints=True, **FSDP))
    resumed = run_in_process("train", str(config), "--force-resume")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    resumed_difference = relative_difference(load_file(resumed_dir / "out" / "model.safetensors"), one)
    print(f"tp 2 checkpoint-2 resumed on one FSDP2 process vs one process: {resumed_difference:.3g}")
    assert resumed_difference < 1e-5


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_plans_activations_divide_the_heads_and_mlp_part_over_the_tp_ranks(checkpointing):
    """Of a layer's 34 values per token and hidden unit (Korthikanti et al. 2022), the 24 of the heads and the MLP
    are split over the tp ranks and the 10 around them stay whole; checkpointed layers' inputs stay whole too. The
    loss's logits chunk is whole on every tp rank (the head is)."""
    from types import SimpleNamespace

    from tuneloop.plan.memory import _activations

    text = SimpleNamespace(hidden_size=1024, num_hidden_layers=8, vocab_size=32000)
    facts = SimpleNamespace(text_config=text, chunked_loss=True, decoder_layers=None)  # (not a LLaMA-formula model)
    cfg = SimpleNamespace(bfloat16=False, float16=False)
    tokens, per_layer = 4096, 4096 * 1024 * 2
    logits = _activations(cfg, facts, tokens, "bf16", checkpointing=checkpointing) - (
        per_layer * (8 + 34) if checkpointing else per_layer * 8 * 34)
    for tp in (1, 2, 4):
        layers = per_layer * (8 + 10 + 24 / tp) if checkpointing else per_layer * 8 * (10 + 24 / tp)
        assert (_activations(cfg, facts, tokens, "bf16", tp, checkpointing=checkpointing)
                == pytest.approx(layers + logits))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_llama_layers_kept_tensors_divide_over_the_tp_ranks_but_the_norms_and_shared_inputs(checkpointing):
    """LLaMA-formula layers counted tensor by tensor (plan/activations.py): the norms' inputs and the inputs of the
    q/k/v and gate/up projections stay whole on every tp rank (those projections are column-parallel: every rank
    reads the whole input), the attention's tensors, the SiLU product's inputs, o_proj's and down_proj's inputs and
    an adapter's outputs are split; a checkpointed layer keeps its input whole."""
    from types import SimpleNamespace

    from tuneloop.plan.activations import DecoderLayers
    from tuneloop.plan.memory import _activations

    hidden, layers = 1024, 8
    counted = DecoderLayers(layers=layers, hidden=hidden, norms=2 * hidden * layers, attention=3000 * layers,
                            gate_and_up=5000 * layers,
                            inputs_each={"attention input": 3 * hidden * layers, "attention output": hidden * layers,
                                         "mlp input": 2 * hidden * layers, "mlp product": 2500 * layers},
                            inputs_shared={}, adapter_outputs=0)
    text = SimpleNamespace(hidden_size=hidden, num_hidden_layers=layers, vocab_size=32000)
    facts = SimpleNamespace(text_config=text, chunked_loss=True, decoder_layers=counted)
    cfg = SimpleNamespace(bfloat16=False, float16=False)
    tokens = 4096
    whole = 2 * hidden * 4 + (3 * hidden + 2 * hidden) * 2  # per layer and token: fp32 norms' inputs, bf16 inputs
    split = 3000 * 4 + (5000 + hidden + 2500) * 2  # (attention in fp32 on a CPU)
    logits = _activations(cfg, facts, tokens, "bf16", 1, on_cpu=True, checkpointing=checkpointing) - tokens * (
        hidden * 4 * layers + whole + split if checkpointing else (whole + split) * layers)
    for tp in (1, 2, 4):
        every_layer = whole + split / tp
        expected = tokens * (hidden * 4 * layers + every_layer if checkpointing else every_layer * layers)
        assert (_activations(cfg, facts, tokens, "bf16", tp, on_cpu=True, checkpointing=checkpointing)
                == pytest.approx(expected + logits))
