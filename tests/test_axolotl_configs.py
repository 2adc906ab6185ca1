"""Real axolotl configs (../shared/axolotl-examples: 118 training configs from axolotl's examples/ at commit
067b021) go through `tuneloop check` as users wrote them, with base_model swapped to a local tiny model.

Every one is accepted, or refused only for features tuneloop does not have (config/axolotl.py FEATURES, the
README's list); never for a key tuneloop implements, a key that only changes speed or logging, or a blank
value. Every key axolotl's schema knows is classified. A sample of accepted configs plans, and trains a few
steps where this machine can (else the clear hardware error); one config of each other kind is checked and planned
(`plan` refuses nothing `check` accepted); the seed's example config plans unchanged."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest
import yaml
from types import SimpleNamespace
from conftest import assert_user_error, read_metrics, run_in_process, tiny_rows, write_jsonl

from tuneloop.config import axolotl
from tuneloop.config.load import ALIASES, DATASET_KEYS, TOP_LEVEL_KEYS

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared", Path("/work/shared")) if (p / "axolotl-examples").is_dir()), None)
EXAMPLES = SHARED / "axolotl-examples" if SHARED else None
pytestmark = pytest.mark.skipif(EXAMPLES is None, reason="../shared/axolotl-examples is not on this machine")
FEATURE_NAMES = [short for short, _ in axolotl.FEATURES.values()]
ACCEPTED = 87  # of the 118 example configs (2026-12-07, structured EBFT; vision configs checked by hub id;
# refused since: mistral4/fft-text.yml, whose adamw_bnb_8bit under FSDP2 fails at the first step, and
# orpheus/finetune.yml, whose hub_model_id placeholder train refuses)
REFUSED_BY_FEATURE = {"multimodal models": 10, "expert parallelism": 3, "launching on a Ray cluster": 1,
                      "quantization beyond bitsandbytes": 5, "MoE-specific options": 6, "an axolotl plugin": 4,
                      "this preference/RL training": 1, "another training method": 2, "a model option": 2,
                      "a LoRA variant": 2, "keys axolotl has removed": 2, "8-bit weights under FSDP2": 1,
                      "a dataset option": 1, "a bitsandbytes optimizer under FSDP2": 1}
# configs that axolotl refuses too: its schema (`warmup_steps` must be a whole number of steps), or its train before
# the first step (a placeholder `hub_model_id`, which the Trainer's create_repo refuses as a repo id)
INVALID_IN_AXOLOTL = {("expert_parallel/qwen3_30ba3b_ep_fft_4gpu.yaml", "warmup_steps"),
                      ("expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml", "warmup_steps"),
                      ("orpheus/finetune.yml", "hub_model_id")}


README = REPO / "README.md"
README_BLOCK = ("<!-- axolotl-configs: written by tests/test_axolotl_configs.py -->\n", "<!-- /axolotl-configs -->\n")


def readme_block(accepted: int, total: int, refused_by_feature: Counter) -> str:
    """The README's count of accepted configs and its table of refusals by feature (FEATURES' long names)."""
    described = {short: long for short, long in axolotl.FEATURES.values()}
    described["keys axolotl has removed"] = "keys axolotl itself has removed (`eta_min`)"
    rows = [f"| {described[feature]} | {count} |"
            for feature, count in sorted(refused_by_feature.items(), key=lambda item: (-item[1], item[0]))]
    return "\n".join([f"**{accepted} of the {total} are accepted ({accepted / total:.0%}).**", "",
                      "| feature tuneloop does not do yet | configs |", "|---|---|", *rows]) + "\n"


def check_readme(block: str) -> None:
    """The README's block says `block`; with TUNELOOP_WRITE_README=1 it is written there instead."""
    text = README.read_text()
    start, end = text.index(README_BLOCK[0]) + len(README_BLOCK[0]), text.index(README_BLOCK[1])
    if os.environ.get("TUNELOOP_WRITE_README") == "1":
        README.write_text(text[:start] + block + text[end:])
    text = README.read_text()
    assert text[start:text.index(README_BLOCK[1])] == block


