"""gpt-oss's MXFP4 checkpoints (quant/mxfp4.py): axolotl's `model_quantization_config: Mxfp4Config` with
`model_quantization_config_kwargs: {dequantize: true}` loads the packed experts as trainable weights.

A tiny gpt_oss model is saved in the layout real gpt-oss checkpoints use: each expert weight as `*_blocks` (FP4
E2M1 codes, two a byte, low nibble first, 32 values to a block) and `*_scales` (one E8M0 exponent per block, bias
127), of the weight's transpose (transformers' Mxfp4Dequantize unpacks (experts, out, in) and transposes back), with
`quantization_config: {quant_method: mxfp4}` in config.json. transformers' own packer (integrations/mxfp4.py,
quantize_to_mxfp4) needs the Triton kernels from the Hub, so the test packs them itself (pack_mxfp4), as the OCP
MX spec says: the block's scale is 2^(floor(log2(max |x|)) - 2), each value rounded to the nearest E2M1 value."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import assert_user_error, read_metrics, run_in_process, write_jsonl

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared", Path("/work/shared")) if (p / "axolotl-examples").is_dir()), None)
GPT_OSS = SHARED / "axolotl-examples" / "gpt-oss" if SHARED else None
needs_examples = pytest.mark.skipif(GPT_OSS is None, reason="../shared/axolotl-examples is not on this machine")
LORA_CONFIG = "gpt-oss-safeguard-20b-sft-lora-singlegpu.yaml"
FULL_CONFIG = "gpt-oss-20b-fft-fsdp2.yaml"

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; codes 8-15 are their negatives
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
MXFP4_CHECKPOINT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # gpt-oss-20b's


def pack_mxfp4(weight):
    """(experts, in, out) weights → (blocks (experts, out, in/32, 16) uint8, scales (experts, out, in/32) uint8)."""
    import torch

    rows = weight.transpose(1, 2).float()
    blocks = rows.reshape(*rows.shape[:-1], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    # the largest E2M1 value is 6 = 1.5 × 2²: a block's largest value scaled by 2^-(floor(log2) - 2) is in [4, 8)
    exponent = torch.where(largest > 0, torch.floor(torch.log2(largest.clamp_min(2.0 ** -100))) - 2, 0.0)
    scaled = blocks / torch.exp2(exponent)
    magnitude = (scaled.abs().unsqueeze(-1) - torch.tensor(E2M1)).abs().argmin(-1)  # nearest; 6 where above it
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent.squeeze(-1) + 127).to(torch.uint8)


def unpack_mxfp4(blocks, scales):
    """The values blocks and scales stand for, in float64, as the (experts, in, out) weight."""
    import torch

    table = torch.tensor(E2M1 + tuple(-value for value in E2M1), dtype=torch.float64)
    values = torch.stack([table[(blocks & 15).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = values * torch.exp2(scales.double() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2)


def save_mxfp4_gpt_oss(target: Path, tokenizer_dir: Path) -> dict:
    """A tiny gpt_oss model saved as gpt-oss ships: experts in MXFP4, the rest in bf16. Returns the expert weights'
    MXFP4 values by name (float64), the bf16 weights they were packed from, and their scales."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model("gpt_oss", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # output columns of powers of two apart, so that the blocks' scales differ
        for name, parameter in model.named_parameters():
            if name.endswith(EXPERT_WEIGHTS):
                parameter.mul_(torch.exp2(torch.arange(parameter.shape[-1]) % 7 - 3.0).to(parameter.dtype))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    dense = load_file(target / "model.safetensors")
    stored, expected, original, scales_of = {}, {}, {}, {}
    for name, tensor in dense.items():
        if name.endswith(tuple(f"experts.{weight}" for weight in EXPERT_WEIGHTS)):
            blocks, scales = pack_mxfp4(tensor)
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
            expected[name], original[name], scales_of[name] = unpack_mxfp4(blocks, scales), tensor, scales
        else:
            stored[name] = tensor
    save_file(stored, target / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**written, "quantization_config": MXFP4_CHECKPOINT}, indent=2))
    return {"expected": expected, "original": original, "scales": scales_of}


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory, tiny_tokenizer_dir):
    target = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return target, save_mxfp4_gpt_oss(target, tiny_tokenizer_dir)


CHAT_ROWS = [{"messages": [{"role": "user", "content": f"Tell me about {topic}."},
                           {"role": "assistant", "content": f"{topic} is a fine thing to know about.",
                            "thinking": f"They ask about {topic}."}]}
             for topic in ("foxes", "dogs", "colours", "numbers", "names", "French", "red", "blue")] * 4


