"""QLoRA and 8-bit loading on this CPU, through bitsandbytes' CPU backend: a QLoRA step of `tuneloop train` equals
a hand-written peft + bitsandbytes step on the same quantized weights, adapter and batch; `tuneloop eval` of the run
gives back its last eval (the adapter on the base quantized as the run quantized it); 8-bit weights and the 8-bit
and paged optimizers train. fp32 compute (`bnb_4bit_compute_dtype: float32`, `bf16: false`): the comparison is of
the same sums, so it holds to rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file

pytest.importorskip("bitsandbytes")

QLORA = {"adapter": "qlora", "load_in_4bit": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
         "lora_target_linear": True, "bnb_config_kwargs": {"bnb_4bit_compute_dtype": "float32"}}
TWO_SGD_STEPS = {"optimizer": "sgd", "learning_rate": 0.5, "lr_scheduler": "constant", "max_grad_norm": 0,
                 "max_steps": 2, "micro_batch_size": 4, "save_strategy": "steps", "save_steps": 1}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_model_dir) -> dict:
    root = tmp_path_factory.mktemp("qlora")
    data = write_jsonl(root / "train.jsonl", tiny_rows(40, seed=5))
    # an eval after step 1 too: the step after it must be a training step still (see adapters.keep_4bit_layout)
    keys = base_config(root, tiny_model_dir, data, val_set_size=0.2, eval_strategy="steps", eval_steps=1,
                       **QLORA, **TWO_SGD_STEPS)
    config = write_config(root / "run.yml", **keys)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"config": config, "keys": keys, "out": root / "out"}


def test_a_qlora_step_equals_a_hand_written_peft_and_bitsandbytes_step(qlora_run, tiny_model_dir):
    """Step 2 of the run (after the run's eval at step 1), from its step-1 checkpoint: the same NF4 weights (double
    quantization, as QLoRA), the same adapter, the same micro-batch; loss and adapter within 1e-5 relative."""
    from peft import PeftModel, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from tuneloop.config import config_from_dict
    from tuneloop.data.batching import epoch_micro_batches
    from tuneloop.data.collate import Collator
    from tuneloop.data.prepare import prepare
    from tuneloop.plan.build import train_spec
    from tuneloop.resolved import resolve_config
    from tuneloop.train.objectives import summed_token_loss

    out = qlora_run["out"]
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quantization, dtype=torch.float32)
    assert type(base.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = PeftModel.from_pretrained(prepare_model_for_kbit_training(base, use_gradient_checkpointing=False),
                                      str(out / "checkpoint-1"), is_trainable=True)
    model.config.use_cache = False
    model.train()  # as the loop trains it: bitsandbytes' CPU inference kernel takes over an eval-mode layer

    cfg = config_from_dict(qlora_run["keys"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prepared = prepare(cfg, tokenizer)
    second = epoch_micro_batches(np.asarray(prepared.train["length"]), train_spec(cfg, resolve_config(cfg), 1), 0)[0][1]
    batch = Collator(prepared.train, tokenizer.pad_token_id, packed=False)(second)
    loss = summed_token_loss(model(**batch.inputs).logits, batch.targets) / batch.n_targets
    loss.backward()
    with torch.no_grad():
        stepped = {name: parameter - 0.5 * parameter.grad for name, parameter in model.named_parameters()
                   if parameter.requires_grad}

    logged = [line["loss"] for line in read_metrics(out) if "loss" in line and line.get("step") == 2]
    assert logged and logged[0] == pytest.approx(loss.item(), rel=1e-5)
    saved = load_file(out / "adapter_model.safetensors")
    before = load_file(out / "checkpoint-1" / "adapter_model.safetensors")
    assert set(saved) == {name.replace(".default", "") for name in stepped}
    moved = sum(float((saved[key] - before[key]).pow(2).sum()) for key in saved) ** 0.5
    assert moved > 1e-3  # a real update to compare
    for name, expected in stepped.items():
        key = name.replace(".default", "")
        assert float((saved[key] - expected).norm() / expected.norm()) < 1e-5, key  # relative L2, per tensor


def test_a_4_bit_layer_computes_in_the_runs_dtype_an_fp32_runs_in_fp32(tmp_path, tiny_model_dir):
    """Without `bnb_4bit_compute_dtype`, a 4-bit layer multiplies in the run's dtype (adapters.four_bit_compute_dtype):
    under `bf16: false` each of the loaded model's 4-bit layers, in training, gives the fp32 product of its
    dequantized NF4 weight to 1e-6 — the forward every engine computes (one process's, DDP's, FSDP2's gathered
    weight), so that 2 ranks end where one process does (test_sharded_qlora.py). Before, it computed in bf16 unasked:
    layers up to 3.0e-3 off, and 2 ranks' adapter 2.2e-4 off one process's after 4 AdamW steps, under DDP and FSDP2
    alike. bf16 runs (and `bfloat16` weights) compute in bf16; a given `bnb_4bit_compute_dtype` wins."""
    import torch.nn.functional as F
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    from tuneloop.adapters import four_bit_compute_dtype, keep_4bit_layout, quantization_config
    from tuneloop.config import config_from_dict
    from tuneloop.host.hardware import native_bf16

    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(4))
    plain = {key: value for key, value in QLORA.items() if key != "bnb_config_kwargs"}

    def cfg_of(**keys):
        return config_from_dict(base_config(tmp_path, tiny_model_dir, data, **{**plain, **keys}))

    assert four_bit_compute_dtype(cfg_of()) == "float32"
    assert four_bit_compute_dtype(cfg_of(bf16=True)) == four_bit_compute_dtype(cfg_of(bfloat16=True)) == "bfloat16"
    assert four_bit_compute_dtype(cfg_of(bf16="auto")) == ("bfloat16" if native_bf16() else "float32")
    assert four_bit_compute_dtype(cfg_of(bnb_config_kwargs={"bnb_4bit_compute_dtype": "float16"})) == "float16"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quantization_config(cfg_of(),
                                                                                                          "4bit"),
                                                 dtype=torch.float32)
    keep_4bit_layout(model)
    model.train()
    layers = [module for module in model.modules() if type(module).__name__ == "Linear4bit"]
    assert len(layers) == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        x = torch.randn(2, 9, layer.in_features, generator=generator).requires_grad_()
        got = layer(x)
        expected = F.linear(x, dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(torch.float32))
        assert got.dtype == torch.float32
        assert float((got - expected).detach().norm() / expected.detach().norm()) < 1e-6, type(layer)


def test_the_plan_counts_the_4_bit_weights_as_the_process_holds_them(qlora_run):
    """NF4 data, its absmax (quantized twice) and code books, the unquantized embedding, norms and head, the adapter:
    the plan's weight bytes are the bytes the run's tensors held (0.1%); the optimizer's, the adapter's AdamW."""
    import json

    held = json.loads((qlora_run["out"] / "summary.json").read_text())["held_bytes_per_rank"][0]
    memory = json.loads((qlora_run["out"] / "plan.json").read_text())["memory"]
    assert held["weights"] == pytest.approx(memory["per_rank_bytes"]["weights"], rel=1e-3)
    assert memory["weights_gb"] < memory["parameters"] * 4 / 1e9 / 1.5  # well under the fp32 base


def test_eval_of_a_qlora_run_gives_back_its_last_eval(qlora_run):
    import json

    result = run_in_process("eval", str(qlora_run["config"]))
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    last = [line for line in read_metrics(qlora_run["out"]) if "eval_loss" in line][-1]
    assert last["step"] == 2 and measured["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("optimizer", ["paged_adamw_8bit", "adamw_bnb_8bit"])
def test_8_bit_weights_and_bitsandbytes_optimizers_train_on_this_cpu(optimizer, tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(16, seed=2))
    keys = base_config(tmp_path, tiny_model_dir, data, adapter="lora", load_in_8bit=True, lora_r=4, lora_alpha=8,
                       lora_target_linear=True, optimizer=optimizer, max_steps=2, learning_rate=1e-2)
    config = write_config(tmp_path / "run.yml", **keys)
    checked = run_in_process("check", str(config))
    assert checked.returncode == 0 and "bitsandbytes (on a GPU, or its CPU backend)" in checked.stdout
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [line["loss"] for line in read_metrics(tmp_path / "out") if "loss" in line]
    assert len(losses) == 2 and all(np.isfinite(losses))
    import json

    held = json.loads((tmp_path / "out" / "summary.json").read_text())["held_bytes_per_rank"][0]
    planned = json.loads((tmp_path / "out" / "plan.json").read_text())["memory"]["per_rank_bytes"]
    assert held["weights"] == pytest.approx(planned["weights"], rel=1e-3)  # int8 data and its row scales
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert any(float(tensor.abs().sum()) > 0 for key, tensor in adapter.items() if "lora_B" in key)


def test_merge_lora_of_a_qlora_run_folds_the_adapter_into_the_base_it_was_trained_on(qlora_run, tiny_model_dir,
                                                                                    tmp_path):
    """merge-lora CONFIG on a QLoRA run: the adapter goes into the NF4 base dequantized (what it was trained
    against), so the merged model computes what the quantized base with its adapter does (measured 2.1e-7, allowed
    1e-5; folding it into the full-precision weights instead: 0.085); `export` merges the same way."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tuneloop.adapters import keep_4bit_layout

    merged_dir = tmp_path / "merged"
    result = run_in_process("merge-lora", str(qlora_run["config"]), "--output", str(merged_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dequantized, as it was trained" in result.stdout
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.float32 and not getattr(merged, "is_quantized", False)

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quantization, dtype=torch.float32)
    keep_4bit_layout(base)  # (bitsandbytes' bf16 inference kernel would be another computation)
    adapter = PeftModel.from_pretrained(base, str(qlora_run["out"])).eval()
    full_precision = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                               str(qlora_run["out"])).merge_and_unload().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        expected = adapter(ids).logits
        on_dequantized = (merged(ids).logits - expected).abs().max().item()
        on_full_precision = (full_precision(ids).logits - expected).abs().max().item()
    assert on_dequantized < 1e-5 and on_full_precision > 100 * max(on_dequantized, 1e-7)

    # --dtype names the merged weights' dtype (the dequantized base is cast to it before the adapter is folded in)
    as_bf16 = run_in_process("merge-lora", str(qlora_run["config"]), "--output", str(tmp_path / "bf16"),
                             "--dtype", "bfloat16")
    assert as_bf16.returncode == 0, as_bf16.stderr[-3000:]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16

    # a checkpoint folder is the run's too (its run_config.yml is in the output_dir above it)
    from_checkpoint = run_in_process("merge-lora", "--adapter", str(qlora_run["out"] / "checkpoint-1"), "--output",
                                     str(tmp_path / "from-checkpoint"))
    assert from_checkpoint.returncode == 0 and "dequantized, as it was trained" in from_checkpoint.stdout

    # infer puts the adapter on the quantized base as well: its greedy text is the merged model's
    from conftest import write_jsonl as prompts_file

    prompts = prompts_file(tmp_path / "prompts.jsonl", [{"prompt": "Name three colours."}])
    completions = []
    for source in (["--model", str(merged_dir)], [str(qlora_run["config"])]):
        answer = run_in_process("infer", *source, "--prompts", str(prompts), "--max-new-tokens", "8")
        assert answer.returncode == 0, answer.stderr[-2000:]
        completions.append([json.loads(line)["completion"] for line in answer.stdout.splitlines()])
    assert completions[0] == completions[1] and completions[0][0]

    # `export` of the run merges the same way: its f32 GGUF, read back by transformers, computes the same
    gguf_file = tmp_path / "qlora.gguf"
    exported = run_in_process("export", str(qlora_run["config"]), "--quant", "f32", "--output", str(gguf_file))
    assert exported.returncode == 0, exported.stderr[-3000:]
    read_back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (read_back(ids).logits - expected).abs().max().item() < 1e-5


