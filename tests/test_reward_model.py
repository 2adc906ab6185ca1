"""Bradley-Terry reward models (`reward_model: true`, axolotl's keys): the loss against TRL's RewardTrainer on
the same rows, accumulation against one big batch, and the reward-model example's keys run end to end (plan ==
run, eval accuracy, a saved folder that transformers reloads and that scores the same)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CORPUS, assert_user_error, base_config, read_metrics, run_in_process, write_config, write_jsonl
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.collate import Collator
from tuneloop.data.prepare import prepare
from tuneloop.engines.base import forget_accelerate_state
from tuneloop.train.reward_model import BradleyTerryLoss

WORDS = " ".join(CORPUS).split()
# (../shared beside the checkout, or the workplace's /work/shared for a checkout elsewhere, as test_axolotl_configs)
SHARED = next((p for p in (Path(__file__).parents[2] / "shared", Path("/work/shared"))
               if (p / "axolotl-examples").is_dir()), Path(__file__).parents[2] / "shared")
EXAMPLE = SHARED / "axolotl-examples" / "qwen3" / "reward-model.yaml"
ONE_SGD_STEP = {"optimizer": "sgd", "learning_rate": 1.0, "max_grad_norm": 0, "max_steps": 1,
                "lr_scheduler": "constant"}


def bt_rows(count: int, seed: int = 0, easy: bool = False) -> list[dict]:
    """axolotl's bradley_terry rows: system (on every other row), input, chosen, rejected. `easy`: the chosen reply
    always names colours, the rejected one counts."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        row = {"input": " ".join(rng.choices(WORDS, k=rng.randint(3, 10)))}
        if index % 2:
            row["system"] = "Answer briefly."
        if easy:
            row["chosen"], row["rejected"] = "red, green and blue.", "one two three four five six seven."
        else:
            row["chosen"], row["rejected"] = (" ".join(rng.choices(WORDS, k=rng.randint(2, 14))) for _ in range(2))
        rows.append(row)
    return rows


def reward_config(tmp_path, model_dir, data, **keys) -> dict:
    keys = {"model_type": "AutoModelForSequenceClassification", "num_labels": 1, "reward_model": True,
            "datasets": [{"path": str(data), "type": "bradley_terry.chat_template"}], **keys}
    return base_config(tmp_path, model_dir, data, **keys)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny LLaMA with a score head drawn from a fixed seed, saved as a sequence classifier."""
    target = tmp_path_factory.mktemp("tiny_reward_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bt_pairs") / "pairs.jsonl", bt_rows(8, seed=3))


# ---- the loss, against TRL ---------------------------------------------------------------------------------
def trl_loss_and_gradients(tmp_path, model, tokenizer, rows, coefficient):
    """TRL's RewardTrainer (installed by the test extra; not built upon) on the same rows as conversations: its
    batch of every pair, its compute_loss and that loss's gradients."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    conversations = []
    for row in rows:
        prompt = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
            {"role": "user", "content": row["input"]}]
        conversations.append({side: [*prompt, {"role": "assistant", "content": row[side]}]
                              for side in ("chosen", "rejected")})
    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), report_to=[],
                        use_cpu=True, bf16=False, center_rewards_coefficient=coefficient)
    try:
        trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(conversations),
                                processing_class=tokenizer)
        batch = next(iter(trainer.get_train_dataloader()))
        model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    finally:  # the Trainer's Accelerator state would refuse the next run's precision in this process
        forget_accelerate_state()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}, batch