def example_configs() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".yml", ".yaml"))


def swapped(raw: dict, model_dir: Path) -> dict:
    """The config as the test runs it: the tiny local model in place of a hub model (and its class; its tokenizer is
    the tiny model's own, read by its own class: a LlamaTokenizer over it would add a token the model lacks)."""
    raw = dict(raw, base_model=str(model_dir))
    raw.pop("tokenizer_type", None)
    if str(raw.get("model_type") or "").endswith("ForCausalLM"):
        raw["model_type"] = "AutoModelForCausalLM"
    return raw


def asks_for_vision(raw: dict) -> bool:
    """A vision-language config (config/vision_names.py's test, on the raw YAML)."""
    from tuneloop.config.vision_names import asks_for_vision as config_asks

    return config_asks(SimpleNamespace(processor_type=raw.get("processor_type"),
                                       freeze_mm_modules=raw.get("freeze_mm_modules"),
                                       model_type=raw.get("model_type")))


def checked_as(raw: dict, model_dir: Path) -> dict:
    """What `check` reads of an example: text configs on the tiny local model; a vision-language config keeps its
    hub id, from which `check` names the family it asks for (the tiny text model in its place would be a LLaMA
    asked to see images). test_vision_language.py plans the accepted ones on tiny twins of their families."""
    return dict(raw) if asks_for_vision(raw) else swapped(raw, model_dir)


def check(tmp_path: Path, raw: dict):
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return run_in_process("check", str(path))


def test_every_axolotl_key_is_classified():
    keys = json.loads((EXAMPLES / "axolotl-keys.json").read_text())
    tables = (TOP_LEVEL_KEYS | set(ALIASES) | axolotl.LAUNCHER | axolotl.SPEED_OR_LOGGING
              | set(axolotl.REFUSED) | axolotl.REMOVED)
    top_level = set(keys["top_level"]) | set(keys["plugin"]) | set(keys["deprecated"]) | set(keys["remapped"])
    assert sorted(top_level - tables) == []
    assert sorted(set(keys["dataset"]) - DATASET_KEYS - set(axolotl.DATASET_REFUSED)) == []
    # each key in one place only
    groups = [TOP_LEVEL_KEYS | set(ALIASES), axolotl.LAUNCHER, axolotl.SPEED_OR_LOGGING,
              set(axolotl.REFUSED), axolotl.REMOVED]
    assert sum(len(group) for group in groups) == len(set().union(*groups))


def test_the_axolotl_example_configs_are_accepted_or_refused_only_for_missing_features(tmp_path, tiny_model_dir):
    accepted, refused_by_feature, lines_seen = [], Counter(), 0
    for config in example_configs():
        name = config.relative_to(EXAMPLES).as_posix()
        result = check(tmp_path, checked_as(yaml.safe_load(config.read_text()), tiny_model_dir))
        if result.returncode == 0:
            assert result.stdout.startswith("tuneloop check: accepted"), result.stdout
            accepted.append(name)
            continue
        assert_user_error(result)
        problems = result.stderr.removeprefix("error: config: ").rstrip("\n").split("\n  ")
        features, invalid_in_axolotl = set(), False
        for line in problems:
            lines_seen += 1
            named = [feature for feature in FEATURE_NAMES if feature in line]
            unknown = re.match(r"unknown key `([^`]+)`", line)
            value_error = re.match(r"`([\w.]+)` got ", line)
            if named:
                features.update(named)
            elif "is a key axolotl itself has removed" in line:
                features.add("keys axolotl has removed")
            elif unknown:  # keys axolotl's own schema does not know either (leftovers in its examples)
                assert unknown.group(1) not in json.dumps(json.loads((EXAMPLES / "axolotl-keys.json").read_text())), \
                    (name, line)
            elif value_error and (name, value_error.group(1)) in INVALID_IN_AXOLOTL:
                invalid_in_axolotl = True
            else:
                pytest.fail(f"{name}: refused for something that is not a missing feature: {line}")
        assert features or invalid_in_axolotl or all("unknown key" in line for line in problems), (name, problems)
        for feature in features:
            refused_by_feature[feature] += 1
    print(f"\naccepted {len(accepted)} of {len(example_configs())}; refused configs by feature: "
          f"{dict(refused_by_feature.most_common())}")
    assert len(example_configs()) == 118
    # measured: every refusal of a config is reported at once, so each config counts under every feature it needs
    # (the README's table says the same); a change that accepts more configs raises these figures
    assert len(accepted) == ACCEPTED
    assert dict(refused_by_feature) == REFUSED_BY_FEATURE
    check_readme(readme_block(len(accepted), len(example_configs()), refused_by_feature))


