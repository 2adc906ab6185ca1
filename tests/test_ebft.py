"""`rl: ebft` (structured mode) on a tiny LLaMA, in fp32: the feature-matching reward equals the paper's equation 7
computed here independently (a per-pair loop; whitening as the covariance's inverse square root), the features are the
starting model's hidden states (a LoRA run's adapter switched off, a full run's frozen copy: the rewards of step 2,
after the weights changed, recomputed from the base model on disk), the plan equals the run under the adaptive
completion cap, axolotl's built-in transforms and keys are read as its configs write them, and what is not built is
refused by name. (Two ranks == one process: test_ddp_equals_one_process.py; on a vLLM server, async:
test_vllm_server.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_user_error, read_metrics, run_in_process, write_config, write_jsonl

ANSWERS = {"cat": "the cat sat on the mat", "dog": "a dog ran far away from the sun",
           "sun": "the sun is red", "tree": "one tree, two trees and a blue bird in the tree",
           "red": "red", "blue": "blue is the moon and the star", "fish": "fish swim", "bird": "a bird flies"}


def opencode_rows(path):
    """nvidia/OpenCodeInstruct's columns, which `type: ebft_opencode.transform` maps to prompt + ground_truth."""
    return write_jsonl(path, [{"input": f"say {word}", "output": answer, "id": index}
                              for index, (word, answer) in enumerate(ANSWERS.items())])


def ebft_config(run_dir, model_dir, ebft=None, trl=None, **keys):
    values = {"base_model": str(model_dir), "rl": "ebft",
              "ebft": {"feature_layers": [0.5, 1.0], "embed_method": "last_token", **(ebft or {})},
              "trl": {"num_generations": 4, "max_completion_length": 12, "log_completions": True, **(trl or {})},
              "datasets": [{"path": str(opencode_rows(run_dir / "code.jsonl")), "type": "ebft_opencode.transform"}],
              "output_dir": str(run_dir / "out"), "sequence_len": 64, "micro_batch_size": 4,
              "gradient_accumulation_steps": 2, "max_steps": 2, "learning_rate": 5e-2, "optimizer": "adamw_torch",
              "lr_scheduler": "constant", "logging_steps": 1, "save_strategy": "no", "seed": 7, "bf16": False, **keys}
    return write_config(run_dir / "run.yml", **values)


# ---- the reward, against the paper's equation computed here ------------------------------------------------------

def equation_7(features: torch.Tensor, answer: torch.Tensor, alignment: float, diversity: float,
               whiten: bool) -> list[float]:
    """r_j = a·2·cos(φ_j, φ_y) − d·2/(n−1)·Σ_{k≠j} φ_j·φ_k for one group, in float64, by loops. Whitening: φ·C^(-1/2)
    with C = ΦᵀΦ of the group (eigenvalues below 1e-10 of the largest left out, as singular values below 1e-5)."""
    phi, y = features.double(), answer.double()
    if whiten:
        values, vectors = torch.linalg.eigh(phi.T @ phi)
        kept = values > values.max() * 1e-10
        inverse_root = (vectors[:, kept] / values[kept].sqrt()) @ vectors[:, kept].T
        phi, y = phi @ inverse_root, y @ inverse_root
    else:
        phi, y = phi / phi.norm(dim=1, keepdim=True), y / y.norm()
    n = len(phi)
    rewards = []
    for j in range(n):
        cosine = float(phi[j] @ y / (phi[j].norm() * y.norm()))
        others = sum(float(phi[j] @ phi[k]) for k in range(n) if k != j)
        rewards.append(alignment * 2 * cosine - diversity * 2 * others / (n - 1))
    return rewards


@pytest.mark.parametrize("whiten", [False, True])
def test_the_reward_is_the_papers_equation_7_group_by_group(whiten):
    from types import SimpleNamespace

    from tuneloop.online_rl.feature_matching import feature_rewards

    generator = torch.Generator().manual_seed(0)
    features, answers = torch.randn(12, 24, generator=generator), torch.randn(3, 24, generator=generator)
    settings = SimpleNamespace(use_whitening=whiten, alignment_coef=0.7, diversity_coef=1.3)
    found = feature_rewards(features, answers, 4, settings)
    expected = [r for g in range(3) for r in equation_7(features[4 * g:4 * g + 4], answers[g], 0.7, 1.3, whiten)]
    assert found.rewards.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert set(found.line) == {"ebft/alignment", "ebft/diversity", "ebft/cfm_loss"}
    if whiten:  # (a whitened group's completions are orthonormal: nothing left for the diversity term)
        assert abs(found.line["ebft/diversity"]) < 1e-4


