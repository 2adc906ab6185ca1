"""Two DDP ranks (torchrun, gloo) end with one process's weights on the same global batch, for every feature that
reaches DDP's reduction its own way: a plain LLaMA, bf16 compute weights with fp32 masters, QLoRA, a vision-language
model, a T5 (also under FSDP2 and ZeRO-3), DPO's pairs, GRPO's completion groups; and the plan made for two ranks is
the plan the two ranks ran.

Every two-rank run of this module shares ONE launch (conftest's run_in_one_launch: each rank runs the configs one
after another, as a user's sweep in one launch would): a launch costs two fresh interpreters with torch and
transformers, the runs themselves a second or two each. Each test makes its one-process reference in this process.
Each feature's own module holds its other proofs (accumulation == one batch, resume, the plan); fp32 (`bf16: false`)
wherever equality is asserted, and bf16 with masters where that is the feature."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import base_config, read_metrics, run_in_one_launch, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file

ONE_SGD_STEP = {"optimizer": "sgd", "learning_rate": 1.0, "max_grad_norm": 0, "max_steps": 1,
                "lr_scheduler": "constant", "num_epochs": 1}


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |a| over every tensor (relative L2)."""
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


def change(out, model_dir, weights: str = "model.safetensors") -> dict:
    """What a run's steps did to each weight (in float64, so the difference itself rounds nothing away)."""
    after, before = load_file(out / weights), load_file(model_dir / "model.safetensors")
    return {key: after[key].double() - before[key].double() for key in before}