@pytest.mark.slow
def test_a_qlora_run_killed_at_a_random_step_resumes_to_the_same_adapter_bit_for_bit(tmp_path, tiny_model_dir):
    """Stopped between checkpoints (evals in between; by the signal-at-step hook: the true kill -9 of a run on one
    process is test_resume's), then auto-resume: the final adapter equals the uninterrupted run's exactly, and so do
    the losses of every step."""
    import random

    from conftest import killed_then_resumed

    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(48, seed=9))
    keys = {**QLORA, "micro_batch_size": 4, "learning_rate": 2e-3, "warmup_steps": 2, "save_strategy": None,
            "save_steps": 3, "save_total_limit": 2, "val_set_size": 0.15, "evals_per_epoch": 2,
            "auto_resume_from_checkpoints": True}
    runs = {}
    for name in ("straight", "killed"):
        (tmp_path / name).mkdir()
        runs[name] = write_config(tmp_path / name / "run.yml", **base_config(tmp_path / name, tiny_model_dir, data,
                                                                            **keys))
    straight = run_in_process("train", str(runs["straight"]))
    assert straight.returncode == 0, straight.stderr[-2000:]
    expected = read_metrics(tmp_path / "straight" / "out")
    total = max(line["step"] for line in expected if "loss" in line)

    seed = random.randrange(10**6)
    stop_after = random.Random(seed).randint(4, total - 2)
    killed_then_resumed(runs["killed"], tmp_path / "killed" / "out", stop_after)

    ours = load_file(tmp_path / "killed" / "out" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "straight" / "out" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours), f"seed {seed}"
    metrics = read_metrics(tmp_path / "killed" / "out")
    assert [line["loss"] for line in metrics if "loss" in line] == [line["loss"] for line in expected if "loss" in line]