@pytest.mark.parametrize("coefficient", [None, 0.5], ids=["plain", "centered"])
def test_the_loss_and_its_gradient_equal_trls_reward_trainer(tmp_path, reward_model_dir, pairs_file, coefficient):
    """tuneloop's data (bradley_terry.chat_template rendered, tokenized, collated) and loss against TRL's on the same
    rows: the same token ids, the same loss, the same gradient (so the same optimizer step), fp32."""
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()][:4]
    data = write_jsonl(tmp_path / "four.jsonl", rows)
    trl_loss, trl_gradients, trl_batch = trl_loss_and_gradients(tmp_path, model, tokenizer, rows, coefficient)

    cfg = config_from_dict(reward_config(tmp_path, reward_model_dir, data, center_rewards_coefficient=coefficient))
    store = prepare(cfg, tokenizer).train
    batch = Collator(store, tokenizer.pad_token_id, packed=False)([[unit] for unit in range(len(rows))])
    # the same sequences (TRL's rows are [chosen..., rejected...]; tuneloop's chosen, rejected, chosen, ...)
    def sequences(ids, mask):
        return sorted(tuple(row[mask_row.bool()].tolist()) for row, mask_row in zip(ids, mask))
    assert sequences(batch.inputs["input_ids"], batch.inputs["attention_mask"]) == sequences(
        trl_batch["input_ids"], trl_batch["attention_mask"])
    assert tuple(batch.inputs["input_ids"][0].tolist()) in {tuple(r.tolist()) for r in trl_batch["input_ids"][:4]}

    model.zero_grad()
    summed, stats = BradleyTerryLoss(coefficient or 0.0)(model, batch.inputs, batch.targets, batch.extra)
    ours = summed / len(rows)  # the loop divides by the step's pairs
    ours.backward()
    assert trl_loss > 0.05 and float(ours.detach()) == pytest.approx(trl_loss, rel=1e-5, abs=1e-6)
    worst = max(float((p.grad - trl_gradients[name]).abs().max()) for name, p in model.named_parameters())
    largest = max(float(g.abs().max()) for g in trl_gradients.values())
    assert largest > 1e-3 and worst <= 1e-5 * largest
    assert 0 <= float(stats[0]) <= len(rows)  # pairs ranked right