def test_the_seeds_example_config_plans_unchanged_but_for_its_paths(tmp_path, tiny_model_dir):
    """The config quoted in ../shared/reference/002_... (Llama-2 7B, alpaca, packed, padded to sequence_len)."""
    text = next(SHARED.glob("reference/002_*")).read_text()
    start = text.index("base_model: NousResearch/Llama-2-7b-hf")
    end = text.index("special_tokens:", start)
    raw = yaml.safe_load(text[start:end] + "special_tokens:\n")
    data = write_jsonl(tmp_path / "alpaca.jsonl", tiny_rows(120))
    raw.update(base_model=str(tiny_model_dir), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"))
    raw["datasets"][0]["path"] = str(data)
    path = tmp_path / "seed.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = run_in_process("plan", str(path), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["batching"] == "packed" and plan["optimizer"] == "adamw_bnb_8bit" and plan["warmup_steps"] == 100
    assert plan["sequence_len"] == 4096  # above the tiny model's 1024 rotary positions: a warning, as for LLaMA
    assert any("max_position_embeddings=1024" in warning for warning in plan["warnings"])
    assert "flash_attn_rms_norm" in result.stderr  # warned about, speed only


# ---- a sample of accepted configs, with local data of the matching kind ------------------------------------

CHAT_ROWS = [{"conversations": [{"from": "human", "value": f"Tell me about {topic}."},
                                {"from": "gpt", "value": f"{topic} is a fine thing to know about."}]}
             for topic in ("foxes", "dogs", "colours", "numbers", "names", "French", "red", "blue")] * 4


def local_version(raw: dict, model_dir: Path, tmp_path: Path) -> dict:
    """The config with local data of the kind each dataset entry reads, and small runs: two steps."""
    raw = swapped(raw, model_dir)
    datasets = []
    for index, entry in enumerate(raw["datasets"]):
        kind = entry.get("type")
        if kind in ("alpaca", "alpaca:chat"):
            rows = tiny_rows(40, seed=index)
        elif kind == "chat_template":
            field = entry.get("field_messages", "messages")
            rows = [{field: row["conversations"]} for row in CHAT_ROWS]
        elif kind == "chat_template.default" and raw.get("rl"):  # preference pairs, in the entry's own field names
            names = entry.get("message_property_mappings") or {}
            role, content = names.get("role", "role"), names.get("content", "content")
            rows = [{entry.get("field_messages", "messages"): [{role: "user", content: row["conversations"][0]["value"]}],
                     entry.get("field_chosen", "chosen"): row["conversations"][1]["value"],
                     entry.get("field_rejected", "rejected"): "I would rather not say."} for row in CHAT_ROWS]
        elif kind == "bradley_terry.chat_template":  # a reward model's pairs
            rows = [{"input": row["conversations"][0]["value"], "chosen": row["conversations"][1]["value"],
                     "rejected": "I would rather not say."} for row in CHAT_ROWS]
        elif kind is None:  # pre-tokenized rows
            rows = [{"input_ids": [(7 * i + j) % 300 + 5 for j in range(20 + i)]} for i in range(40)]
        else:
            raise AssertionError(f"no local data for type {kind}")
        datasets.append({**entry, "path": str(write_jsonl(tmp_path / f"data{index}.jsonl", rows)),
                         "split": "train"})
    raw.update(datasets=datasets, output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prep"),
               max_steps=2, sequence_len=min(raw.get("sequence_len", 512), 512))
    raw.pop("hub_model_id", None)  # (a placeholder such as `<your-hub-model-id>`, and no hub to push to here)
    return raw


SAMPLES = {
    "LoRA, packed alpaca": "archived/tiny-llama/lora-mps.yml",
    "LoRA, chat_template with field mappings, packed": "LiquidAI/lfm2-8b-a1b-lora.yaml",
    "QLoRA (4-bit), packed": "llama-3/qlora-1b.yml",
    "full fine-tune, 8-bit optimizer": "mistral/config.yml",
    "full fine-tune, pre-tokenized rows, flash-attention asked for": "orpheus/finetune.yml",
    "QLoRA, gemma template, message_property_mappings": "gemma2/qlora.yml",
    "QLoRA under FSDP (the 405B recipe: offloading, re-entrant checkpointing)": "llama-3/qlora-fsdp-405b.yaml",
}


# configs that name a family's chat template, on a tiny twin of that family (its own architecture: Qwen3.5's
# gated-delta-net layers, Gemma 4's, Jamba's Mamba layers)
FAMILY_SAMPLES = {
    "qwen3_5 template, QLoRA with quantized MoE experts": ("qwen3.5/35b-a3b-moe-qlora.yaml", "qwen3_5_moe"),
    "gemma4_unified template, LoRA on Gemma 4 with MoE blocks": ("gemma4-unified/12b-text-lora.yaml", "gemma4"),
    "jamba template, QLoRA under FSDP": ("jamba/qlora_fsdp_large.yaml", "jamba"),
    # accepted by `check`, which reads no model; the plan sees gate_up_proj and down_proj on one 4-bit experts module
    "gemma4 template, QLoRA on both expert weights of one module (refused)": ("gemma4/26b-a4b-moe-qlora.yaml",
                                                                              "gemma4"),
}


def tiny_twin(family: str, target: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if family == "qwen3_5_moe":
        config = AutoConfig.for_model("qwen3_5_moe_text", **common, num_hidden_layers=4, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    elif family == "gemma4":
        text = dict(common, intermediate_size=128, num_hidden_layers=2, enable_moe_block=True, num_experts=4,
                    top_k_experts=2, moe_intermediate_size=32, vocab_size_per_layer_input=len(tokenizer),
                    hidden_size_per_layer_input=16, sliding_window=64)
        config = AutoConfig.for_model("gemma4", text_config=text, vision_config=None, audio_config=None)
    else:
        config = AutoConfig.for_model("jamba", **common, intermediate_size=128, num_hidden_layers=4, num_experts=2,
                                      num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                                      expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.mark.parametrize("sample", FAMILY_SAMPLES)
def test_a_config_naming_a_familys_template_plans_and_trains_on_a_tiny_twin_of_the_family(tmp_path, tiny_tokenizer_dir,
                                                                                         sample):
    path, family = FAMILY_SAMPLES[sample]
    model_dir = tiny_twin(family, tmp_path / "twin", tiny_tokenizer_dir)
    raw = local_version(yaml.safe_load((EXAMPLES / path).read_text()), model_dir, tmp_path)
    raw["optimizer"] = "adamw_torch"  # (torchao's 8-bit AdamW needs a CUDA GPU: the sample test covers its refusal)
    config = tmp_path / "run.yml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    planned = run_in_process("plan", str(config), "--json")
    if "(refused)" in sample:
        assert_user_error(planned, "gate_up_proj and down_proj of one experts module",
                          "peft can train LoRA on one weight per module only")
        return
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(planned.stdout)
    assert plan["total_steps"] == 2
    recurrent = family in ("qwen3_5_moe", "jamba")  # their linear-attention / Mamba layers would mix packed rows
    assert plan["batching"] == ("group_by_length" if recurrent else "packed")
    assert any("sample packing is set aside" in warning for warning in plan["warnings"]) == recurrent
    trained = run_in_process("train", str(config))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == [1, 2]


def checked_and_planned(path: Path) -> dict:
    """`check` accepts the config and `plan` (which starts as `train` does: the data, the model on the meta device,
    the engine's checks) refuses nothing check accepted: the plan, as JSON."""
    checked = run_in_process("check", str(path))
    assert checked.returncode == 0, checked.stderr[-3000:]
    planned = run_in_process("plan", str(path), "--json")
    assert planned.returncode == 0, planned.stderr[-3000:]
    return json.loads(planned.stdout)


# one accepted config of each kind SAMPLES does not cover, planned only (in this process): check's verdict is plan's.
# (config, the plan's objective and engine)
CHECKED_AND_PLANNED = {
    "DPO, full fine-tune, chat_template.default pairs": ("qwen2/dpo.yaml", "dpo", "ddp"),
    "reward model under DeepSpeed ZeRO-1, bitsandbytes' 8-bit AdamW": ("qwen3/reward-model.yaml", "bradley_terry",
                                                                      "deepspeed"),
    "QLoRA under DeepSpeed ZeRO-2, bitsandbytes' 8-bit AdamW": ("mistral/mixtral/mixtral.yml", "language_model",
                                                                "deepspeed"),
    "full fine-tune under FSDP, offloaded, Liger": ("llama-3/fft-8b-liger-fsdp.yaml", "language_model", "fsdp2"),
    # (no GRPO config is among axolotl's examples: tuneloop's own, its prompts and reward functions beside it)
    "GRPO": (REPO / "examples" / "grpo.yml", "grpo", "ddp"),
}


@pytest.mark.parametrize("sample", CHECKED_AND_PLANNED)
def test_plan_refuses_nothing_check_accepted_on_one_config_of_each_kind(tmp_path, tiny_model_dir, sample):
    config, objective, engine = CHECKED_AND_PLANNED[sample]
    source = EXAMPLES / config
    raw = yaml.safe_load(source.read_text())
    if raw.get("rl") == "grpo":
        shutil.copy(source.parent / "grpo_rewards.py", tmp_path)
        raw["datasets"] = [dict(entry, path=str(REPO / entry["path"])) for entry in raw["datasets"]]
        raw = dict(swapped(raw, tiny_model_dir), output_dir=str(tmp_path / "out"), max_steps=2)
    else:
        raw = local_version(raw, tiny_model_dir, tmp_path)
        raw.pop("model_config", None)  # (Mixtral's own output_router_logits: a LLaMA config has no such setting)
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    plan = checked_and_planned(path)
    assert (plan["total_steps"], plan["objective"], plan["resolved"]["engine"]["name"]) == (2, objective, engine)


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_sample_of_accepted_configs_plans_and_trains_where_the_machine_can(tmp_path, tiny_model_dir, sample):
    from tuneloop.config import config_from_dict
    from tuneloop.host.hardware import hardware_needs
    from tuneloop.resolved import resolve_config

    raw = local_version(yaml.safe_load((EXAMPLES / SAMPLES[sample]).read_text()), tiny_model_dir, tmp_path)
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    plan = checked_and_planned(path)
    assert plan["total_steps"] == 2
    if "flash" in str(raw.get("attn_implementation")) and not shutil.which("nvidia-smi"):
        packed = "packed" in (plan["resolved"]["batching"], plan["resolved"]["eval_batching"])
        assert plan["attention"] == ("sdpa_per_sequence" if packed else "sdpa")  # (kernels/packed_attention.py)
        assert any("using sdpa" in warning for warning in plan["warnings"])
    trained = run_in_process("train", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warnings about speed-only keys, said by check and plan already)
        cfg = config_from_dict(raw)
        needs = [need for need in hardware_needs(cfg, resolve_config(cfg)) if "a CUDA GPU" in need]
    if needs and not shutil.which("nvidia-smi"):  # (QLoRA is not among them: bitsandbytes runs on this CPU)
        assert_user_error(trained, "this machine cannot run this config", "needs a CUDA GPU")
        assert not (tmp_path / "out" / "plan.json").exists()  # refused before anything was written
        return
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "out") if "loss" in m] == [1, 2]