def trained_here(config) -> None:
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def finished(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


# ---- each feature's configs: (folder, keys) for one process and for two ranks -----------------------------------
def plain_config(folder, model_dir, data, ranks: int):
    """One SGD step (lr 1, no clipping: the weight change is the gradient) of 8 rows: 4 × 2 or 2 ranks × 2 × 2."""
    return write_config(folder / "run.yml", **base_config(folder, model_dir, data, **ONE_SGD_STEP, micro_batch_size=2,
                                                          gradient_accumulation_steps=4 // ranks))


FOUR_ADAMW_STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-4, "max_steps": 4, "lr_scheduler": "constant",
                    "num_epochs": 1, "micro_batch_size": 2}


def masters_config(folder, model_dir, data, ranks: int):
    """bf16 with fp32 masters, four AdamW steps of 8 rows (2 × 4, or 2 ranks × 2 × 2)."""
    return write_config(folder / "run.yml", **base_config(folder, model_dir, data, bf16=True, **FOUR_ADAMW_STEPS,
                                                          gradient_accumulation_steps=4 // ranks))


def qlora_config(folder, model_dir, data, ranks: int):
    """One SGD step of the global batch of 8: one process of 8 rows, or 2 ranks of 4."""
    from test_qlora import QLORA

    one_step = {**QLORA, "optimizer": "sgd", "learning_rate": 1.0, "lr_scheduler": "constant", "max_grad_norm": 0,
                "max_steps": 1}
    return write_config(folder / "run.yml", **base_config(folder, model_dir, data, micro_batch_size=8 // ranks,
                                                          **one_step))


VLM_SGD_STEPS = dict(optimizer="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler="constant", max_steps=2)


def vlm_config_of(folder, model_dir, data, ranks: int):
    """16 rows, 2 SGD steps of 8: one process accumulates 4 micro-batches of 2; two ranks accumulate 2 each."""
    from test_vision_language import vlm_config

    return write_config(folder / "run.yml", **vlm_config(folder, model_dir, data, micro_batch_size=2,
                                                         gradient_accumulation_steps=4 // ranks, **VLM_SGD_STEPS))


T5_ENGINES = {"ddp": {}, "fsdp2": {"fsdp": ["full_shard"], "fsdp_config": {"fsdp_version": 2}},  # T5Block, from the
              "zero3": {"deepspeed": "zero3"}}  # model's _no_split_modules; ZeRO-3 gathers the tied head with the embedding


def t5_config(folder, model_dir, data, ranks: int, engine: str = "ddp"):
    """One SGD step of 8 source → target rows, padded on both sides."""
    from test_seq2seq import seq2seq_keys

    return write_config(folder / "run.yml", **base_config(folder, model_dir, data, **ONE_SGD_STEP, **seq2seq_keys(
        data, micro_batch_size=2, gradient_accumulation_steps=4 // ranks, **T5_ENGINES[engine])))


def dpo_config(folder, model_dir, data, ranks: int):
    """One SGD step of 8 pairs (beta 0.5)."""
    from test_preference import ONE_SGD_STEP as DPO_STEP
    from test_preference import preference_config

    return write_config(folder / "run.yml", **preference_config(folder, model_dir, data, **DPO_STEP, rl_beta=0.5,
                                                                micro_batch_size=2,
                                                                gradient_accumulation_steps=4 // ranks))


def grpo_config_of(folder, model_dir, prompts, ranks: int):
    """Micro-batch 2 × 2 on each of 2 ranks (prompt groups of 4 span the ranks), or 2 × 4 in one process, over the
    same fed completions."""
    from test_grpo import grpo_config

    return grpo_config(folder, model_dir, micro_batch_size=2, gradient_accumulation_steps=4 // ranks,
                       trl={"loss_type": "grpo", "scale_rewards": "batch", "log_completions": True},
                       optimizer="sgd", learning_rate=0.1, datasets=[{"path": str(prompts)}])


def ebft_config_of(folder, model_dir, ranks: int):
    """EBFT's groups of 4 over 2 ranks of 2 completions each (every group spans both), or 1 × 4 in one process, over
    the same fed completions: the feature-matching rewards compare whole groups wherever they live."""
    from test_ebft import ebft_config

    return ebft_config(folder, model_dir, micro_batch_size=1, gradient_accumulation_steps=4 // ranks,
                       optimizer="sgd", learning_rate=0.1)


PLAN_KEYS = dict(sample_packing=True, sequence_len=256, micro_batch_size=1, gradient_accumulation_steps=2,
                 num_epochs=2)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir, tiny_tokenizer_dir) -> dict:
    """The models and data of every feature, made once."""
    from test_grpo import REWARDS, WORDS, fixed_completions
    from test_preference import pair_rows
    from test_seq2seq import save_tiny_t5
    from test_vision_language import caption_rows, save_llava

    root = tmp_path_factory.mktemp("inputs")
    (root / "grpo").mkdir()
    (root / "grpo" / "rewards.py").write_text(REWARDS)
    return {
        "root": root,
        "llama": tiny_model_dir,
        "rows": write_jsonl(root / "rows.jsonl", tiny_rows(64, seed=3)),
        "masters_rows": write_jsonl(root / "masters_rows.jsonl", tiny_rows(48, seed=5)),
        "qlora_rows": write_jsonl(root / "qlora_rows.jsonl", tiny_rows(32, seed=3)),
        "llava": save_llava(root / "llava"),
        "captions": write_jsonl(root / "captions.jsonl", caption_rows(root, 16, seed=11)),
        "t5": save_tiny_t5(root / "t5", tiny_tokenizer_dir),
        "t5_pairs": write_jsonl(root / "t5_pairs.jsonl", [{"source": row["instruction"], "target": row["output"]}
                                                          for row in tiny_rows(96, seed=5)]),
        "dpo_pairs": write_jsonl(root / "dpo_pairs.jsonl", pair_rows(32, seed=5)),
        "prompts": write_jsonl(root / "grpo" / "prompts.jsonl",
                               [{"prompt": [{"role": "user", "content": f"say {w}"}], "word": w} for w in WORDS[:8]]),
        "fed_completions": fixed_completions(root / "grpo" / "fixed.json", tiny_model_dir, 8),
        "plan_rows": write_jsonl(root / "plan_rows.jsonl", tiny_rows(90, seed=11)),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, inputs) -> tuple:
    """Every two-rank run of this module, in one launch. Returns (their folders, their results by name)."""
    from tuneloop.online_rl.rollout import FIXED_COMPLETIONS_ENV

    root = tmp_path_factory.mktemp("two_ranks")
    folders = {name: root / name for name in ("plain", "masters", "qlora", "vlm", "t5_ddp", "t5_fsdp2", "t5_zero3",
                                              "dpo", "grpo", "ebft", "plan")}
    for folder in folders.values():
        folder.mkdir()
    plan_config = write_config(folders["plan"] / "run.yml", **base_config(folders["plan"], inputs["llama"],
                                                                          inputs["plan_rows"], **PLAN_KEYS))
    # planned before anything ran (a run records its pace for `torch_compile: auto`'s next plans), and first there
    planned = run_in_process("plan", str(plan_config), "--json", "--world-size", "2")
    configs = {
        "plan": (plan_config, {}),
        "plain": (plain_config(folders["plain"], inputs["llama"], inputs["rows"], 2), {}),
        "masters": (masters_config(folders["masters"], inputs["llama"], inputs["masters_rows"], 2), {}),
        "qlora": (qlora_config(folders["qlora"], inputs["llama"], inputs["qlora_rows"], 2), {}),
        "vlm": (vlm_config_of(folders["vlm"], inputs["llava"], inputs["captions"], 2), {}),
        **{f"t5_{engine}": (t5_config(folders[f"t5_{engine}"], inputs["t5"], inputs["t5_pairs"], 2, engine), {})
           for engine in T5_ENGINES},
        "dpo": (dpo_config(folders["dpo"], inputs["llama"], inputs["dpo_pairs"], 2), {}),
        "grpo": (grpo_config_of(folders["grpo"], inputs["llama"], inputs["prompts"], 2),
                 {FIXED_COMPLETIONS_ENV: inputs["fed_completions"]}),
        "ebft": (ebft_config_of(folders["ebft"], inputs["llama"], 2), {FIXED_COMPLETIONS_ENV: inputs["fed_completions"]}),
    }
    results = run_in_one_launch(*((["train", str(config)], env) for config, env in configs.values()))
    return folders, {**dict(zip(configs, results)), "planned": planned}


@pytest.mark.slow
def test_two_ddp_ranks_equal_one_process(tmp_path, inputs, two_ranks):
    """(The same through `accelerate launch`: test_equivalence.py.)"""
    folders, results = two_ranks
    finished(results["plain"])
    trained_here(plain_config(tmp_path, inputs["llama"], inputs["rows"], 1))
    plan = (folders["plain"] / "out" / "plan.json").read_text()
    assert '"world_size": 2' in plan and '"global_batch_size": 8' in plan
    assert relative_difference(change(folders["plain"] / "out", inputs["llama"]),
                               change(tmp_path / "out", inputs["llama"])) < 1e-5


@pytest.mark.slow
def test_two_ddp_ranks_with_masters_equal_one_process(tmp_path, inputs, two_ranks):
    """2 ranks × 1 micro-batch of 2 × 2 accumulation = one process's 2 × 2 × 2 rows: same micro-batches, so the same
    bf16 gradients; only the order of the fp32 sums differs (the bf16 weights' sums of a few bf16 values are exact in
    fp32; the fp32 weights' are not: the difference measured 1.9e-7)."""
    folders, results = two_ranks
    finished(results["masters"])
    trained_here(masters_config(tmp_path, inputs["llama"], inputs["masters_rows"], 1))
    two = folders["masters"] / "out"
    plan = json.loads((two / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["resolved"]["precision"]["masters"] is True
    one_change, two_change = change(tmp_path / "out", inputs["llama"]), change(two, inputs["llama"])
    difference = sum(float((two_change[k] - one_change[k]).pow(2).sum()) for k in one_change) ** 0.5 / \
        sum(float(one_change[k].pow(2).sum()) for k in one_change) ** 0.5
    print(f"relative L2 of 2 ranks' weight change against one process's: {difference:.2e}")
    assert difference < 1e-5


@pytest.mark.slow
def test_two_ddp_ranks_of_qlora_equal_one_process(tmp_path, inputs, two_ranks):
    """LoRA's B starts at zero, so its value after the step is the gradient: the two agree within 1e-5 relative (the
    same NF4 weights on both ranks, the gradients averaged by DDP); A is not trained by one step's B = 0 path."""
    pytest.importorskip("bitsandbytes")
    folders, results = two_ranks
    finished(results["qlora"])
    trained_here(qlora_config(tmp_path, inputs["llama"], inputs["qlora_rows"], 1))
    adapters = {"one": load_file(tmp_path / "out" / "adapter_model.safetensors"),
                "two": load_file(folders["qlora"] / "out" / "adapter_model.safetensors")}
    b_weights = [key for key in adapters["one"] if "lora_B" in key]
    assert b_weights and all(float(adapters["one"][key].abs().sum()) > 0 for key in b_weights)
    difference = sum(float((adapters["one"][k] - adapters["two"][k]).pow(2).sum()) for k in b_weights) ** 0.5
    size = sum(float(adapters["one"][k].pow(2).sum()) for k in b_weights) ** 0.5
    assert difference / size < 1e-5
    assert all(torch.equal(adapters["one"][k], adapters["two"][k]) for k in adapters["one"] if "lora_A" in k)


@pytest.mark.slow
def test_two_ddp_ranks_of_a_vlm_run_equal_one_process(tmp_path, inputs, two_ranks):
    """Each rank collates its own rows *and their images* (an image given to the wrong row, or the same images on
    both ranks, changes the gradient)."""
    folders, results = two_ranks
    finished(results["vlm"])
    trained_here(vlm_config_of(tmp_path, inputs["llava"], inputs["captions"], 1))
    runs = {"one": change(tmp_path / "out", inputs["llava"]), "ddp": change(folders["vlm"] / "out", inputs["llava"])}
    plan = json.loads((folders["vlm"] / "out" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["global_batch_size"] == 8 and plan["total_steps"] == 2
    for out in (tmp_path / "out", folders["vlm"] / "out"):
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["tokens"] == plan["total_trainable_tokens"]
    tower = [key for key in runs["one"] if "vision_tower" in key]
    assert tower and any(runs["one"][key].abs().max() > 0 for key in tower)  # the images reached the gradient
    difference = relative_difference(runs["ddp"], runs["one"])
    print(f"\ntwo ranks vs one process, 2 SGD steps of 8 rows: relative L2 difference of the updates {difference:.2e}")
    assert difference < 1e-5


@pytest.fixture(scope="module")
def t5_one_process(tmp_path_factory, inputs) -> dict:
    folder = tmp_path_factory.mktemp("t5_one")
    trained_here(t5_config(folder, inputs["t5"], inputs["t5_pairs"], 1))
    return change(folder / "out", inputs["t5"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", T5_ENGINES)
def test_seq2seq_two_ranks_equal_one_process(inputs, two_ranks, t5_one_process, engine):
    """DDP, FSDP2 (T5Block) and ZeRO-3 (the tied head gathered with the embedding it shares)."""
    folders, results = two_ranks
    finished(results[f"t5_{engine}"])
    assert relative_difference(change(folders[f"t5_{engine}"] / "out", inputs["t5"]), t5_one_process) < 1e-5


@pytest.mark.slow
def test_dpo_on_two_ranks_equals_one_process(tmp_path, inputs, two_ranks):
    folders, results = two_ranks
    finished(results["dpo"])
    trained_here(dpo_config(tmp_path, inputs["llama"], inputs["dpo_pairs"], 1))
    plan = json.loads((folders["dpo"] / "out" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["global_batch_size"] == 8 and plan["unit"] == "pairs"
    assert relative_difference(change(folders["dpo"] / "out", inputs["llama"]),
                               change(tmp_path / "out", inputs["llama"])) < 1e-5


@pytest.mark.slow
def test_grpo_two_ranks_equal_one_process_on_the_same_completions(tmp_path, inputs, two_ranks, monkeypatch):
    """Group advantages are taken over whole groups across ranks, so the weights agree to the fp32 reduction order;
    the main process logs every rank's completions, in the global order."""
    from test_grpo import REWARDS

    from tuneloop.online_rl.rollout import FIXED_COMPLETIONS_ENV

    folders, results = two_ranks
    finished(results["grpo"])
    (tmp_path / "rewards.py").write_text(REWARDS)
    monkeypatch.setenv(FIXED_COMPLETIONS_ENV, inputs["fed_completions"])
    monkeypatch.delitem(__import__("sys").modules, "rewards", raising=False)  # (an earlier in-process run's)
    trained_here(grpo_config_of(tmp_path, inputs["llama"], inputs["prompts"], 1))
    one_out, two_out = tmp_path / "out", folders["grpo"] / "out"
    assert [line["reward"] for line in read_metrics(one_out)] == pytest.approx(
        [line["reward"] for line in read_metrics(two_out)])
    logged = {name: [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
              for name, out in (("one", one_out), ("two", two_out))}
    assert [(r["where"], r["reward"]) for r in logged["two"]] == [(r["where"], r["reward"]) for r in logged["one"]]
    one, two = load_file(one_out / "model.safetensors"), load_file(two_out / "model.safetensors")
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ebft_two_ranks_equal_one_process_on_the_same_completions(tmp_path, inputs, two_ranks, monkeypatch):
    """Each rank pools its own completions' features; the rewards are taken over whole groups once gathered, so a
    group split across the ranks scores as in one process, and the weights agree to the fp32 reduction order."""
    from tuneloop.online_rl.rollout import FIXED_COMPLETIONS_ENV

    folders, results = two_ranks
    finished(results["ebft"])
    monkeypatch.setenv(FIXED_COMPLETIONS_ENV, inputs["fed_completions"])
    trained_here(ebft_config_of(tmp_path, inputs["llama"], 1))
    one_out, two_out = tmp_path / "out", folders["ebft"] / "out"
    logged = {name: [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
              for name, out in (("one", one_out), ("two", two_out))}
    assert [r["where"].rpartition("/")[2] for r in logged["two"]] == [r["where"].rpartition("/")[2]
                                                                       for r in logged["one"]]
    assert [r["rewards"]["ebft"] for r in logged["two"]] == pytest.approx(
        [r["rewards"]["ebft"] for r in logged["one"]], abs=1e-5)
    assert len({round(r["rewards"]["ebft"], 4) for r in logged["one"]}) == len(logged["one"]) == 8  # (all differ)
    one, two = load_file(one_out / "model.safetensors"), load_file(two_out / "model.safetensors")
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_plan_for_two_ranks_equals_a_real_two_rank_run(inputs, two_ranks):
    """`tuneloop plan --world-size 2` made here before the launch (the ranks of a shared launch, like this process,
    run the allocator a TrainingSession opened from Python runs: host/allocator.py) is the plan.json the two ranks
    wrote, and the run took its steps and its tokens."""
    folders, results = two_ranks
    finished(results["plan"])
    config, out = folders["plan"] / "run.yml", folders["plan"] / "out"
    assert results["planned"].returncode == 0, results["planned"].stderr[-2000:]
    planned = json.loads(results["planned"].stdout)
    ran = json.loads((out / "plan.json").read_text())
    assert ran == planned and ran["world_size"] == 2
    steps = [m for m in read_metrics(out) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, planned["total_steps"] + 1))
    assert steps[-1]["tokens"] == planned["total_trainable_tokens"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets_collated"] == planned["total_trainable_tokens"]  # both ranks' collators, summed
    # and the world-size-1 plan of the same config really differs: twice the steps
    single = json.loads(run_in_process("plan", str(config), "--json", "--world-size", "1").stdout)
    assert single["steps_per_epoch"] >= 2 * planned["steps_per_epoch"] - 1
