"""Quantization-aware training (`qat:`, quant/qat.py) and `tuneloop quantize` (use/quantize.py), on the tiny LLaMA:

- the fake quantization is in the forward from step `fake_quant_after_n_steps` on and not before: each eval of the
  run equals the plain model's eval (the same weights, from that step's checkpoint) up to that step, and the
  torchao-quantized model's from then on (whose forward equals torchao's fake-quantized one);
- the saved model is plain: the base's tensor names, no quantization config, from_pretrained loads it alone, and
  its weights are the last step's trained fp32 weights;
- `tuneloop quantize` writes a folder from_pretrained reloads, whose logits are the fake-quantized forward's, and
  quantizes as the run recorded it trained: a CONFIG edited since is refused;
- under FSDP2 (fully_shard, the example's keys) 2 ranks end with 2 DDP ranks' weights and save a plain model;
- what cannot run is refused at `check` in one line (NVFP4, an adapter, DeepSpeed), and a group size the layers do
  not take by `plan`.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (assert_user_error, base_config, read_metrics, run_in_process, tiny_rows,
                      write_config, write_jsonl)
from safetensors.torch import load_file
from test_sharded import relative_difference

pytest.importorskip("torchao")

QAT = {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32, "fake_quant_after_n_steps": 2}
STEPS = 4


def config_keys(run_dir, model_dir, data, **keys) -> dict:
    return base_config(run_dir, model_dir, data, **{
        "qat": QAT, "max_steps": STEPS, "optimizer": "adamw_torch", "lr_scheduler": "constant", "val_set_size": 0.25,
        "eval_steps": 1, "save_strategy": "steps", "save_steps": 1, **keys})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("qat_data") / "train.jsonl", tiny_rows(48, seed=11))


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, data):
    """Four steps, plain for the first two, fake-quantized after; an eval and a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("qat_run")
    config = write_config(run_dir / "run.yml", **config_keys(run_dir, tiny_model_dir, data))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return config, run_dir / "out", result


def quantized_copy(folder, tmp_path):
    """The folder's model quantized for real by `tuneloop quantize`'s code (QAT's settings)."""
    from tuneloop.config.qat_block import QATBlock
    from tuneloop.use.folders import ModelFolder
    from tuneloop.use.quantize import quantize_folder

    return quantize_folder(ModelFolder(folder), QATBlock(**QAT), tmp_path / f"quantized-{folder.name}")


def test_fake_quantization_starts_at_its_step(run, tmp_path):
    from tuneloop.config import load_config
    from tuneloop.use.evaluate_model import evaluate_model

    config, out, result = run
    assert "qat                  int4 weights in groups of 32, int8 activations (per token); every Linear " \
           "fake-quantized from step 3 on (after 2 plain steps)" in result.stdout
    cfg = load_config(str(config))
    evals = {line["step"]: line["eval_loss"] for line in read_metrics(out) if "eval_loss" in line}
    assert sorted(evals) == [1, 2, 3, 4]
    for step in range(1, STEPS + 1):
        weights = out / f"checkpoint-{step}" if step < STEPS else out  # (the last step's: the final model)
        plain = evaluate_model(cfg, str(weights))["eval_loss"]
        fake = evaluate_model(cfg, str(quantized_copy(weights, tmp_path)))["eval_loss"]
        assert abs(plain - fake) > 1e-4, (step, plain, fake)  # (the two are told apart, 20× the tolerance below)
        # the eval after step s runs as step s did: steps 0 and 1 plain, steps 2 and 3 (counted from 0) fake
        expected = fake if step > QAT["fake_quant_after_n_steps"] else plain
        assert evals[step] == pytest.approx(expected, rel=1e-6, abs=1e-6), (step, evals[step], plain, fake)


