"""Preference training (rl: dpo / ipo / orpo): the losses against a hand computation, pairs kept whole,
the reference model, and the run's equivalences (accumulation, ranks, precomputed references, plan == run)."""

from __future__ import annotations

import copy
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import (CORPUS, assert_user_error, base_config, read_metrics, run_in_process, run_two_ranks,
                      write_config, write_jsonl)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.collate import Collator
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.prepare import prepare
from tuneloop.engines.base import forget_accelerate_state
from tuneloop.train.preference import PairLosses, PreferenceLoss, sequence_log_probs

WORDS = " ".join(CORPUS).split()
ONE_SGD_STEP = {"optimizer": "sgd", "learning_rate": 1.0, "max_grad_norm": 0, "max_steps": 1,
                "lr_scheduler": "constant"}


def pair_rows(count: int, seed: int = 0, easy: bool = False) -> list[dict]:
    """Chat-template preference rows. `easy`: the chosen reply always names colours, the rejected one counts."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 10)))
        if easy:
            chosen, rejected = "red, green and blue.", "one two three four five six seven."
        else:
            chosen, rejected = (" ".join(rng.choices(WORDS, k=rng.randint(2, 14))) for _ in range(2))
        rows.append({"messages": [{"role": "user", "content": prompt}], "chosen": chosen, "rejected": rejected})
    return rows


def preference_config(tmp_path, model_dir, data, **keys) -> dict:
    keys = {"rl": "dpo", "datasets": [{"path": str(data), "type": "chat_template"}], **keys}
    return base_config(tmp_path, model_dir, data, **keys)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pair_rows(32, seed=5))


@pytest.fixture(scope="module")
def prepared_pairs(tmp_path_factory, tiny_model_dir, pairs_file):
    tmp = tmp_path_factory.mktemp("prepared_pairs")
    cfg = config_from_dict(preference_config(tmp, tiny_model_dir, pairs_file))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tokenizer, prepare(cfg, tokenizer)


# ---- the maths, against a hand computation --------------------------------------------------------------
def hand_log_probs(model, store, rows) -> list[torch.Tensor]:
    """Each sequence alone through the model: the summed log-probability of its trained tokens (with gradients)."""
    values = []
    for row in rows:
        ids = torch.from_numpy(store.tokens("input_ids", row).astype(np.int64))
        labels = torch.from_numpy(store.tokens("labels", row).astype(np.int64))
        log_probs = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
        trained = (labels[1:] != IGNORE_INDEX).nonzero().squeeze(1)
        values.append(log_probs[trained, labels[1:][trained]].sum())
    return values


def hand_targets(store, rows) -> list[int]:
    return [int((store.tokens("labels", row)[1:] != IGNORE_INDEX).sum()) for row in rows]


def hand_loss(policy, reference, counts, settings: dict):
    """The per-pair losses written from the papers' formulas, one pair at a time (chosen first in each pair)."""
    total = 0
    for j in range(len(policy) // 2):
        pc, pr, rc, rr = policy[2 * j], policy[2 * j + 1], reference[2 * j], reference[2 * j + 1]
        nc, nr = counts[2 * j], counts[2 * j + 1]
        if settings["rl"] == "simpo":
            ac, ar = pc / nc, pr / nr
            total = total + (-torch.log(torch.sigmoid(settings["beta"] * (ac - ar) - settings["gamma"]))
                             - settings["alpha"] * ac)
            continue
        if settings["rl"] == "orpo":
            ac, ar = pc / nc, pr / nr
            log_odds = (ac - ar) - (torch.log(1 - torch.exp(ac)) - torch.log(1 - torch.exp(ar)))
            total = total + (-ac - settings["orpo_alpha"] * torch.log(torch.sigmoid(log_odds)))
            continue
        beta, z = settings["beta"], (pc - rc) - (pr - rr)
        for kind, weight in zip(settings["types"], settings["weights"]):
            if kind == "sigmoid":
                smoothing = settings.get("smoothing", 0.0)
                loss = (-(1 - smoothing) * torch.log(torch.sigmoid(beta * z))
                        - smoothing * torch.log(torch.sigmoid(-beta * z)))
            elif kind == "hinge":
                loss = torch.clamp(1 - beta * z, min=0)
            else:  # ipo, on log-ratios averaged per token
                loss = (((pc - rc) / nc - (pr - rr) / nr) - 1 / (2 * beta)) ** 2
            total = total + weight * loss
    return total


CASES = {
    "dpo sigmoid": ({"rl": "dpo", "rl_beta": 0.5}, {"rl": "dpo", "beta": 0.5, "types": ["sigmoid"], "weights": [1]}),
    "cDPO label smoothing": ({"rl": "dpo", "rl_beta": 0.5, "dpo_label_smoothing": 0.2},
                             {"rl": "dpo", "beta": 0.5, "types": ["sigmoid"], "weights": [1], "smoothing": 0.2}),
    "ipo": ({"rl": "ipo", "rl_beta": 0.3}, {"rl": "ipo", "beta": 0.3, "types": ["ipo"], "weights": [1]}),
    "hinge": ({"rl": "dpo", "rl_beta": 2.0, "dpo_loss_type": "hinge"},
              {"rl": "dpo", "beta": 2.0, "types": ["hinge"], "weights": [1]}),
    "weighted sigmoid + ipo": ({"rl": "dpo", "dpo_loss_type": ["sigmoid", "ipo"], "dpo_loss_weights": [1.0, 0.5]},
                               {"rl": "dpo", "beta": 0.1, "types": ["sigmoid", "ipo"], "weights": [1.0, 0.5]}),
    "orpo": ({"rl": "orpo", "orpo_alpha": 0.2}, {"rl": "orpo", "orpo_alpha": 0.2}),
    "simpo (TRL's defaults: cpo_alpha 1)": ({"rl": "simpo", "rl_beta": 2.0},
                                            {"rl": "simpo", "beta": 2.0, "gamma": 0.5, "alpha": 1.0}),
    "simpo alone": ({"rl": "simpo", "rl_beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0},
                    {"rl": "simpo", "beta": 2.0, "gamma": 1.0, "alpha": 0.0}),
}


@pytest.mark.parametrize("packed", [False, True, "two rows"], ids=["padded", "packed", "packed in two rows"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_and_its_gradient_equal_a_hand_computation(tmp_path, tiny_model_dir, pairs_file, prepared_pairs,
                                                            case, packed):
    keys, settings = CASES[case]
    tokenizer, prepared = prepared_pairs
    store = prepared.train
    torch.manual_seed(0)
    policy_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy_model.config.use_cache = False  # as model/load.py loads it: packed rows need it (STACK-NOTES trap 1)
    reference_model = copy.deepcopy(policy_model)  # moved away from the policy, so the log-ratios are not zero
    with torch.no_grad():
        for parameter in reference_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    units = [0, 1, 2]
    rows = [row for unit in units for row in store.unit_rows(unit)]

    hand_policy = hand_log_probs(policy_model, store, rows)
    with torch.no_grad():
        hand_reference = hand_log_probs(reference_model, store, rows)
    expected = hand_loss(hand_policy, hand_reference, hand_targets(store, rows), settings)
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in policy_model.named_parameters()}
    policy_model.zero_grad()

    cfg = config_from_dict(preference_config(tmp_path, tiny_model_dir, pairs_file, **keys))
    loss_function = PreferenceLoss(PairLosses.from_config(cfg), reference_model)
    collate = Collator(store, tokenizer.pad_token_id, packed=bool(packed))
    micro_rows = {False: [[unit] for unit in units], True: [units], "two rows": [units[:2], units[2:]]}[packed]
    batch = collate(micro_rows)
    assert batch.extra["n_sequences"] == 6
    assert len(batch.inputs["input_ids"]) == len(micro_rows) * (1 if packed else 2)
    loss, stats = loss_function(policy_model, batch.inputs, batch.targets, batch.extra)
    loss.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    for name, parameter in policy_model.named_parameters():
        # (torch's fp32 atol: the batched and the hand computation sum in different orders, and an AVX2 CPU's
        # kernels put a few of 25,600 gradient values 1.5-4e-6 apart; a masking error moves them by orders more)
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-4, atol=1e-5)
    assert float(stats[2]) == sum(  # reward accuracy: pairs whose chosen reward beats the rejected one
        float(hand_policy[2 * j] - hand_reference[2 * j]) > float(hand_policy[2 * j + 1] - hand_reference[2 * j + 1])
        if settings["rl"] not in ("orpo", "simpo") else
        float(hand_policy[2 * j]) / hand_targets(store, rows)[2 * j]
        > float(hand_policy[2 * j + 1]) / hand_targets(store, rows)[2 * j + 1] for j in range(3))


def test_a_lora_runs_reference_is_its_base_with_the_adapter_off(tmp_path, tiny_model_dir, pairs_file,
                                                                  prepared_pairs):
    from tuneloop.model.load import load_model
    from tuneloop.resolved import resolve_run
    from tuneloop.train.reference import live_reference_model

    tokenizer, prepared = prepared_pairs
    cfg = config_from_dict(preference_config(tmp_path, tiny_model_dir, pairs_file, adapter="lora",
                                             lora_target_linear=True, lora_r=4))
    model = load_model(cfg, resolve_run(cfg), tokenizer)
    with torch.no_grad():  # a trained adapter: its B matrices are no longer zero
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.1)
    assert live_reference_model(cfg, model, None, resumed=False, device="cpu") is None  # no second copy
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = Collator(prepared.train, tokenizer.pad_token_id, packed=False)([[0], [1]])
    loss_function = PreferenceLoss(PairLosses.from_config(cfg))
    reference = loss_function.reference_log_probs(model, batch.inputs, batch.targets, batch.extra)
    with torch.no_grad():
        base_values = sequence_log_probs(base, batch.inputs, batch.targets, batch.extra["sequence_index"], 4)[0]
        adapted = sequence_log_probs(model, batch.inputs, batch.targets, batch.extra["sequence_index"], 4)[0]
    torch.testing.assert_close(reference, base_values, rtol=1e-5, atol=1e-5)
    assert float((adapted - base_values).abs().max()) > 1e-3  # the adapter does change them: the test can fail


# ---- whole runs -------------------------------------------------------------------------------------------
def one_step_update(tmp_path, model_dir, data, name, launcher: str | None = None, **keys) -> dict:
    run_dir = tmp_path / name
    run_dir.mkdir()
    config = write_config(run_dir / "run.yml", **preference_config(run_dir, model_dir, data, **ONE_SGD_STEP,
                                                                   rl_beta=0.5, **keys))
    result = run_two_ranks("train", str(config), kind=launcher) if launcher else run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    after = load_file(run_dir / "out" / "model.safetensors")
    before = load_file(model_dir / "model.safetensors")
    return {key: after[key] - before[key] for key in before}


def relative_difference(a: dict, b: dict) -> float:
    return (sum(float((a[k] - b[k]).pow(2).sum()) for k in a) / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


@pytest.fixture(scope="module")
def accumulated_dpo_update(tmp_path_factory, tiny_model_dir, pairs_file):
    return one_step_update(tmp_path_factory.mktemp("dpo_accum"), tiny_model_dir, pairs_file, "accum",
                           micro_batch_size=2, gradient_accumulation_steps=4)


def test_dpo_accumulating_4_micro_batches_of_2_pairs_equals_one_batch_of_8(tmp_path, tiny_model_dir, pairs_file,
                                                                          accumulated_dpo_update):
    one_batch = one_step_update(tmp_path, tiny_model_dir, pairs_file, "batch", micro_batch_size=8,
                                gradient_accumulation_steps=1)
    assert sum(float(v.abs().sum()) for v in one_batch.values()) > 0
    assert relative_difference(accumulated_dpo_update, one_batch) < 1e-5


def test_packed_pairs_train_as_padded_ones(tmp_path, tiny_model_dir, pairs_file):
    """Packing (each pair's two sequences in one row, isolated by their positions) changes nothing but speed: a
    step over all 32 pairs, padded or packed, gives the same update."""
    padded = one_step_update(tmp_path, tiny_model_dir, pairs_file, "padded", micro_batch_size=32)
    packed = one_step_update(tmp_path, tiny_model_dir, pairs_file, "packed", micro_batch_size=8,
                             sample_packing=True, sequence_len=512)
    for name, batching in (("padded", "random"), ("packed", "packed")):
        plan = json.loads((tmp_path / name / "out" / "plan.json").read_text())
        assert (plan["batching"], plan["steps_per_epoch"], plan["rows_cut_per_epoch"]) == (batching, 1, 0)
    assert relative_difference(packed, padded) < 1e-4


def test_reward_accuracy_rises_on_easy_pairs_and_the_plan_is_what_runs(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "easy.jsonl", pair_rows(48, seed=2, easy=True))
    config = write_config(tmp_path / "run.yml", **preference_config(
        tmp_path, tiny_model_dir, data, rl_beta=0.5, learning_rate=3e-3, micro_batch_size=4,
        gradient_accumulation_steps=2, num_epochs=3, val_set_size=8, evals_per_epoch=1, eval_on_start=True,
        lr_scheduler="constant", optimizer="adamw_torch"))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == plan["total_steps"] == 3 * 5  # 40 train pairs / 8 per step, 3 epochs
    assert summary["tokens"] == plan["total_trainable_tokens"]
    evals = [m for m in read_metrics(tmp_path / "out") if "eval_reward_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 5, 10, 15] and evals[0]["eval_pairs"] == 8
    assert evals[0]["eval_reward_accuracy"] == 0.0  # policy == reference: no pair is ranked yet
    assert evals[-1]["eval_reward_accuracy"] == 1.0 and evals[-1]["eval_reward_margin"] > 1.0
    assert evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"]
    train = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert train[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # -log σ(0) at the first step
    assert "eval reward accuracy first → last | 0.0000 → 1.0000" in (tmp_path / "out" / "report.md").read_text()
    # `tuneloop eval` measures the trained model against the base as the run did
    measured = run_in_process("eval", str(config))
    assert measured.returncode == 0, measured.stderr[-3000:]
    result = json.loads(measured.stdout.strip().splitlines()[-1])
    assert result["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    assert result["eval_reward_accuracy"] == evals[-1]["eval_reward_accuracy"]


def test_precomputed_reference_log_probs_give_the_live_references_first_steps(tmp_path, tiny_model_dir, pairs_file):
    """Two steps (the second one's policy differs from the reference): the same losses and weights whether the
    reference log-probs were precomputed and cached or computed live, and a second run reads the cache."""
    runs = {}
    for name, precompute in (("live", False), ("precomputed", True), ("cached", True)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        keys = preference_config(run_dir, tiny_model_dir, pairs_file, rl_beta=0.5, max_steps=2, micro_batch_size=4,
                                 precompute_ref_log_probs=precompute, learning_rate=1e-2, val_set_size=6,
                                 evals_per_epoch=1, eval_on_start=True,
                                 dataset_prepared_path=str(tmp_path / "prepared"))
        result = run_in_process("train", str(write_config(run_dir / "run.yml", **keys)))
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = read_metrics(run_dir / "out")
        runs[name] = ([m["loss"] for m in metrics if "loss" in m], load_file(run_dir / "out" / "model.safetensors"),
                      [(m["eval_loss"], m["eval_reward_margin"]) for m in metrics if "eval_loss" in m])
    caches = list((tmp_path / "prepared").glob("*/reference-*/*.f32"))
    assert sorted(path.name for path in caches) == ["eval.f32", "train.f32"]  # written once, read by the third run
    assert len(runs["live"][2]) == 2 and runs["live"][2][1][1] != 0  # evals at steps 0 and 2; the margin moved
    for name in ("precomputed", "cached"):
        assert runs[name][0] == pytest.approx(runs["live"][0], rel=1e-5)
        for (loss, margin), (live_loss, live_margin) in zip(runs[name][2], runs["live"][2]):
            assert (loss, margin) == (pytest.approx(live_loss, rel=1e-5), pytest.approx(live_margin, abs=1e-5))
        assert runs["live"][0][1] != pytest.approx(math.log(2), rel=1e-3)  # step 2 compares a moved policy
        for key, value in runs["live"][1].items():
            torch.testing.assert_close(runs[name][1][key], value, rtol=1e-5, atol=1e-6)
    plan = json.loads((tmp_path / "cached" / "out" / "plan.json").read_text())
    assert plan["reference"].startswith("log-probs computed once") and plan["memory"]["reference_gb"] == 0


# ---- data ---------------------------------------------------------------------------------------------------
def prepared_texts(tmp_path, model_dir, rows, **keys) -> tuple[list[tuple[str, str]], object]:
    """Each kept pair as (chosen text, rejected text) with only the trained tokens decoded, and the stats."""
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    keys.setdefault("datasets", [{"path": str(data), "type": "chat_template"}])
    cfg = config_from_dict(preference_config(tmp_path, model_dir, data, **keys))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prepared = prepare(cfg, tokenizer)
    store = prepared.train

    def trained(row):
        labels = store.tokens("labels", row)
        return tokenizer.decode([int(t) for t in labels if t != IGNORE_INDEX])

    def whole(row):
        return tokenizer.decode([int(t) for t in store.tokens("input_ids", row)])

    return [(whole(2 * u), trained(2 * u), whole(2 * u + 1), trained(2 * u + 1)) for u in range(store.units)], \
        prepared.stats


def test_axolotls_chat_template_default_with_its_field_names_trains_only_the_replies(tmp_path, tiny_model_dir):
    rows = [{"conversation": [{"from": "human", "value": "Name three colours"}],
             "better": "red, green and blue", "worse": "one two three"}]
    entry = {"path": str(tmp_path / "rows.jsonl"), "type": "chat_template.default", "field_messages": "conversation",
             "field_chosen": "better", "field_rejected": "worse",
             "message_property_mappings": {"role": "from", "content": "value"}, "roles": {"user": ["human"]}}
    [(chosen, chosen_trained, rejected, rejected_trained)], stats = prepared_texts(tmp_path, tiny_model_dir, rows,
                                                                                  datasets=[entry])
    prompt = "<|im_start|>user\nName three colours<|im_end|>\n<|im_start|>assistant\n"
    assert chosen == prompt + "red, green and blue<|im_end|>" and rejected == prompt + "one two three<|im_end|>"
    assert chosen_trained == "red, green and blue<|im_end|>" and rejected_trained == "one two three<|im_end|>"


def test_argilla_chatml_ultra_and_user_defined_pairs(tmp_path, tiny_model_dir):
    argilla = [{"chosen": [{"role": "user", "content": "Add two numbers"}, {"role": "assistant", "content": "four"}],
                "rejected": [{"role": "user", "content": "Add two numbers"}, {"role": "assistant", "content": "red"}]}]
    (tmp_path / "a").mkdir()
    [(chosen, trained, _, rejected_trained)], _ = prepared_texts(
        tmp_path / "a", tiny_model_dir, argilla, rl="orpo",
        datasets=[{"path": str(tmp_path / "a" / "rows.jsonl"), "type": "chat_template.argilla"}])
    assert chosen.startswith("<|im_start|>user\nAdd two numbers<|im_end|>\n<|im_start|>assistant\nfour")
    assert (trained, rejected_trained) == ("four<|im_end|>", "red<|im_end|>")

    (tmp_path / "u").mkdir()
    ultra = [{"prompt": "Count", "system": "Be brief", "chosen": [{"content": "Count"}, {"content": "one two"}],
              "rejected": [{"content": "Count"}, {"content": "blue"}]}]
    [(chosen, trained, _, _)], _ = prepared_texts(tmp_path / "u", tiny_model_dir, ultra, datasets=[
        {"path": str(tmp_path / "u" / "rows.jsonl"), "type": "chatml.ultra"}])
    assert chosen == ("<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nCount<|im_end|>\n"
                      "<|im_start|>assistant\none two<|im_end|>")
    assert trained == "one two<|im_end|>"

    (tmp_path / "d").mkdir()
    defined = [{"q": "Name a colour", "good": "red", "bad": "seven"}]
    mapping = {"field_prompt": "q", "field_chosen": "good", "field_rejected": "bad", "prompt_format": "Q: {prompt}\nA:",
               "chosen_format": " {chosen}", "rejected_format": " {rejected}"}
    [(chosen, trained, rejected, rejected_trained)], _ = prepared_texts(
        tmp_path / "d", tiny_model_dir, defined, datasets=[{"path": str(tmp_path / "d" / "rows.jsonl"),
                                                            "type": mapping}])
    assert chosen == "Q: Name a colour\nA: red<|endoftext|>" and trained == " red<|endoftext|>"
    assert rejected_trained == " seven<|endoftext|>"


def test_pairs_that_cannot_pack_whole_are_dropped_when_only_the_eval_set_packs(tmp_path, tiny_model_dir):
    """Each sequence fits sequence_len, some pairs do not together: with packed eval rows (and padded training)
    they are dropped, and counted, rather than packed past sequence_len."""
    rows = pair_rows(40, seed=9)
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    padded = prepare(config_from_dict(preference_config(tmp_path, tiny_model_dir, data, sequence_len=100,
                                                        val_set_size=10)), tokenizer)
    assert padded.stats.dropped_too_long == 0  # every sequence fits 100 tokens...
    assert int(np.asarray(padded.train.unit_column("length")).max()) > 100  # ...not every pair
    cfg = config_from_dict(preference_config(tmp_path, tiny_model_dir, data, sequence_len=100, val_set_size=10,
                                             eval_sample_packing=True))
    prepared = prepare(cfg, tokenizer)
    assert prepared.stats.dropped_too_long > 0
    for store in (prepared.train, prepared.eval):
        assert int(np.asarray(store.unit_column("length")).max()) <= 100


def test_identical_pairs_are_dropped_and_counted_in_the_plan(tmp_path, tiny_model_dir):
    rows = pair_rows(12, seed=1)
    rows[3]["rejected"] = rows[3]["chosen"]
    rows[7]["rejected"] = rows[7]["chosen"]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = write_config(tmp_path / "run.yml", **preference_config(tmp_path, tiny_model_dir, data))
    result = run_in_process("plan", str(config))
    assert result.returncode == 0, result.stderr
    assert "10 train pairs" in result.stdout
    assert "2 pairs whose chosen and rejected replies are the same" in result.stdout
    shown = run_in_process("preprocess", str(config), "--show", "1")
    assert shown.returncode == 0 and "prepared 10 train and 0 eval pairs" in shown.stdout
    assert "2 identical pairs dropped" in shown.stdout
    assert "--- row 0, chosen (" in shown.stdout and "--- row 0, rejected (" in shown.stdout


def test_bad_preference_rows_and_keys_are_clear_errors(tmp_path, tiny_model_dir):
    rows = pair_rows(4)
    del rows[2]["rejected"]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = write_config(tmp_path / "run.yml", **preference_config(tmp_path, tiny_model_dir, data))
    assert_user_error(run_in_process("plan", str(config)), "rows.jsonl:3", "missing field `rejected`")

    for keys, message in ((dict(rl="kto_pair"), "its successor is `rl: kto`"),
                          (dict(rl="orpo", rl_beta=0.2), "this run is `rl: orpo`, which does not read it"),
                          (dict(rl="dpo", simpo_gamma=0.5), "`simpo_gamma` shapes SimPO's loss"),
                          (dict(rl="dpo", dpo_loss_type=["sigmoid", "ipo"], dpo_loss_weights=[1.0]),
                           "2 losses in `dpo_loss_type`"),
                          (dict(rl=None, datasets=[{"path": str(data), "type": "chat_template.argilla"}]),
                           "is preference data (chosen/rejected pairs, or labelled rows): set `rl:` to one of"),
                          (dict(train_on_inputs=True), "the prompt is never part of it")):
        keys = {**preference_config(tmp_path, tiny_model_dir, data), **keys}
        assert_user_error(run_in_process("plan", str(write_config(tmp_path / "bad.yml", **keys))), message)
    sft = base_config(tmp_path, tiny_model_dir, data, rl="dpo")  # an alpaca dataset under rl
    assert_user_error(run_in_process("plan", str(write_config(tmp_path / "bad.yml", **sft))),
                      "`rl: dpo` trains on preference pairs, and dataset 0 is `type: alpaca`")


# ---- KTO: unpaired rows with a label ------------------------------------------------------------------------
def kto_rows(count: int, seed: int = 0, easy: bool = False) -> list[dict]:
    """`easy`: desirable replies name colours, undesirable ones count."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        desirable = index % 3 != 0
        if easy:
            completion = "red, green and blue." if desirable else "one two three four five six seven."
        else:
            completion = " ".join(rng.choices(WORDS, k=rng.randint(2, 14)))
        rows.append({"prompt": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 10)))}],
                     "completion": completion, "label": desirable})
    return rows


def kto_config(tmp_path, model_dir, data, **keys) -> dict:
    return preference_config(tmp_path, model_dir, data, **{"rl": "kto", **keys})


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_kto_loss_and_its_gradient_equal_a_hand_computation(tmp_path, tiny_model_dir, packed):
    data = write_jsonl(tmp_path / "kto.jsonl", kto_rows(8, seed=4))
    cfg = config_from_dict(kto_config(tmp_path, tiny_model_dir, data, rl_beta=0.7, kto_desirable_weight=1.5,
                                      kto_undesirable_weight=0.5))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = prepare(cfg, tokenizer).train
    torch.manual_seed(1)
    policy_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy_model.config.use_cache = False
    reference_model = copy.deepcopy(policy_model)
    with torch.no_grad():
        for parameter in reference_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    units = [0, 1, 2, 3]  # rows 0 and 3 are undesirable
    rows = [row for unit in units for row in store.unit_rows(unit)]
    labels = [bool(store["label"][2 * unit]) for unit in units]
    assert labels == [False, True, True, False]

    policy = hand_log_probs(policy_model, store, rows)
    with torch.no_grad():
        reference = hand_log_probs(reference_model, store, rows)
    kl = max(0.0, sum(float(policy[2 * j + 1] - reference[2 * j + 1]) for j in range(4)) / 4)
    expected = 0
    for j, desirable in enumerate(labels):
        ratio = policy[2 * j] - reference[2 * j]
        expected = expected + (1.5 * (1 - torch.sigmoid(0.7 * (ratio - kl))) if desirable
                               else 0.5 * (1 - torch.sigmoid(0.7 * (kl - ratio))))
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in policy_model.named_parameters()}
    policy_model.zero_grad()

    loss_function = PreferenceLoss(PairLosses.from_config(cfg), reference_model)
    batch = Collator(store, tokenizer.pad_token_id, packed=packed)([units] if packed else [[u] for u in units])
    loss, stats = loss_function(policy_model, batch.inputs, batch.targets, batch.extra)
    loss.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(stats[4]) == pytest.approx(kl, rel=1e-4, abs=1e-7)
    for name, parameter in policy_model.named_parameters():
        # (torch's fp32 atol: the batched and the hand computation sum in different orders, and an AVX2 CPU's
        # kernels put a few of 25,600 gradient values 1.5-4e-6 apart; a masking error moves them by orders more)
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-4, atol=1e-5)


def test_kto_rows_pair_each_reply_with_a_mismatched_one(tmp_path, tiny_model_dir):
    rows = [{"prompt": "Name a colour", "completion": "red", "label": True},
            {"prompt": "Count", "completion": "one two", "label": False},
            {"prompt": "Greet", "system": "Be brief", "completion": "Hello", "label": 1}]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = config_from_dict(kto_config(tmp_path, tiny_model_dir, data,
                                      datasets=[{"path": str(data), "type": "chatml.prompt_pairs"}]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = prepare(cfg, tokenizer).train
    texts = [tokenizer.decode([int(t) for t in store.tokens("input_ids", row)]) for row in range(len(store))]
    prompt = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n"
    assert texts[2:4] == [prompt + "one two<|im_end|>", prompt + "Hello<|im_end|>"]  # its reply, the next row's
    assert texts[5].endswith("<|im_start|>assistant\nred<|im_end|>") and texts[4].startswith("<|im_start|>system")
    assert [int(store["label"][2 * unit]) for unit in range(3)] == [1, 0, 1]

    bad = write_jsonl(tmp_path / "bad.jsonl", [{**rows[0], "label": "yes"}])
    config = write_config(tmp_path / "bad.yml", **kto_config(tmp_path, tiny_model_dir, bad, datasets=[
        {"path": str(bad), "type": {"field_prompt": "prompt", "field_completion": "completion"}}]))
    assert_user_error(run_in_process("plan", str(config)), "bad.jsonl:1", "`label` must be true or false")
    dpo_mapping = kto_config(tmp_path, tiny_model_dir, bad, datasets=[{"path": str(bad), "type": {
        "field_prompt": "prompt", "field_chosen": "completion"}}])
    assert_user_error(run_in_process("plan", str(write_config(tmp_path / "bad.yml", **dpo_mapping))),
                      "`type.field_chosen` is not read by `rl: kto`")


def test_kto_separates_desirable_from_undesirable_rewards_and_the_plan_is_what_runs(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "easy.jsonl", kto_rows(48, seed=3, easy=True))
    config = write_config(tmp_path / "run.yml", **kto_config(
        tmp_path, tiny_model_dir, data, rl_beta=0.5, learning_rate=3e-3, micro_batch_size=4,
        gradient_accumulation_steps=2, num_epochs=3, val_set_size=8, evals_per_epoch=1, eval_on_start=True,
        lr_scheduler="constant", optimizer="adamw_torch", sample_packing=True))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loss averaged over the rows of each step" in result.stdout
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == plan["total_steps"] and plan["unit"] == "rows" and plan["batching"] == "packed"
    evals = [m for m in read_metrics(tmp_path / "out") if "eval_rows" in m]
    assert evals[0]["eval_rows"] == 8 and evals[0]["eval_reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert evals[-1]["eval_reward_margin"] > 1.0 and evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_the_dpo_loss_equals_trls_on_the_same_tokens(tmp_path, tiny_model_dir, loss_type):
    """TRL's DPOTrainer (installed by the test extra; not built upon) computes its loss on a batch it tokenized;
    tuneloop's loss on the same token ids, with the same policy, reference and beta, is the same number."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy.config.use_cache = False
    reference = copy.deepcopy(policy)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    rows = [{"prompt": "Name three colours:", "chosen": " red, green and blue.", "rejected": " one two"},
            {"prompt": "Count:", "chosen": " one two three four five", "rejected": " blue"},
            {"prompt": "How are you today?", "chosen": " I am fine, thank you.", "rejected": " The lazy dog."}]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.5, per_device_train_batch_size=3, report_to=[],
                     use_cpu=True, bf16=False, loss_type=[loss_type])
    try:
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
        batch = next(iter(trainer.get_train_dataloader()))
        trl_loss = float(trainer.compute_loss(trainer.model, batch))
    finally:  # the Trainer's Accelerator state would refuse the next run's precision in this process
        forget_accelerate_state()

    # TRL's rows are [chosen..., rejected...], right-padded; tuneloop's are chosen, rejected, chosen, ...
    pairs = len(rows)
    order = [index for j in range(pairs) for index in (j, pairs + j)]
    ids, attention, completion = (batch[name][order] for name in ("input_ids", "attention_mask", "completion_mask"))
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(completion[:, 1:] == 1, ids[:, 1:], IGNORE_INDEX)
    sequence_index = torch.arange(2 * pairs).unsqueeze(1).expand_as(ids).masked_fill(attention == 0, -1)
    cfg = config_from_dict(preference_config(tmp_path, tiny_model_dir, tmp_path / "unused.jsonl", rl_beta=0.5,
                                             dpo_loss_type=loss_type))
    ours, _ = PreferenceLoss(PairLosses.from_config(cfg), reference)(
        policy, {"input_ids": ids, "attention_mask": attention}, targets,
        {"sequence_index": sequence_index, "n_sequences": 2 * pairs})
    assert 0.01 < trl_loss and float(ours) / pairs == pytest.approx(trl_loss, rel=1e-5)


def test_a_stopped_dpo_run_resumes_to_the_uninterrupted_weights(tmp_path, tiny_model_dir, pairs_file, monkeypatch):
    """Full fine-tuning with a live reference: the resumed run's reference is the base model again (not the
    checkpoint it resumes from), so its steps after the resume are the uninterrupted run's."""
    from tuneloop.train.guards import SIGNAL_AT_STEP_ENV

    def run(name: str, **extra) -> subprocess.CompletedProcess:
        run_dir = tmp_path / name
        run_dir.mkdir(exist_ok=True)
        keys = preference_config(run_dir, tiny_model_dir, pairs_file, rl_beta=0.5, max_steps=4, micro_batch_size=4,
                                 learning_rate=1e-2, optimizer="adamw_torch", lr_scheduler="constant",
                                 auto_resume_from_checkpoints=True, save_strategy=None, save_steps=100,
                                 dataset_prepared_path=str(tmp_path / "prepared"), **extra)
        return run_in_process("train", str(write_config(run_dir / "run.yml", **keys)))

    assert run("straight").returncode == 0
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, "0:2")
    stopped = run("stopped")
    assert stopped.returncode == 75 and (tmp_path / "stopped" / "out" / "checkpoint-2").is_dir(), stopped.stdout
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    resumed = run("stopped")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = load_file(tmp_path / "straight" / "out" / "model.safetensors")
    after = load_file(tmp_path / "stopped" / "out" / "model.safetensors")
    for key, value in straight.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    losses = [m["loss"] for m in read_metrics(tmp_path / "stopped" / "out") if "loss" in m]
    assert losses == [m["loss"] for m in read_metrics(tmp_path / "straight" / "out") if "loss" in m]


def test_check_describes_a_preference_config_without_importing_torch(tmp_path, pairs_file):
    config = write_config(tmp_path / "run.yml", base_model="m", rl="kto", rl_beta=0.2, adapter="lora",
                          lora_target_linear=True, datasets=[{"path": str(pairs_file), "type": "llama3.ultra"}])
    result = subprocess.run([sys.executable, "-c", "import sys; from tuneloop.cli import main; code = main(['check', "
                             "sys.argv[1]]); assert 'torch' not in sys.modules; sys.exit(code)", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "rows/micro-batch" in result.stdout
    assert "rl: kto, loss averaged over rows; reference: the base model: the LoRA adapter switched off" in result.stdout
