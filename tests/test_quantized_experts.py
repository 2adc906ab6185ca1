"""`quantize_moe_experts` on a tiny Mixtral (transformers 5's 3-D expert weights, which bitsandbytes' loading leaves
in full precision): the experts are held in 4-bit (the plan's bytes are the ones the run held), LoRA on them
(`lora_target_parameters`) trains, `eval` gives back the run's last eval, and merge-lora folds the adapter into the
dequantized experts it trained on. fp32 compute (`bnb_4bit_compute_dtype: float32`, `bf16: false`)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config,
                      write_jsonl)
from safetensors.torch import load_file

pytest.importorskip("bitsandbytes")

MOE_QLORA = {"adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True, "lora_r": 4, "lora_alpha": 8,
             "lora_target_modules": ["q_proj", "v_proj"],
             "lora_target_parameters": ["experts.gate_up_proj"],
             "bnb_config_kwargs": {"bnb_4bit_compute_dtype": "float32"}, "optimizer": "sgd", "learning_rate": 0.5,
             "lr_scheduler": "constant", "max_grad_norm": 0, "max_steps": 2, "micro_batch_size": 4,
             "val_set_size": 0.2, "eval_strategy": "steps", "eval_steps": 1}


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    target = tmp_path_factory.mktemp("tiny_mixtral")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, tiny_moe_dir) -> dict:
    root = tmp_path_factory.mktemp("moe")
    data = write_jsonl(root / "train.jsonl", tiny_rows(40, seed=4))
    config = write_config(root / "run.yml", **base_config(root, tiny_moe_dir, data, **MOE_QLORA))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "config": config, "out": root / "out", "data": data}


def test_the_experts_are_held_in_4_bit_and_their_adapter_trains(moe_run, tiny_moe_dir):
    """The plan's weight bytes are the ones the run's tensors held (the packed experts and their scales among them),
    well under those of the same run with full-precision experts; the experts' LoRA moved."""
    held = json.loads((moe_run["out"] / "summary.json").read_text())["held_bytes_per_rank"][0]
    planned = json.loads((moe_run["out"] / "plan.json").read_text())["memory"]
    assert held["weights"] == pytest.approx(planned["per_rank_bytes"]["weights"], rel=1e-3)

    unquantized = write_config(moe_run["root"] / "fp_experts.yml", **base_config(
        moe_run["root"], tiny_moe_dir, moe_run["data"], **{**MOE_QLORA, "quantize_moe_experts": False}))
    plan = run_in_process("plan", str(unquantized), "--json")
    assert plan.returncode == 0, plan.stderr[-2000:]
    full_precision_experts = json.loads(plan.stdout)["memory"]["per_rank_bytes"]["weights"]
    assert planned["per_rank_bytes"]["weights"] < full_precision_experts / 2

    adapter = load_file(moe_run["out"] / "adapter_model.safetensors")
    expert_b = [key for key in adapter if "experts" in key and "lora_B" in key]
    assert len(expert_b) == 2 and all(float(adapter[key].abs().max()) > 0 for key in expert_b)  # one a layer


def test_eval_of_the_run_gives_back_its_last_eval(moe_run):
    result = run_in_process("eval", str(moe_run["config"]))
    assert result.returncode == 0, result.stderr[-3000:]
    last = [line for line in read_metrics(moe_run["out"]) if "eval_loss" in line][-1]
    assert last["step"] == 2
    assert json.loads(result.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(last["eval_loss"],
                                                                                           rel=1e-6)


def test_merge_lora_folds_the_adapter_into_the_dequantized_experts(moe_run, tiny_moe_dir, tmp_path):
    """The merged model computes what the 4-bit base (experts quantized the same way) with its adapter does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tuneloop.adapters import keep_4bit_layout
    from tuneloop.quant.quantized_experts import quantize_experts

    merged_dir = tmp_path / "merged"
    result = run_in_process("merge-lora", str(moe_run["config"]), "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("parametrizations" in name for name in merged.state_dict())  # plain weights

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, quantization_config=bnb, dtype=torch.float32)
    assert quantize_experts(base, bnb) == 4
    keep_4bit_layout(base)
    adapter = PeftModel.from_pretrained(base, str(moe_run["out"])).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        expected = adapter(ids).logits
        assert (merged(ids).logits - expected).abs().max().item() < 1e-5
        assert (plain(ids).logits - expected).abs().max().item() > 1e-3  # (the comparison can fail)


def test_quantize_moe_experts_is_refused_where_it_cannot_mean_anything(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(8, seed=1))

    def config(**keys):
        return str(write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **keys)))

    no_experts = config(**MOE_QLORA)  # the tiny llama: no expert weights
    for command in ("plan", "train"):
        assert_user_error(run_in_process(command, no_experts), "`quantize_moe_experts: true`",
                          "has no expert weights to quantize")
    assert_user_error(run_in_process("check", config(adapter="lora", lora_target_linear=True,
                                                     quantize_moe_experts=True)),
                      "`quantize_moe_experts` quantizes a MoE model's expert weights to 4-bit", "`adapter: qlora`")
    assert_user_error(run_in_process("check", config(adapter="lora", lora_target_linear=True, load_in_8bit=True,
                                                     quantize_moe_experts=True)),
                      "asks for MoE-specific options (8-bit experts)")


def test_lora_on_two_weights_of_one_quantized_experts_module_is_refused_by_the_plan(tmp_path, tiny_moe_dir):
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(8, seed=1))
    keys = {**MOE_QLORA, "lora_target_parameters": ["experts.gate_up_proj", "mlp.experts.down_proj"]}
    config = str(write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_moe_dir, data, **keys)))
    for command in ("plan", "train"):
        assert_user_error(run_in_process(command, config), "picks gate_up_proj and down_proj of one experts module",
                          "keep one of them")


def test_lora_on_4_bit_experts_computes_what_it_does_on_their_dequantized_values():
    """Two forward/backward passes of LoRA on 4-bit experts against the same LoRA on a plain model holding the
    dequantized values: the same loss and adapter gradients, exactly. (peft alone would leave its delta's
    parametrization in place after the first pass and stack a second one: quant/quantized_experts.py.)"""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, MixtralConfig, MixtralForCausalLM

    from tuneloop.quant.quantized_experts import quantize_experts, remove_lora_proxies_after_each_forward

    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)

    def built():
        torch.manual_seed(0)  # the same weights twice
        return MixtralForCausalLM(config)

    quantized, plain = built(), built()
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    assert quantize_experts(quantized, bnb) == 2
    with torch.no_grad():
        for source, target in zip(quantized.model.layers, plain.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                getattr(target.mlp.experts, name).copy_(getattr(source.mlp.experts, name))
    adapted = []
    for model, target in ((quantized, "model.layers.0.mlp.experts.gate_up_proj"), (plain, "experts.gate_up_proj")):
        model.requires_grad_(False)
        torch.manual_seed(1)
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=[target]))
        with torch.no_grad():  # a non-zero B, so that the delta counts in the forward
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_()
        adapted.append(peft_model)
    assert remove_lora_proxies_after_each_forward(adapted[0]) == 1
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        losses, grads = [], []
        for model in adapted:
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            grads.append([parameter.grad for name, parameter in model.named_parameters() if "experts" in name
                          and parameter.requires_grad])
        assert losses[0] == losses[1]
        assert len(grads[0]) == 2 and all(torch.equal(a, b) for a, b in zip(*grads))
        assert float(grads[0][1].abs().sum()) > 0