def gpt_oss_config(tmp_path: Path, model_dir: Path, example: str, **changes) -> Path:
    """An axolotl gpt-oss example as written, on the tiny MXFP4 model and local chat rows with a `thinking` field,
    for two steps. The tiny tokenizer's turn ends with <|im_end|> (gpt-oss's <|end|> is not in it), and the 8-bit
    AdamW needs a CUDA GPU (test_axolotl_configs.py covers that refusal)."""
    raw = yaml.safe_load((GPT_OSS / example).read_text())
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    raw["datasets"] = [{**raw["datasets"][0], "path": str(data), "split": "train"}]
    raw.update(base_model=str(model_dir), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"), max_steps=2, sequence_len=256,
               eot_tokens=["<|im_end|>"], optimizer="adamw_torch", **changes)
    path = tmp_path / "gpt-oss.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def planned(path: Path) -> dict:
    result = run_in_process("plan", str(path), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def loaded_by_tuneloop(path: Path, monkeypatch):
    """The model as `train` loads it (model/load.py's load_model), and the options it gave from_pretrained. (On this CPU
    transformers would dequantize MXFP4 even unasked, having no Triton kernels: the options show tuneloop asks.)"""
    from transformers import AutoModelForCausalLM

    from tuneloop.config import load_config
    from tuneloop.model.load import load_model
    from tuneloop.model.tokenizer import load_tokenizer
    from tuneloop.resolved import resolve_run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the speed-only keys' warnings)
        cfg = load_config(path)
    resolved = resolve_run(cfg)
    given, from_pretrained = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *args, **options: given.append(options) or from_pretrained(*args,
                                                                                                          **options)))
    return load_model(cfg, resolved, load_tokenizer(cfg, encoder_decoder=False)), given[0]


def test_the_packer_writes_mxfp4_close_to_the_weights(mxfp4_model):
    """The blocks and scales are a faithful MXFP4 of the weights (so the load below unpacks something real)."""
    import torch

    _, packed = mxfp4_model
    for name, values in packed["expected"].items():
        original = packed["original"][name].double()
        assert values.shape == original.shape
        assert torch.linalg.norm(values - original) / torch.linalg.norm(original) < 0.15, name
        assert len(packed["scales"][name].unique()) >= 7  # the blocks' scales differ (2^-3 to 2^3 apart)


@needs_examples
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_the_lora_example_plans_loads_the_experts_dequantized_and_trains(tmp_path, mxfp4_model, weights,
                                                                        monkeypatch):
    import torch
    from transformers import Mxfp4Config

    model_dir, packed = mxfp4_model
    changes = {"bfloat16": True} if weights == "bf16" else {}
    path = gpt_oss_config(tmp_path, model_dir, LORA_CONFIG, **changes)
    plan = planned(path)
    assert plan["model"].endswith(f"(its MXFP4 experts dequantized to {weights} as they load)")
    assert plan["attention"] == "eager"  # gpt-oss has no SDPA attention (its sinks): not flash-attention here
    assert plan["batching"] == "group_by_length"  # (its masks ignore packing: the last test)
    assert any("GptOss builds its attention masks without" in warning for warning in plan["warnings"])
    model, options = loaded_by_tuneloop(path, monkeypatch)
    assert isinstance(options["quantization_config"], Mxfp4Config) and options["quantization_config"].dequantize
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weights]
    for name, values in packed["expected"].items():
        loaded = model.get_parameter(f"base_model.model.{name}")
        assert loaded.dtype == dtype and not loaded.requires_grad  # (frozen under LoRA)
        assert torch.equal(loaded.double(), values), name  # MXFP4 values are exact in fp32 and bf16
    assert getattr(model.config, "quantization_config", None) is None  # the dense model, not an MXFP4 one
    held = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    assert plan["memory"]["per_rank_bytes"]["weights"] == held  # base at the dequantized dtype, LoRA in fp32
    trained = run_in_process("train", str(path))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == [1, 2]


@needs_examples
def test_the_full_fine_tune_example_trains_the_dequantized_experts_and_saves_a_dense_model(tmp_path, mxfp4_model):
    import torch
    from safetensors.torch import load_file

    model_dir, packed = mxfp4_model
    path = gpt_oss_config(tmp_path, model_dir, FULL_CONFIG)
    plan = planned(path)
    assert plan["engine"].startswith("FSDP2") and "dequantized to fp32" in plan["model"]
    assert plan["memory"]["trainable_parameters"] == plan["memory"]["parameters"]  # the experts train too
    trained = run_in_process("train", str(path))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == [1, 2]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    for name, values in packed["expected"].items():  # trained: moved off the MXFP4 values, by a little
        assert saved[name].dtype == torch.float32 and not torch.equal(saved[name].double(), values)
        assert torch.allclose(saved[name].double(), values, atol=1e-3)
    assert not [key for key in saved if key.endswith(("_blocks", "_scales"))]  # no packed MXFP4 left