def test_pooling_reads_the_right_positions_and_ignores_padding():
    from tuneloop.online_rl.feature_matching import pooled

    hidden = torch.arange(2 * 8 * 1, dtype=torch.float32).reshape(2, 8, 1)
    lengths, prompts = torch.tensor([8, 5]), torch.tensor([3, 2])
    assert pooled(hidden, lengths, prompts, "last_token").flatten().tolist() == [7.0, 12.0]
    assert pooled(hidden, lengths, prompts, "mean_pooling").flatten().tolist() == [3.5, 10.0]
    assert pooled(hidden, lengths, prompts, "completion_mean").flatten().tolist() == [5.0, 11.0]
    assert pooled(hidden, lengths, prompts, "concat").tolist() == [[2.0, 4.0, 6.0], [9.0, 10.0, 11.0]]


# ---- end to end: the rewards of the logged completions, recomputed from the base model ---------------------------

def recomputed_rewards(model_dir, out, layers: list[int]) -> dict:
    """{step: the eq.-7 reward of each logged completion}, from the base model's own hidden states of prompt +
    completion (its stop token left out) and of prompt + reference answer, each sequence alone (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}

    def features(ids):
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        return torch.cat([hidden[index][0, -1] for index in layers])

    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    found = {}
    for step in sorted({record["step"] for record in logged}):
        records = [record for record in logged if record["step"] == step]
        rewards = []
        for first in range(0, len(records), 4):
            group = records[first:first + 4]
            text = tokenizer.apply_chat_template(group[0]["prompt"], tokenize=False, add_generation_prompt=True)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            word = group[0]["prompt"][0]["content"].removeprefix("say ")
            answer = features(prompt + tokenizer(ANSWERS[word], add_special_tokens=False)["input_ids"])
            completions = torch.stack([features(prompt + [t for t in r["completion_ids"]][
                :-1 if r["completion_ids"] and r["completion_ids"][-1] in stops else None]) for r in group])
            rewards += equation_7(completions, answer, 1.0, 1.0, whiten=False)
        found[step] = rewards
    return found


@pytest.mark.parametrize("adapter", ["lora", None])
def test_rewards_are_the_starting_models_features_and_the_plan_equals_the_run(tmp_path, tiny_model_dir, adapter):
    """Two steps at a learning rate that moves the weights: step 2's rewards still come from the starting model (the
    adapter switched off, or the frozen copy). Completions are forced to the cap (min_new_tokens), so the run
    generates exactly the plan's upper bound under EBFT's adaptive cap."""
    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True} if adapter else {}
    (tmp_path / "rewards.py").write_text("def short(prompts, completions, **kwargs):\n"
                                         "    return [-len(c[0]['content']) / 10 for c in completions]\n")
    trl = {"generation_kwargs": {"min_new_tokens": 12}}
    if not adapter:  # (a reward function of the user's beside EBFT's, weighed after it)
        trl.update(reward_funcs=["rewards.short"], reward_weights=[1.0, 0.5])
    config = ebft_config(tmp_path, tiny_model_dir, trl=trl, **lora)
    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "features             hidden states after layers 1, 2 of 2, last_token pooled, L2-normalised" \
        in planned.stdout
    assert "EBFT's adaptive cap: 1.5 × each step's longest reference answer" not in planned.stdout  # (64 > 12)
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    plan, summary = json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text())
    assert plan["rollout"]["reward_funcs"] == (["ebft"] if adapter else ["ebft", "short"])
    assert plan["rollout"]["feature_matching"]["features_from"] == (
        "the base model, the adapter switched off" if adapter else "a frozen copy of the starting model")
    assert summary["tokens"] == plan["rollout"]["generated_tokens_at_most"] == 2 * 8 * 12
    lines = read_metrics(out)
    assert all({"rewards/ebft", "ebft/alignment", "ebft/diversity", "ebft/cfm_loss"} <= set(line) for line in lines)
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    recomputed = recomputed_rewards(tiny_model_dir, out, [1, 2])
    for step in (1, 2):
        found = [record["rewards"]["ebft"] for record in logged if record["step"] == step]
        assert found == pytest.approx(recomputed[step], abs=2e-5)
    assert lines[1]["rewards/ebft"] == pytest.approx(sum(recomputed[2]) / 8, abs=1e-5)
    if not adapter:
        for record in logged:
            assert record["reward"] == pytest.approx(record["rewards"]["ebft"] + 0.5 * record["rewards"]["short"],
                                                     abs=1e-5)


def test_the_adaptive_cap_follows_the_longest_reference_answer_and_the_plan_says_so(tmp_path, tiny_model_dir):
    """max_completion_length 200: each step's cap is max(64, 1.5 × its longest answer) tokens, below 200; the plan
    states the caps and generates at most their sum."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    long_answers = {word: " ".join([answer] * (3 if word in ("tree", "dog") else 1)) for word, answer in ANSWERS.items()}
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": [{"role": "user", "content": f"say {w}"}],
                                                  "ground_truth": a} for w, a in long_answers.items()])
    config = ebft_config(tmp_path, tiny_model_dir, trl={"max_completion_length": 200}, datasets=[{"path": str(rows)}],
                         sequence_len=256, max_steps=4)
    planned = run_in_process("plan", str(config), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    rollout = json.loads(planned.stdout)["rollout"]
    lengths = {w: len(tokenizer(a, add_special_tokens=False)["input_ids"]) for w, a in long_answers.items()}
    low, high = max(64, int(1.5 * min(lengths.values()))), min(200, int(1.5 * max(lengths.values())))
    assert rollout["completion_caps"][0] >= low and rollout["completion_caps"][1] == high < 200
    assert rollout["generated_tokens_at_most"] < 4 * 8 * 200
    text = run_in_process("plan", str(config))
    assert "EBFT's adaptive cap: 1.5 × each step's longest reference answer, 64 to max_completion_length 200" \
        in text.stdout


# ---- what the plan says of replies that do not fit -------------------------------------------------------------

def test_the_plan_warns_when_max_completion_length_is_below_the_typical_reference_reply(tmp_path, tiny_model_dir):
    """A GRPO set with `solution` columns of ~30 tokens and max_completion_length 8: the plan says most completions
    would be cut (TRL's quickstart trains on zero reward this way), and names a length that fits."""
    from test_grpo import grpo_config

    rows = write_jsonl(tmp_path / "math.jsonl", [{"prompt": f"what is {i} + {i}?",
                                                  "solution": f"{i} plus {i} is the same as two times {i}, " * 3}
                                                 for i in range(8)])
    config = grpo_config(tmp_path, tiny_model_dir, datasets=[{"path": str(rows)}])
    planned = run_in_process("plan", str(config), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    replies = plan["rollout"]["reference_replies"]
    assert replies["rows"] == 8 and replies["longer_than_max_completion_length"] == 8
    warning = next(w for w in plan["warnings"] if "max_completion_length=8 is below the typical reference reply" in w)
    assert f"raise it to about {replies['p90_tokens']}" in warning and replies["median_tokens"] > 8


# ---- axolotl's configs and what is refused ---------------------------------------------------------------------

@pytest.mark.parametrize("change,fragments", [
    ({"ebft": {"mode": "strided", "stride": 8}}, ["`ebft.mode: strided` asks for this preference/RL training",
                                                  "block attention mask"]),
    ({"ebft": {"stride": 8}}, ["`ebft.stride` is a setting of EBFT's strided mode"]),
    ({"ebft": {"ce_coef": 0.03}}, ["`ebft.ce_coef: 0.03`", "only EBFT's strided mode trains"]),
    ({"ebft": {"feature_layers": [0.5, 1.5]}}, ["1.5 is not a depth between 0 and 1"]),
    ({"ebft": {"embed_method": "max"}}, ["ebft.embed_method"]),
    ({"rl": "grpo", "trl": {"reward_funcs": ["rewards.short"]}}, ["`ebft:` configures `rl: ebft`",
                                                                  "this run is `rl: grpo`"]),
    ({"trl": {"reward_weights": [1.0, 2.0]}}, ["`trl.reward_weights` has 2 weights for 1 rewards (ebft, EBFT's own"]),
])
def test_refused_keys_are_one_line_naming_them(tmp_path, tiny_model_dir, change, fragments):
    config = ebft_config(tmp_path, tiny_model_dir)
    import yaml

    values = yaml.safe_load(config.read_text())
    for key, value in change.items():
        values[key] = {**values[key], **value} if isinstance(value, dict) and key in ("ebft", "trl") else value
    if change.get("rl") == "grpo":
        (tmp_path / "rewards.py").write_text("def short(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    config.write_text(yaml.safe_dump(values))
    assert_user_error(run_in_process("check", str(config)), *fragments)


@pytest.mark.parametrize("rows,fragments", [
    ([{"prompt": "say cat"}], ["code.jsonl:1", "`ground_truth` text, and this row has none"]),
    ([{"prompt": "say cat", "ground_truth": "a cat", "remaining_turns": [{"role": "user", "content": "more"}]}],
     ["code.jsonl:1", "`remaining_turns`", "multi-turn EBFT"]),
])
def test_rows_without_a_reference_answer_are_exit_2_naming_the_row(tmp_path, tiny_model_dir, rows, fragments):
    config = ebft_config(tmp_path, tiny_model_dir)
    import yaml

    values = yaml.safe_load(config.read_text())
    values["datasets"] = [{"path": str(write_jsonl(tmp_path / "code.jsonl", rows * 8))}]
    config.write_text(yaml.safe_dump(values))
    assert_user_error(run_in_process("train", str(config)), *fragments)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_axolotls_reasoning_transforms_make_prompt_and_answer():
    from tuneloop.online_rl.builtin_transforms import BUILTIN_TRANSFORMS

    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "<think>two and two</think> 4"}]}
    whole, _ = BUILTIN_TRANSFORMS["ebft_reasoning.transform"](None)
    answer_only, _ = BUILTIN_TRANSFORMS["ebft_reasoning.transform_answer_only"](None)
    assert whole(row) == {"prompt": row["messages"][:2], "ground_truth": "<think>two and two</think> 4"}
    assert answer_only(row)["ground_truth"] == "4"