def test_saved_model_is_plain_and_trained(run, tiny_model_dir):
    """(That they are the weights step 4 trained is test_fake_quantization_starts_at_its_step's last eval.)"""
    from transformers import AutoModelForCausalLM

    from tuneloop.config.qat_block import QATBlock
    from tuneloop.quant.qat import FakeQuantization

    _, out, _ = run
    saved, base = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert set(saved) == set(base)
    assert all(tensor.dtype == torch.float32 for tensor in saved.values())
    before = load_file(out / f"checkpoint-{STEPS - 1}" / "model.safetensors")
    assert all(not torch.equal(saved[key], before[key]) for key in saved if key.endswith("proj.weight"))
    fake = AutoModelForCausalLM.from_pretrained(out)
    quantizers = FakeQuantization(fake, QATBlock(**QAT), step=STEPS)
    layer = fake.model.layers[0].mlp.up_proj
    rounded = layer.weight_fake_quantizer(layer.weight.detach())
    assert quantizers.enabled and not torch.equal(rounded, saved["model.layers.0.mlp.up_proj.weight"])  # unrounded
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert {type(module).__module__.split(".")[0] for module in model.modules()} <= {"torch", "transformers"}


def test_quantize_command_writes_a_reloadable_fake_quantized_model(run):
    from transformers import AutoModelForCausalLM

    from tuneloop.config.qat_block import QATBlock
    from tuneloop.quant.qat import FakeQuantization

    config, out, _ = run
    result = run_in_process("quantize", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((out / "quantized" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "torchao"
    quantized = AutoModelForCausalLM.from_pretrained(out / "quantized")
    assert type(quantized.model.layers[0].mlp.up_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    fake = AutoModelForCausalLM.from_pretrained(out)
    FakeQuantization(fake, QATBlock(**QAT), step=STEPS)
    plain = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, unquantized = quantized(ids).logits, fake(ids).logits, plain(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - unquantized).abs().max() > 1e-2
    again = run_in_process("quantize", str(config))  # never over a folder that holds something
    assert_user_error(again, "exists and is not empty")


def test_quantize_follows_what_the_run_recorded_and_refuses_a_config_edited_since(run, tmp_path):
    """The run trained at int4 (its run_config.yml says so): CONFIG edited to int8 since, or without its `qat:`
    block, is refused naming both and nothing is written; a change quantize does not read (when the fake
    quantization started) is not."""
    config, out, _ = run
    recorded = out / "run_config.yml"
    output = tmp_path / "quantized"
    edited = run_in_process("quantize", str(config), "--set", "qat.weight_dtype=int8", "--output", str(output))
    assert_user_error(edited, "qat.weight_dtype", "int8", "int4", str(recorded), "--model")
    assert not output.exists()
    assert_user_error(run_in_process("quantize", str(config), "--set", "qat=null", "--output", str(output)),
                      "no `qat:` block", "int4", str(recorded))
    started_later = run_in_process("quantize", str(config), "--set", "qat.fake_quant_after_n_steps=3",
                                   "--output", str(output))
    assert started_later.returncode == 0, started_later.stderr[-3000:]
    assert "int4 weights in groups of 32, int8 activations" in started_later.stdout
    by_record = run_in_process("quantize", "--model", str(out), "--output", str(tmp_path / "by_record"))
    assert by_record.returncode == 0, by_record.stderr[-3000:]
    assert "int4 weights in groups of 32, int8 activations" in by_record.stdout


# axolotl's qwen3/8b-qat-fsdp2.yml keys: rank 1 builds on the meta device and receives its shards, checkpointed layers
FSDP_AS_THE_EXAMPLE = {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {
    "fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_reshard_after_forward": True,
    "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_activation_checkpointing": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}


@pytest.mark.slow
def test_two_fsdp2_ranks_equal_two_ddp_ranks(tmp_path, tiny_model_dir, data):
    """torchao's fake-quantized Linears under fully_shard (each rounds the layer's gathered weights in its forward):
    2 FSDP2 ranks end with the weights of 2 DDP ranks on the same global batch, step 1 plain and steps 2-3
    fake-quantized, and save a plain model.

    Why DDP ranks and not one process (test_sharded.py's reference): fake-quantized training does not end within
    1e-5 of one process on any 2 ranks, DDP's included (2e-3 measured for either engine; 3e-7 without `qat`). The
    ranks sum the step-1 gradients in another order, so the weights step 2 rounds differ in their last bits, and
    torchao's symmetric grid puts each group's largest negative weight exactly on a rounding tie (-max/scale =
    -127.5 for int8): a bit either way moves it a whole step (-128 or -127), and the next steps amplify that. DDP and
    FSDP2 sum the same two ranks' gradients, so they agree to the bit without clipping (`max_grad_norm: 0`: FSDP2
    takes the norm over shards, another summation order)."""
    keys = {"qat": {**QAT, "fake_quant_after_n_steps": 1}, "max_steps": 3, "optimizer": "adamw_torch",
            "learning_rate": 1e-2, "max_grad_norm": 0, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    from conftest import run_in_one_launch

    saved, configs = {}, {}
    for engine, engine_keys in (("ddp", {}), ("fsdp2", FSDP_AS_THE_EXAMPLE)):
        run_dir = tmp_path / engine
        run_dir.mkdir()
        configs[engine] = write_config(run_dir / "run.yml", **base_config(run_dir, tiny_model_dir, data, **keys,
                                                                          **engine_keys))
    results = dict(zip(configs, run_in_one_launch(*(["train", config] for config in configs.values()))))
    for engine, result in results.items():  # (both in one launch: conftest's run_in_one_launch)
        run_dir = tmp_path / engine
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        assert "fake-quantized from step 2 on (after 1 plain steps)" in result.stdout
        plan = json.loads((run_dir / "out" / "plan.json").read_text())
        assert plan["world_size"] == 2 and plan["engine"].startswith(engine.upper()), plan["engine"]
        saved[engine] = load_file(run_dir / "out" / "model.safetensors")
    difference = relative_difference(saved["fsdp2"], saved["ddp"])
    print(f"relative difference, 2 FSDP2 ranks vs 2 DDP ranks under qat: {difference:.1e}")
    assert difference < 1e-5
    base = load_file(tiny_model_dir / "model.safetensors")  # plain: the base's names, fp32, trained
    assert set(saved["fsdp2"]) == set(base)
    assert all(tensor.dtype == torch.float32 for tensor in saved["fsdp2"].values())
    assert all(not torch.equal(saved["fsdp2"][key], base[key]) for key in base if key.endswith("proj.weight"))
    out = tmp_path / "fsdp2" / "out"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert {type(module).__module__.split(".")[0] for module in model.modules()} <= {"torch", "transformers"}


def test_nvfp4_is_refused_at_check(tmp_path, tiny_model_dir, data):
    keys = config_keys(tmp_path, tiny_model_dir, data)
    keys["qat"] = {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16}
    result = run_in_process("check", str(write_config(tmp_path / "nvfp4.yml", **keys)))
    assert_user_error(result, "`qat` weight_dtype: nvfp4, activation_dtype: nvfp4 asks for quantization beyond bitsandbytes",
                      "NVFP4/MXFP4 QAT needs a GPU")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("keys, fragment", [
    ({"adapter": "lora", "lora_target_linear": True}, "`qat` with `adapter: lora`"),
    ({"deepspeed": "zero2"}, "`qat` with deepspeed"),
    ({"qat": {**QAT, "fake_quant_after_n_steps": 0}}, "qat.fake_quant_after_n_steps"),
    ({"qat": {**QAT, "activation_dtype": "int4"}}, "int4 activations"),
])
def test_what_cannot_run_is_refused_at_check(tmp_path, tiny_model_dir, data, keys, fragment):
    config = write_config(tmp_path / "run.yml", **{**config_keys(tmp_path, tiny_model_dir, data), **keys})
    assert_user_error(run_in_process("check", str(config)), fragment)


def test_a_group_size_the_layers_do_not_take_is_refused_by_the_plan(tmp_path, tiny_model_dir, data):
    config = write_config(tmp_path / "run.yml", **config_keys(tmp_path, tiny_model_dir, data,
                                                              qat={**QAT, "group_size": 48}))
    assert_user_error(run_in_process("plan", str(config)), "`qat.group_size: 48` does not divide")
