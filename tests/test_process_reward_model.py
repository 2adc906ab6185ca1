"""Process reward models (`process_reward_model: true`, axolotl's `type: stepwise_supervised`): each step's label
on its end token, the loss against a token-classification cross-entropy computed by hand, a short run that trains
as planned and reloads as a token classifier, and a bad row as one clear error."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from conftest import assert_user_error, base_config, run_in_process, write_config, write_jsonl
from transformers import AutoModelForTokenClassification, AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.collate import Collator
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.prepare import prepare
from tuneloop.train.objectives import objective_of

ROWS = [{"prompt": "Add two and three.", "completions": ["two plus three", "is five"], "labels": [True, True]},
        {"prompt": "Count the cats.", "completions": ["one cat", "two cats and a dog", "so seven"],
         "labels": [True, False, False]},
        {"prompt": "Name a colour.", "completions": ["red"], "labels": [True]},
        {"prompt": "Is the sky green?", "completions": ["the sky is blue", "so yes"], "labels": [True, False]}]


def prm_config(tmp_path, model_dir, data, **keys) -> dict:
    keys = {"process_reward_model": True, "model_type": "AutoModelForTokenClassification",
            "datasets": [{"path": str(data), "type": "stepwise_supervised", "step_separator": "\n"}], **keys}
    return base_config(tmp_path, model_dir, data, **keys)


def expected_tokens(tokenizer, row) -> tuple[list[int], list[int]]:
    """axolotl's stepwise_supervised strategy, written out: [BOS] prompt, each step + "\\n", its last token
    labelled."""
    ids = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + tokenizer(
        row["prompt"], add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    separator = tokenizer.encode("\n", add_special_tokens=False)
    for step, label in zip(row["completions"], row["labels"]):
        step_ids = tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        ids += step_ids
        labels += [IGNORE_INDEX] * (len(step_ids) - 1) + [int(label)]
    return ids, labels


def test_labels_sit_at_step_ends_and_the_loss_is_token_classification_cross_entropy(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = write_jsonl(tmp_path / "steps.jsonl", ROWS)
    cfg = config_from_dict(prm_config(tmp_path, tiny_model_dir, data))
    store = prepare(cfg, tokenizer).train
    assert len(store) == len(ROWS)
    for index, row in enumerate(ROWS):
        ids, labels = expected_tokens(tokenizer, row)
        assert store.tokens("input_ids", index).tolist() == ids
        stored = store.tokens("labels", index).tolist()
        assert stored == labels
        ends = [position for position, label in enumerate(stored) if label != IGNORE_INDEX]
        assert len(ends) == len(row["completions"])  # one label per step, each at its separator's last token
        assert all(ids[position] == tokenizer.encode("\n", add_special_tokens=False)[-1] for position in ends)
        assert [stored[position] for position in ends] == [int(v) for v in row["labels"]]

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=2, dtype=torch.float32)
    batch = Collator(store, tokenizer.pad_token_id, packed=False)([[unit] for unit in range(len(ROWS))])
    objective = objective_of(cfg)
    assert (objective.name, objective.unit) == ("token_classification", "tokens")
    loss, stats = objective.summed_loss(model, batch.inputs, batch.targets, batch.extra)

    # by hand: the model's logits at every stored label's own position, transformers' token-classification loss
    width = batch.inputs["input_ids"].shape[1]
    labels = torch.full((len(ROWS), width), IGNORE_INDEX)
    for index in range(len(ROWS)):
        row_labels = torch.tensor(store.tokens("labels", index).tolist())
        labels[index, :len(row_labels)] = row_labels
    with torch.no_grad():
        logits = model(**batch.inputs).logits.float()
        hand = F.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        mean = model(**batch.inputs, labels=labels).loss  # transformers' own: the mean over labelled tokens
    steps = sum(len(row["labels"]) for row in ROWS)
    assert batch.n_targets == steps == int((labels != IGNORE_INDEX).sum())
    difference = abs(loss.item() - hand.item())
    print(f"loss {loss.item():.8f} hand {hand.item():.8f} difference {difference:.3e}")
    assert difference < 1e-5
    assert abs(loss.item() / steps - mean.item()) < 1e-6
    right = int((logits.argmax(-1)[labels != IGNORE_INDEX] == labels[labels != IGNORE_INDEX]).sum())
    assert stats.tolist() == [right]
    sums = objective.eval_sums(model, batch.inputs, batch.targets, batch.extra).tolist()
    metrics = objective.eval_metrics(sums)
    assert metrics["eval_steps"] == steps and abs(metrics["eval_loss"] - mean.item()) < 1e-6
    assert metrics["eval_step_accuracy"] == right / steps


def test_two_steps_train_as_planned_and_the_folder_reloads_as_a_token_classifier(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "steps.jsonl", ROWS * 2)
    config = write_config(tmp_path / "run.yml", **prm_config(tmp_path, tiny_model_dir, data, max_steps=2,
                                                              save_strategy="no", micro_batch_size=2,
                                                              val_set_size=0.25))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "out"
    plan, summary = (json.loads((out / name).read_text()) for name in ("plan.json", "summary.json"))
    assert plan["objective"] == "token_classification"
    assert summary["steps"] == plan["total_steps"] == 2
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if "eval_step_accuracy" in line]
    assert evals and all(0 <= m["eval_step_accuracy"] <= 1 and m["eval_loss"] > 0 for m in evals)
    model = AutoModelForTokenClassification.from_pretrained(out)
    assert model.config.num_labels == 2 and model.config.architectures[0].endswith("ForTokenClassification")


def test_labels_and_completions_of_different_lengths_are_one_clear_error(tmp_path, tiny_model_dir):
    bad = [*ROWS[:2], {"prompt": "p", "completions": ["a", "b"], "labels": [True]}]
    data = write_jsonl(tmp_path / "bad.jsonl", bad)
    config = write_config(tmp_path / "run.yml", **prm_config(tmp_path, tiny_model_dir, data, max_steps=1))
    assert_user_error(run_in_process("train", str(config)), "bad.jsonl:3", "2 completions (steps) and 1 labels")
