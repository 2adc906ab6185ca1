"""axolotl's vision-language example configs that `check` accepts (test_axolotl_configs.py counts them by the family
their hub id names) plan on a tiny twin of that family: the config's own keys as written (its chat template, LoRA
pattern, freezing, optimizer, precision), the tiny model of the same model type in place of the hub one and local
caption rows with images in place of the hub dataset. The plan counts image tokens and trains what the config says.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_in_process, write_config, write_jsonl
from test_axolotl_configs import EXAMPLES, asks_for_vision, check
from test_vision_language import caption_rows, save_llava, save_qwen2_vl
from vision_family_models import (save_gemma3, save_idefics3, save_internvl, save_mistral3, save_mllama,
                                  save_qwen3_5, save_qwen3_5_moe, save_qwen3_vl, save_smolvlm)
from vision_family_models import save_gemma4, save_qwen3_vl_moe

TWINS = {"llava": save_llava, "qwen2_vl": save_qwen2_vl, "qwen2_5_vl": lambda d: save_qwen2_vl(d, version="2.5"),
         "gemma3": save_gemma3, "idefics3": save_idefics3, "smolvlm": save_smolvlm, "mllama": save_mllama,
         "mistral3": save_mistral3, "qwen3_vl": save_qwen3_vl, "qwen3_5": save_qwen3_5,
         "qwen3_5_moe": save_qwen3_5_moe, "qwen3_vl_moe": save_qwen3_vl_moe, "internvl": save_internvl,
         "gemma4": save_gemma4}


def trained_family_examples() -> list[str]:
    """The vision-language examples whose hub id names a family tuneloop trains (the others are refused naming it:
    test_axolotl_configs.py counts them)."""
    if EXAMPLES is None:
        return []
    found = []
    for path in sorted(EXAMPLES.rglob("*")):
        raw = yaml.safe_load(path.read_text()) if path.suffix in (".yml", ".yaml") else None
        if raw and asks_for_vision(raw) and family_of(raw) in TWINS:
            found.append(path.relative_to(EXAMPLES).as_posix())
    return found


def family_of(raw: dict) -> str | None:
    from types import SimpleNamespace

    from tuneloop.config.vision_names import named_vision_family

    named = named_vision_family(SimpleNamespace(base_model=raw.get("base_model"),
                                                base_model_config=raw.get("base_model_config")))
    return named[0] if named else None


@pytest.mark.skipif(EXAMPLES is None, reason="../shared/axolotl-examples is not on this machine")
@pytest.mark.parametrize("name", trained_family_examples())
def test_an_accepted_vision_example_plans_on_a_tiny_twin_of_its_family(tmp_path, name):
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    if check(tmp_path, dict(raw)).returncode != 0:
        pytest.skip(f"{name} is refused by check for another feature (counted in test_axolotl_configs.py)")
    family = family_of(raw)
    assert family in TWINS, (name, family)
    model_dir = TWINS[family](tmp_path / f"tiny_{family}")
    data = write_jsonl(tmp_path / "train.jsonl", caption_rows(tmp_path, 24, seed=6, size=(56, 56)))
    entry = {key: value for key, value in raw["datasets"][0].items() if key not in ("name", "data_files", "revision")}
    raw.update(base_model=str(model_dir), datasets=[{**entry, "path": str(data), "split": "train"}],
               output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prepared"), max_steps=2,
               sequence_len=512)
    for key in ("tokenizer_type", "tokenizer_config", "base_model_config", "hub_model_id", "test_datasets",
                "pretraining_dataset"):
        raw.pop(key, None)
    result = run_in_process("plan", str(write_config(tmp_path / "run.yml", **raw)), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["total_steps"] == 2
    if family != "mllama":  # (Mllama's cross-attended vision side is not counted: plan/flops.py)
        assert plan["vision_flops"]["images"] > 0, plan.get("vision_flops")
    assert 0 < plan["memory"]["trainable_parameters"] <= plan["memory"]["parameters"]