@needs_examples
def test_the_four_gpt_oss_examples_are_accepted_by_check(tmp_path, mxfp4_model):
    model_dir, _ = mxfp4_model
    for example in sorted(path.name for path in GPT_OSS.glob("*.yaml")):
        raw = dict(yaml.safe_load((GPT_OSS / example).read_text()), base_model=str(model_dir))
        path = tmp_path / example
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        result = run_in_process("check", str(path))
        assert result.returncode == 0 and result.stdout.startswith("tuneloop check: accepted"), (example, result)


# ---- refusals ---------------------------------------------------------------------------------------------

def check_of(tmp_path: Path, model_dir: Path, **keys):
    raw = {"base_model": str(model_dir), "datasets": [{"path": "rows.jsonl", "type": "alpaca"}],
           "model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True},
           **keys}
    path = tmp_path / "refused.yml"
    path.write_text(yaml.safe_dump({key: value for key, value in raw.items() if value is not None}))
    return run_in_process("check", str(path))


REFUSED = {
    "another class": ({"model_quantization_config": "TorchAoConfig"},
                      ("`model_quantization_config` got 'TorchAoConfig'", "quantization beyond bitsandbytes")),
    "no dequantize": ({"model_quantization_config_kwargs": None},
                      ("without `model_quantization_config_kwargs: {dequantize: true}`", "cannot be trained",
                       "Triton")),
    "dequantize false": ({"model_quantization_config_kwargs": {"dequantize": False}},
                         ("keeps the experts packed in MXFP4",)),
    "another setting": ({"model_quantization_config_kwargs": {"dequantize": True, "modules_to_not_convert": ["x"]}},
                        ("`model_quantization_config_kwargs.modules_to_not_convert` is not a setting",)),
    "settings alone": ({"model_quantization_config": None},
                       ("`model_quantization_config_kwargs` are the settings of `model_quantization_config`",)),
    "qlora": ({"adapter": "qlora", "lora_target_linear": True}, ("with `adapter: qlora`", "not both")),
    "8-bit": ({"adapter": "lora", "lora_target_linear": True, "load_in_8bit": True},
              ("with `load_in_8bit`", "not both")),
    "from scratch": ({"base_model": None, "base_model_config": "gpt_oss",
                      "train_tokenizer": {"vocab_size": 300}}, ("starts from random weights",)),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_work_is_refused_in_one_line(tmp_path, tiny_model_dir, case):
    keys, fragments = REFUSED[case]
    assert_user_error(check_of(tmp_path, tiny_model_dir, **keys), *fragments)


def test_an_mxfp4_checkpoint_without_the_keys_is_refused_by_the_plan(tmp_path, mxfp4_model):
    """Packed experts would not train (and on a GPU with the Triton kernels transformers keeps them packed)."""
    model_dir, _ = mxfp4_model
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    path = tmp_path / "plain.yml"
    path.write_text(yaml.safe_dump({"base_model": str(model_dir), "datasets": [
        {"path": str(data), "type": "chat_template", "split": "train"}], "sequence_len": 256, "bf16": False,
        "output_dir": str(tmp_path / "out"), "dataset_prepared_path": str(tmp_path / "prepared")}))
    assert_user_error(run_in_process("plan", str(path)), "stores its MoE experts in MXFP4",
                      "`model_quantization_config: Mxfp4Config`", "as fp32 weights")


def test_the_keys_on_a_checkpoint_without_mxfp4_are_refused_by_the_plan(tmp_path, tiny_model_dir):
    """On a dense checkpoint they would do nothing (and transformers would mark the model quantized)."""
    from conftest import tiny_rows

    data = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(20))
    path = tmp_path / "dense.yml"
    path.write_text(yaml.safe_dump({
        "base_model": str(tiny_model_dir), "datasets": [{"path": str(data), "type": "alpaca"}], "bf16": False,
        "model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True},
        "output_dir": str(tmp_path / "out"), "dataset_prepared_path": str(tmp_path / "prepared")}))
    assert_user_error(run_in_process("plan", str(path)), "holds none", "quant_method: mxfp4")


def test_gpt_oss_masks_ignore_packed_positions_under_eager_attention(mxfp4_model):
    """Why resolved.py sets packing aside for gpt_oss under eager (PACKING_BLIND_MASKS): transformers 5.24's
    GptOssModel builds its masks without position_ids, so a packed row's second sequence sees the first. When a
    transformers release passes them, this fails and the entry can go."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model_dir, _ = mxfp4_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    first, second = torch.arange(5, 25)[None], torch.arange(30, 55)[None]
    with torch.no_grad():
        alone = model(second, use_cache=False).logits
        packed = model(torch.cat([first, second], 1), use_cache=False,
                       position_ids=torch.cat([torch.arange(20), torch.arange(25)])[None]).logits
    assert (packed[:, 20:] - alone).abs().max() > 1e-2
