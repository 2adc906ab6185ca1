"""Encoder-decoder (T5) runs: the forum's job, proved by equivalence and by reloading what the run leaves.

- token-weighted accumulation (4 micro-batches of 2 == one batch of 8) and two DDP ranks == one process, for a
  T5 whose rows are padded on both sides;
- the masks: decoder padding never reaches the loss, and encoder padding changes no logit;
- from scratch: the override sizes are the model's, the trained tokenizer and the model reload with
  AutoTokenizer / AutoModelForSeq2SeqLM and generate, the eval loss falls, and the plan is what ran.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import assert_user_error, base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from test_equivalence import one_step_update, relative_difference

from tuneloop.config import config_from_dict
from tuneloop.data.collate import collator_for
from tuneloop.data.prepare import prepare
from tuneloop.train.objectives import summed_token_loss

TINY_T5 = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 2, "d_kv": 16,
           "dropout_rate": 0.0}


def save_tiny_t5(target, tokenizer_dir):
    """A T5 of TINY_T5's sizes with random weights (seed 0) and the tiny tokenizer, saved in `target`."""
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id, **TINY_T5)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def tiny_t5_dir(tmp_path_factory, tiny_tokenizer_dir):
    return save_tiny_t5(tmp_path_factory.mktemp("tiny_t5"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """source → target rows of very different lengths (the forum's shape: a text and what it should become)."""
    rows = [{"source": row["instruction"], "target": row["output"]} for row in tiny_rows(96, seed=5)]
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", rows)


def seq2seq_keys(data, **keys) -> dict:
    return {"datasets": [{"path": str(data), "type": "seq2seq"}], "sequence_len": 64, **keys}


@pytest.fixture(scope="module")
def accumulated_t5_update(tmp_path_factory, tiny_t5_dir, pairs):
    return one_step_update(tmp_path_factory.mktemp("t5accum"), tiny_t5_dir, pairs, "accum",
                           **seq2seq_keys(pairs, micro_batch_size=2, gradient_accumulation_steps=4))


def test_seq2seq_accumulating_4_micro_batches_of_2_equals_one_batch_of_8(tmp_path, tiny_t5_dir, pairs,
                                                                        accumulated_t5_update):
    one_batch = one_step_update(tmp_path, tiny_t5_dir, pairs, "batch",
                                **seq2seq_keys(pairs, micro_batch_size=8, gradient_accumulation_steps=1))
    assert relative_difference(accumulated_t5_update, one_batch) < 1e-5
    assert max(float(change.abs().max()) for change in one_batch.values()) > 0  # the step did train
    plan = json.loads((tmp_path / "batch" / "out" / "plan.json").read_text())
    assert plan["encoder_tokens"] > 0 and plan["decoder_tokens"] == plan["total_trainable_tokens"]


def test_seq2seq_masks_decoder_padding_out_of_the_loss_and_encoder_padding_out_of_attention(tmp_path, tiny_t5_dir,
                                                                                           pairs):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    cfg = config_from_dict(base_config(tmp_path, tiny_t5_dir, pairs, **seq2seq_keys(pairs)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    store = prepare(cfg, tokenizer, encoder_decoder=True).train
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir).eval()
    collate = collator_for(store, tokenizer.pad_token_id, packed=False, decoder_start_token_id=tokenizer.pad_token_id)
    sources = np.asarray(store["source_length"])
    targets = np.asarray(store["length"]) - sources
    short = int(np.argmin(sources + targets))
    long = int(np.argmax(sources))
    assert sources[long] > sources[short] and targets[long] > targets[short]

    alone, padded = collate([[short]]), collate([[short], [long]])
    # the short row is padded on both sides in the pair's batch
    width = int(targets[short])
    assert padded.inputs["input_ids"].shape[1] == sources[long] and padded.targets.shape[1] >= targets[long]
    # decoder padding: no target, and the count the loss is divided by is the real targets'
    assert (padded.targets[0, width:] == -100).all() and (padded.targets[0, :width] != -100).all()
    assert padded.n_targets == int(targets[short] + targets[long]) == int(store["n_targets"][[short, long]].sum())
    # the decoder reads the targets shifted right behind the start token
    assert padded.inputs["decoder_input_ids"][0, 0] == tokenizer.pad_token_id
    assert torch.equal(padded.inputs["decoder_input_ids"][0, 1:width], padded.targets[0, :width - 1])

    with torch.no_grad():
        logits_alone = model(**alone.inputs).logits[0, :width]
        logits_padded = model(**padded.inputs).logits[0, :width]
        unmasked = dict(padded.inputs, attention_mask=torch.ones_like(padded.inputs["attention_mask"]))
        logits_unmasked = model(**unmasked).logits[0, :width]
        loss_alone = summed_token_loss(model(**alone.inputs).logits, alone.targets)
        loss_long = summed_token_loss(model(**collate([[long]]).inputs).logits, collate([[long]]).targets)
        loss_pair = summed_token_loss(model(**padded.inputs).logits, padded.targets)
    assert torch.allclose(logits_alone, logits_padded, atol=1e-5)
    assert not torch.allclose(logits_alone, logits_unmasked, atol=1e-3)  # the mask is what keeps them equal
    assert torch.allclose(loss_pair, loss_alone + loss_long, rtol=1e-5)


def test_t5_from_scratch_with_its_own_tokenizer_trains_reloads_and_generates(tmp_path, pairs):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    keys = base_config(tmp_path, tmp_path, pairs, **seq2seq_keys(pairs), micro_batch_size=8, num_epochs=6,
                       learning_rate=1e-2, optimizer="adamw_torch", val_set_size=0.15, eval_on_start=True,
                       evals_per_epoch=1, logging_steps=5)
    del keys["base_model"]
    keys.update(base_model_config="t5", overrides_of_model_config=dict(TINY_T5),
                train_tokenizer={"type": "unigram", "vocab_size": 200})
    config = write_config(tmp_path / "run.yml", **keys)

    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "T5, " in planned.stdout and "random weights (from scratch)" in planned.stdout
    assert "encoder-decoder      encoder" in planned.stdout
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "out"

    # the plan is what ran: every step, every target token
    plan = json.loads((out / "plan.json").read_text())
    metrics = read_metrics(out)
    train_lines = [line for line in metrics if "loss" in line]
    assert train_lines[-1]["step"] == plan["total_steps"] == json.loads((out / "summary.json").read_text())["steps"]
    assert train_lines[-1]["tokens"] == plan["total_trainable_tokens"] == plan["decoder_tokens"]
    evals = [line["eval_loss"] for line in metrics if "eval_loss" in line]
    assert evals[-1] < evals[0] - 0.5, evals  # from random weights, the loss falls

    # the folder is a standard one: AutoTokenizer and AutoModelForSeq2SeqLM alone read it
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert len(tokenizer) <= 200 and model.config.vocab_size == len(tokenizer)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert (model.config.d_model, model.config.num_layers, model.config.num_heads) == (32, 2, 2)
    assert model.config.decoder_start_token_id == tokenizer.pad_token_id == 0
    encoded = tokenizer("deep learning", return_tensors="pt")
    assert encoded["input_ids"][0, -1] == tokenizer.eos_token_id  # T5's way: the encoder's input ends with eos
    generated = model.generate(**encoded, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > 1 and generated[0, 0] == model.config.decoder_start_token_id
    (tmp_path / "prompts.txt").write_text("deep learning\n")
    inferred = run_in_process("infer", str(config), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "6")
    assert inferred.returncode == 0 and json.loads(inferred.stdout.splitlines()[-1])["completion"], inferred.stderr

    # the tokenizer is trained once: a second plan reuses it (one cached tokenizer folder)
    assert run_in_process("plan", str(config)).returncode == 0
    assert len(list((tmp_path / "prepared").glob("tokenizer-*"))) == 1


def test_seq2seq_refusals_name_the_key(tmp_path, tiny_t5_dir, tiny_model_dir, pairs):
    def refused(*fragments, **keys):
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_t5_dir, pairs, **keys))
        assert_user_error(run_in_process("plan", str(config)), *fragments)

    refused("`sample_packing: true`", "encoder-decoder", **seq2seq_keys(pairs, sample_packing=True))
    refused("`type: completion`", "encoder-decoder",
            datasets=[{"path": str(pairs), "type": "completion", "field": "source"}])
    refused("`overrides_of_model_config.d_modle`", **seq2seq_keys(pairs, overrides_of_model_config={"d_modle": 8}))
    refused("`model_type: AutoModelForCausalLM`", **seq2seq_keys(pairs, model_type="AutoModelForCausalLM"))
    refused("`train_tokenizer`", "pretrained", **seq2seq_keys(pairs, train_tokenizer={"vocab_size": 100}))
    refused("`train_on_inputs: true`", **seq2seq_keys(pairs, train_on_inputs=True))
    refused("`pretraining_dataset`", "span corruption", datasets=None, pretraining_dataset=[{"path": str(pairs)}],
            max_steps=2)
    # a config folder that holds weights, without saying whether to use them
    refused("`reinit_weights: true`", **seq2seq_keys(pairs, base_model=None, base_model_config=str(tiny_t5_dir)))


def test_reinit_weights_trains_the_folders_config_from_random_weights(tmp_path, tiny_t5_dir, pairs):
    from safetensors.torch import load_file

    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_t5_dir, pairs, **seq2seq_keys(pairs), reinit_weights=True, max_steps=1, learning_rate=1e-9))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    trained = load_file(tmp_path / "out" / "model.safetensors")
    pretrained = load_file(tiny_t5_dir / "model.safetensors")
    assert trained.keys() == pretrained.keys()
    assert all(trained[name].shape == pretrained[name].shape for name in trained)
    # a step of 1e-9 moves nothing visible: the weights differ because they were drawn afresh
    assert relative_difference({k: v.float() for k, v in pretrained.items()},
                               {k: v.float() for k, v in trained.items()}) > 0.5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