def test_bitsandbytes_settings_are_checked_before_anything_loads(tmp_path, tiny_model_dir):
    """A misspelled key would be ignored by transformers, a bad value would crash the load: `check` says each."""
    from conftest import assert_user_error

    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(8, seed=1))
    for settings, said in (({"bnb_4bit_compute_dtyp": "float32"}, "`bnb_config_kwargs.bnb_4bit_compute_dtyp` is not"),
                           ({"bnb_4bit_compute_dtype": "floa32"}, "is not a dtype"),
                           ({"bnb_4bit_quant_type": "nf5"}, "use nf4 or fp4"),
                           ({"bnb_4bit_use_double_quant": "yes"}, "must be true or false"),
                           ({"load_in_8bit": True}, "say it as the top-level `load_in_8bit`")):
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **{
            **QLORA, "bnb_config_kwargs": settings}))
        for command in ("check", "plan"):
            assert_user_error(run_in_process(command, str(config)), said)


def test_the_plan_counts_the_unquantized_layers_in_fp32_under_bfloat16_weights(tmp_path, tiny_model_dir):
    """`bfloat16: true` with QLoRA: peft's preparation upcasts the embedding, head and norms to fp32, as held."""
    import json

    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(8, seed=1))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, **QLORA, bfloat16=True,
                                                            max_steps=1))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    held = json.loads((tmp_path / "out" / "summary.json").read_text())["held_bytes_per_rank"][0]
    planned = json.loads((tmp_path / "out" / "plan.json").read_text())["memory"]["per_rank_bytes"]
    assert held["weights"] == pytest.approx(planned["weights"], rel=1e-3)