# ---- accumulation ------------------------------------------------------------------------------------------
def one_step_weights(tmp_path, model_dir, data, name, **keys) -> dict:
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = write_config(run_dir / "run.yml", **reward_config(run_dir, model_dir, data, **ONE_SGD_STEP,
                                                               center_rewards_coefficient=0.1, **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((run_dir / "out" / "plan.json").read_text())
    assert (plan["unit"], plan["objective"], plan["global_batch_size"]) == ("pairs", "bradley_terry", 4)
    return load_file(run_dir / "out" / "model.safetensors")


def test_two_micro_batches_of_2_pairs_equal_one_of_4(tmp_path, reward_model_dir, pairs_file):
    accumulated = one_step_weights(tmp_path, reward_model_dir, pairs_file, "accum", micro_batch_size=2,
                                   gradient_accumulation_steps=2)
    one_batch = one_step_weights(tmp_path, reward_model_dir, pairs_file, "batch", micro_batch_size=4,
                                 gradient_accumulation_steps=1)
    before = load_file(reward_model_dir / "model.safetensors")
    assert float((one_batch["score.weight"] - before["score.weight"]).abs().max()) > 1e-4  # a step was taken
    for name in before:
        assert torch.allclose(accumulated[name], one_batch[name], rtol=1e-5, atol=1e-6), name


# ---- the example's keys, end to end ------------------------------------------------------------------------
def example_keys(tmp_path, model_dir, data) -> dict:
    """axolotl's reward-model example with its paths made local and its sizes made tiny: a causal checkpoint under a
    new score head, as a reward model starts. An eval set and a learning rate that moves a tiny model are added;
    deepspeed (ZeRO-1 of one process) is left out."""
    keys = yaml.safe_load(EXAMPLE.read_text())
    for key in [key for key, value in keys.items() if value is None] + ["deepspeed"]:
        del keys[key]
    keys.update(base_model=str(model_dir), output_dir=str(tmp_path / "out"),
                dataset_prepared_path=str(tmp_path / "prepared"), sequence_len=96, num_epochs=2,
                datasets=[{"path": str(data), "type": "bradley_terry.chat_template"}], val_set_size=0.2,
                evals_per_epoch=1, eval_on_start=True, learning_rate=3e-3, optimizer="adamw_torch", seed=7)
    return keys


def test_the_reward_model_example_trains_as_planned_and_its_folder_reloads(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "easy.jsonl", bt_rows(40, seed=2, easy=True))
    keys = example_keys(tmp_path, tiny_model_dir, data)
    assert keys["reward_model"] is True and keys["center_rewards_coefficient"] == 0.01 and keys["bf16"] is True
    config = write_config(tmp_path / "run.yml", **keys)
    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "bradley_terry: loss averaged over the pairs" in planned.stdout
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "out"
    plan, summary = (json.loads((out / name).read_text()) for name in ("plan.json", "summary.json"))
    assert summary["steps"] == plan["total_steps"] == 2 * 8  # 32 train pairs / (1 × 4) per step, 2 epochs
    evals = [m for m in read_metrics(out) if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 8, 16] and evals[0]["eval_pairs"] == 8
    assert evals[-1]["eval_accuracy"] == 1.0 and evals[-1]["eval_margin"] > 1.0
    assert evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"]
    assert "eval accuracy first → last" in (out / "report.md").read_text()

    # `tuneloop eval` measures the saved folder as the run did
    measured = run_in_process("eval", str(config))
    assert measured.returncode == 0, measured.stderr[-3000:]
    assert json.loads(measured.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(
        evals[-1]["eval_loss"], rel=1e-5)

    # transformers alone reloads it, and its scores give the run's last eval loss: the pad id that finds the last
    # token, the head and the chat template all travelled with the folder
    reloaded = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id == tokenizer.pad_token_id
    cfg = config_from_dict(keys)
    eval_store = prepare(cfg, tokenizer).eval
    collate = Collator(eval_store, tokenizer.pad_token_id, packed=False)
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (the run's bf16 autocast)
        for unit in range(len(eval_store) // 2):
            ids = collate([[unit]]).inputs["input_ids"]
            chosen, rejected = reloaded(input_ids=ids).logits.float().squeeze(-1)
            losses.append(-torch.nn.functional.logsigmoid(chosen - rejected)
                          + 0.01 * (chosen + rejected) ** 2)
    assert float(torch.stack(losses).mean()) == pytest.approx(evals[-1]["eval_loss"], rel=1e-4)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours"},
                                              {"role": "assistant", "content": "red, green and blue."}],
                                             tokenize=False)
    assert rendered.startswith("<|im_start|>user")  # the example's chat template (qwen3) was saved with it


# ---- bad input ---------------------------------------------------------------------------------------------
def test_bad_reward_model_rows_and_keys_are_clear_errors(tmp_path, tiny_model_dir):
    rows = bt_rows(6, seed=1)
    del rows[3]["chosen"]
    data = write_jsonl(tmp_path / "missing.jsonl", rows)
    config = write_config(tmp_path / "run.yml", **reward_config(tmp_path, tiny_model_dir, data))
    assert_user_error(run_in_process("train", str(config)), "missing.jsonl:4: missing field `chosen`")

    good = write_jsonl(tmp_path / "good.jsonl", bt_rows(6, seed=1))
    for keys, fragments in (
            ({"num_labels": 2}, ["`num_labels: 2` with `reward_model: true`", "set `num_labels: 1`"]),
            ({"sample_packing": True}, ["`sample_packing: true` with `reward_model: true`", "last real token"]),
            ({"rl": "dpo"}, ["`reward_model: true` and `rl: dpo`"]),
            ({"reward_model": False}, ["`num_labels` shapes a reward model's training"]),
            ({"datasets": [{"path": str(good), "type": "chat_template"}]},
             ["`reward_model: true` trains on chosen/rejected pairs", "bradley_terry.chat_template"])):
        bad = write_config(tmp_path / "bad.yml", **reward_config(tmp_path, tiny_model_dir, good, **keys))
        assert_user_error(run_in_process("check", str(bad)), *fragments)
