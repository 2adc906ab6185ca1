"""torch_compile and MFU.

Compiling changes speed, not what is trained: a compiled run's losses and weights equal the eager run's to float
tolerance, its widths are rounded up to multiples of 64 as the plan says, and the first (compiling) step is
timed apart. MFU counts model FLOPs from the model as built (every weight matrix a token meets, attention over
the data's own context lengths) over a peak that `peak_tflops` can set, and the step lines and the summary
carry it, from the plan's own numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tuneloop.config import config_from_dict
from tuneloop.data.collate import Padding, padding_for
from tuneloop.plan.model_facts import count_matmul_weights
from tuneloop.plan.flops import attention_context, count_flops, gpu_table_peak
from tuneloop.resolved import resolve_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("compile_data") / "train.jsonl", tiny_rows(24, seed=9))


# ---- MFU: the count ------------------------------------------------------------------------------------------

def test_attention_context_is_the_mean_over_tokens_of_the_positions_each_attends_to():
    # a row of 1 token attends to 1 position; a row of 3 to 1, 2 and 3: (1 + 6) / 4 tokens
    assert attention_context(np.array([1, 3])) == pytest.approx(7 / 4)


def test_model_flops_count_every_matrix_once_and_attention_by_hand(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = model.config
    hidden, inner, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, \
        config.vocab_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner  # q, o; k, v; gate, up, down
    matrices = layers * per_layer + vocab * hidden  # and the output head (the input embedding is looked up)
    assert count_matmul_weights(model) == (0, matrices)
    counted = count_flops(config, 0, matrices, np.array([10, 30]))
    context = (10 * 11 / 2 + 30 * 31 / 2) / 40
    assert counted.per_token == pytest.approx(6 * matrices + 12 * layers * hidden * context)


def test_the_head_is_counted_only_for_the_positions_with_a_target():
    from tuneloop.plan.flops import head_flops_skipped

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert head_flops_skipped((400 * 64, True), 1000, 250) == pytest.approx(6 * 400 * 64 * 0.75)
    assert head_flops_skipped((400 * 64, False), 1000, 250) == pytest.approx(4 * 400 * 64 * 0.75)  # frozen (LoRA)
    assert head_flops_skipped((0, False), 1000, 250) == 0  # the plain loss multiplies every position
    full = count_flops(config, 0, 10**6, np.array([8])).per_token
    assert count_flops(config, 0, 10**6, np.array([8]), 1234.0).per_token == pytest.approx(full - 1234.0)


def test_a_frozen_matrix_costs_4_flops_per_weight_and_a_trained_one_6(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    frozen, trained = count_matmul_weights(model)
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    assert trained == layers * 2 * 4 * hidden  # lora_A and lora_B of each q_proj
    base = count_matmul_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir))[1]
    assert frozen == base
    assert count_flops(model.config, frozen, trained, np.array([1])).per_token == pytest.approx(
        4 * frozen + 6 * trained + 12 * layers * hidden * 1)


def test_mixture_of_experts_and_encoder_decoder_models_say_why_mfu_is_not_counted():
    moe = LlamaConfig(num_local_experts=8)
    assert count_flops(moe, 1, 1, np.array([4])).why_not.startswith("not counted for mixture-of-experts")
    encoder_decoder = LlamaConfig(is_encoder_decoder=True)
    assert "encoder-decoder" in count_flops(encoder_decoder, 1, 1, np.array([4])).why_not


def test_the_gpu_table_knows_the_common_training_gpus_and_not_others():
    assert gpu_table_peak("NVIDIA H100 PCIe") == 756e12 and gpu_table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_table_peak("NVIDIA H200") == 989e12 and gpu_table_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_table_peak("Tesla T4") is None


@pytest.mark.slow
def test_step_lines_and_summary_carry_mfu_from_the_plans_numbers(tmp_path, tiny_model_dir, data):
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=3,
                                                              peak_tflops=0.002, val_set_size=0.2, eval_steps=1))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "MFU against 0.002 TFLOPS per CPU (peak_tflops)" in result.stdout
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["peak_flops"] == pytest.approx(2e9) and plan["flops_per_token"] > 0
    lines = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    for line in lines[1:]:
        assert line["mfu"] == pytest.approx(line["real_tokens_per_second"] * plan["flops_per_token"] / 2e9,
                                            rel=1e-3, abs=1e-4)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # the steps' own pace: the evals inside the loop (and their unforeseen FLOPs) are left out of MFU
    assert summary["mfu"] == pytest.approx(summary["real_tokens_per_second_of_the_steps"]
                                           * plan["flops_per_token"] / 2e9, rel=1e-3)
    assert summary["real_tokens_per_second_of_the_steps"] > summary["real_tokens_per_second_after_first_step"]
    assert f"MFU {summary['mfu']:.1%}" in result.stdout


# ---- torch_compile ---------------------------------------------------------------------------------------------

def test_under_compile_widths_round_up_to_64_but_never_past_sequence_len():
    cfg = config_from_dict({"base_model": "m", "datasets": [{"path": "x"}], "sequence_len": 200,
                            "torch_compile": True})
    padding = padding_for(cfg, resolve_config(cfg).compiled)
    assert [padding.width(n) for n in (1, 64, 65, 190, 193, 200)] == [64, 64, 128, 192, 200, 200]
    eager = cfg.model_copy(update={"torch_compile": False})
    assert padding_for(eager, resolve_config(eager).compiled) == Padding(None, 1, 200)


@pytest.mark.slow
def test_a_compiled_run_trains_what_the_eager_run_trains(tmp_path, tiny_model_dir, data):
    """Three steps eager and compiled (inductor, fp32), with an eval: the same losses, eval loss and weights to
    float tolerance (a compiled kernel sums in another order), the plan says it compiles and pads to 64, the
    first step is timed apart."""
    from torch._dynamo.utils import counters

    runs, graphs = {}, {}
    for name, compiled in (("eager", False), ("compiled", True)):
        keys = dict(max_steps=3, torch_compile=compiled, output_dir=str(tmp_path / name), val_set_size=0.25,
                    eval_steps=3)
        config = write_config(tmp_path / f"{name}.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
        counters.clear()
        result = run_in_process("train", str(config))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name], graphs[name] = result, counters["stats"]["unique_graphs"]
    assert graphs == {"eager": 0, "compiled": graphs["compiled"]} and graphs["compiled"] >= 1  # it did compile
    eager, compiled = (read_metrics(tmp_path / name) for name in ("eager", "compiled"))
    assert [m["loss"] for m in compiled if "loss" in m] == pytest.approx([m["loss"] for m in eager if "loss" in m],
                                                                       rel=1e-4)
    # evals run eagerly (no second, gradient-free graph to compile) and agree
    assert [m["eval_loss"] for m in compiled if "eval_loss" in m] == pytest.approx(
        [m["eval_loss"] for m in eager if "eval_loss" in m], rel=1e-4)
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in ("eager", "compiled")}
    for key, value in weights["eager"].items():
        # AdamW's first steps move an element by ~lr × g/(|g| + eps): where a gradient is near zero, a rounding-size
        # difference in it (the compiled kernels sum in another order) moves the element by a share of the learning
        # rate. Seen: 1 element of 4096 off by 2e-5, the rest within 5e-7. So a few such elements, each within the
        # three steps' reach; every other one to float tolerance
        off = ~torch.isclose(weights["compiled"][key], value, rtol=1e-4, atol=1e-5)
        assert int(off.sum()) <= max(1, value.numel() // 1000), key
        assert ((weights["compiled"][key] - value).abs()[off] <= 3 * 2 * 1e-3).all(), key  # 3 steps, each a flip of lr
    assert "compile              torch.compile (inductor)" in runs["compiled"].stdout
    assert "the first, compiling:" in runs["compiled"].stdout
    plans = {name: json.loads((tmp_path / name / "plan.json").read_text()) for name in ("eager", "compiled")}
    assert plans["compiled"]["torch_compile"] and plans["eager"]["torch_compile"] is None
    # the same rows, wider batches: more computed tokens, every width a multiple of 64
    assert plans["compiled"]["total_real_tokens"] == plans["eager"]["total_real_tokens"]
    assert plans["compiled"]["max_micro_batch_tokens"] % (64 * 4) == 0
    assert plans["compiled"]["padding_fraction"] > plans["eager"]["padding_fraction"]
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["first_step_seconds"] > 0


def test_the_cpu_peak_is_the_best_of_the_first_probes_and_a_figure_below_fewer_threads_is_measured_again(
        tmp_path, monkeypatch):
    """A probe that runs beside other work reads low, and the cached figure is every later run's MFU: the first
    runs probe again and keep the best; a figure for 2 threads below the 1-thread one (the 2 cores were shared
    when it was taken) is measured again; the ranks of one launch take the first one's figure. (The probe's
    readings are given here: what is tested is what is kept.)"""
    from tuneloop.plan import flops

    cache = tmp_path / "peaks.json"
    monkeypatch.setenv(flops.PEAK_CACHE_ENV, str(cache))
    readings = [5e9, 9e9, 7e9, 1e12, 3e12]
    monkeypatch.setattr(flops, "_probe", lambda device, dtype, threads: readings.pop(0))
    assert [flops.measured_peak("no", 1)[0] for _ in range(4)] == [5e9, 9e9, 9e9, 9e9]
    assert readings == [1e12, 3e12]  # three probes, then the cached best
    known = json.loads(cache.read_text())
    two_threads = next(iter(known)).replace("1 thread |", "2 threads |")
    known[two_threads] = 4e9  # a bare figure (the older format), below the 1-thread one
    cache.write_text(json.dumps(known))
    assert flops.measured_peak("no", 2)[0] == 1e12
    assert json.loads(cache.read_text())[two_threads] == {"flops": 1e12, "probes": 2, "launch": None}
    # the ranks of one launch plan with one figure: the second rank reads what the first measured (their plans,
    # and what they send each other, would differ otherwise)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "one-launch")
    assert flops.measured_peak("no", 2)[0] == 3e12 and readings == []
    readings.append(5e12)
    assert flops.measured_peak("no", 2)[0] == 3e12 and readings == [5e12]


def test_a_run_that_measures_the_peak_trains_what_a_run_that_read_it_from_the_cache_trains(
        tmp_path, tiny_model_dir, data, monkeypatch):
    """The peak is probed while the plan is built, after the seed is set; a run that probed started its adapter (and
    drew its dropout) elsewhere than one that read the cache (CI's two-rank resume test failed so: the straight run
    probed, the crashed one did not). The probe draws from a generator of its own, and the model is seeded again
    just before it is built."""
    from tuneloop.plan import flops

    cache = tmp_path / "peaks.json"
    monkeypatch.setenv(flops.PEAK_CACHE_ENV, str(cache))
    monkeypatch.setitem(flops.PROBE_SIZE, "cpu", 256)  # (a smaller square: the draw, not the figure, is tested)
    keys = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.2, lora_target_modules=["q_proj", "v_proj"],
                max_steps=2, bf16=False)
    adapters = {}
    for name in ("probed", "cached"):
        config = write_config(tmp_path / f"{name}.yml", **base_config(tmp_path / name, tiny_model_dir, data, **keys))
        result = run_in_process("train", str(config))
        assert result.returncode == 0, result.stderr[-2000:]
        adapters[name] = load_file(tmp_path / name / "out" / "adapter_model.safetensors")
        if name == "probed":  # the next run reads the figure: three probes are on record
            known = json.loads(cache.read_text())
            assert known, "the first run measured no peak"
            cache.write_text(json.dumps({key: dict(entry, probes=3) for key, entry in known.items()}))
    for key, value in adapters["probed"].items():
        assert torch.equal(value, adapters["cached"][key]), key
    before = torch.get_rng_state()
    flops._probe("cpu", torch.float32, 1)
    assert torch.equal(torch.get_rng_state(), before)  # the probe moves no one else's draws
