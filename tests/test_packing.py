"""Packing: a packed row gives every sequence the same per-token losses as running it alone (SDPA and
eager), a row without the per-sequence isolation does not, and the sampler packs tightly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_rows, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneloop.config import config_from_dict
from tuneloop.data.batching import BatchingSpec, epoch_batches, epoch_micro_batches, pack_best_fit_decreasing
from tuneloop.data.collate import Collator, Padding
from tuneloop.data.labels import IGNORE_INDEX
from tuneloop.data.prepare import prepare


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_tokenizer_dir):
    folder = tmp_path_factory.mktemp("packing")
    data = write_jsonl(folder / "train.jsonl", tiny_rows(40, seed=5))
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(data), "type": "alpaca"}],
                            "dataset_prepared_path": str(folder / "prepared"), "sequence_len": 512})
    return prepare(cfg, AutoTokenizer.from_pretrained(tiny_tokenizer_dir))


def per_token_losses(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**batch.inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(batch.targets.shape)


def model_with(attention: str, model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    model.config.use_cache = False  # as tuneloop's loader sets it
    return model.eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_row_gives_each_sequence_its_own_losses(prepared, tiny_model_dir, attention):
    model = model_with(attention, tiny_model_dir)
    sequences = [0, 1, 2, 3]
    packed = Collator(prepared.train, 0, packed=True)([sequences])
    packed_losses = per_token_losses(model, packed)[0]
    alone = Collator(prepared.train, 0, packed=False)
    offset = 0
    for index in sequences:
        length = prepared.train[index]["length"]
        single = alone([[index]])
        expected = per_token_losses(model, single)[0, :length]
        got = packed_losses[offset:offset + length]
        mask = single.targets[0, :length] != IGNORE_INDEX
        assert mask.any()
        assert torch.allclose(got[mask], expected[mask], atol=1e-5), (attention, index)
        offset += length
    # the loss never crosses a boundary: each sequence's last position has no target
    assert int((packed.targets != IGNORE_INDEX).sum()) == sum(prepared.train[i]["n_targets"] for i in sequences)


def test_a_row_without_isolation_leaks_across_sequences(prepared, tiny_model_dir):
    """The same packed row with one running position range (no restart) gives different losses:
    this is what the test above would catch if isolation broke."""
    model = model_with("sdpa", tiny_model_dir)
    batch = Collator(prepared.train, 0, packed=True)([[0, 1, 2, 3]])
    isolated = per_token_losses(model, batch)
    width = batch.inputs["input_ids"].shape[1]
    batch.inputs["position_ids"] = torch.arange(width).unsqueeze(0)
    leaked = per_token_losses(model, batch)
    first = prepared.train[0]["length"]
    assert torch.allclose(isolated[0, :first], leaked[0, :first], atol=1e-5)  # the first sequence sees nothing before
    assert (isolated[0, first:] - leaked[0, first:]).abs().max() > 1e-2


def test_best_fit_decreasing_never_overfills_and_keeps_every_sequence():
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 512, size=2000)
    bins = pack_best_fit_decreasing(np.arange(len(lengths)), lengths, 512)
    assert all(lengths[b].sum() <= 512 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    efficiency = lengths.sum() / (len(bins) * 512)
    assert efficiency > 0.95


def test_packed_epochs_are_deterministic_differ_by_epoch_and_keep_their_row_count():
    lengths = np.random.default_rng(1).integers(5, 200, size=3000)
    spec = BatchingSpec("packed", micro_batch_size=2, sequence_len=256, world_size=2, seed=3)
    assert epoch_batches(lengths, spec, 0) == epoch_batches(lengths, spec, 0)
    assert epoch_batches(lengths, spec, 0) != epoch_batches(lengths, spec, 1)
    # the plan counts epoch 0 and the loop trusts it for every epoch: the row count must not change
    counts = {sum(len(micro) for micro in epoch_batches(lengths, spec, epoch)) for epoch in range(8)}
    assert len(counts) == 1
    per_rank = epoch_micro_batches(lengths, spec, 0)
    assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1])
    assert all(1 <= len(micro) <= 2 for batches in per_rank for micro in batches)


def test_group_by_length_puts_similar_lengths_in_each_micro_batch():
    lengths = np.random.default_rng(2).integers(10, 500, size=1003)  # windows do not divide evenly
    grouped = BatchingSpec("group_by_length", micro_batch_size=4, sequence_len=512, world_size=1, seed=0)
    random = BatchingSpec("random", micro_batch_size=4, sequence_len=512, world_size=1, seed=0)

    def mean_spread(spec):
        batches = epoch_batches(lengths, spec, 0)
        assert sorted(row[0] for micro in batches for row in micro) == list(range(len(lengths)))
        return np.mean([np.ptp([lengths[row[0]] for row in micro]) for micro in batches])

    # a window of 256 rows sorted and cut into fours leaves ~2 length units between neighbours
    assert mean_spread(grouped) < 0.05 * mean_spread(random)


def test_eval_metrics_are_the_same_packed_or_padded(prepared, tiny_model_dir):
    from accelerate import Accelerator

    from tuneloop.train.evaluate import evaluate
    from tuneloop.train.objectives import OBJECTIVES, ObjectiveModule

    model = ObjectiveModule(model_with("sdpa", tiny_model_dir), OBJECTIVES["language_model"](None))
    lengths = np.asarray(prepared.train["length"])
    accelerator = Accelerator(cpu=True)
    results = {}
    for mode, packed in (("packed", True), ("group_by_length", False)):
        spec = BatchingSpec(mode, micro_batch_size=3, sequence_len=512, world_size=1, seed=0)
        batches = epoch_micro_batches(lengths, spec, 0, shuffle=False, even=False)[0]
        results[mode] = evaluate(model, batches, Collator(prepared.train, 0, packed=packed), model.objective,
                                 accelerator)
    packed, padded = results["packed"], results["group_by_length"]
    assert packed["eval_tokens"] == padded["eval_tokens"] == int(np.sum(prepared.train["n_targets"]))
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], rel=1e-6)
    assert packed["eval_token_accuracy"] == pytest.approx(padded["eval_token_accuracy"], abs=1e-9)


def test_pad_to_sequence_len_gives_every_batch_the_same_width(prepared):
    collate = Collator(prepared.train, 0, packed=False, padding=Padding(fixed=512))
    assert {collate([[i], [i + 1]]).inputs["input_ids"].shape[1] for i in range(0, 10, 2)} == {512}
