"""The reference model of a preference run (a method whose RL_METHODS entry uses one: DPO, IPO, KTO): live, or its
log-probs computed once.

Live, the reference is the starting model, frozen: a LoRA run switches its adapter off (train/preference.py),
a full fine-tuning run keeps a frozen copy made before the first step (a resumed run loads the base again:
the checkpoint holds the trained weights, not the starting ones).

With `precompute_ref_log_probs: true` the starting model's log-probability of every reply is computed before
training, one pass over the train and eval pairs, and cached next to the prepared data under a key of the
data and the model (weights, dtype, precision, attention): no reference forward during training, and no copy
of the weights. The values are those of the padded (unpacked) pass; a packed run's live reference differs from
them by float rounding only.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from tuneloop.data.collate import Collator
from tuneloop.log_probs import reference_mode, sequence_log_probs

REFERENCE_BATCH_PAIRS = 8  # pairs per forward of the precomputing pass


def live_reference_model(cfg, model, load_base, resumed: bool, device):
    """Full fine-tuning's frozen reference (None where the run needs none: LoRA, ORPO, precomputed): a copy of
    `model` before its first step, or `load_base()` when the run resumed (its model holds trained weights)."""
    import copy

    from tuneloop.rl_methods import keeps_reference_copy

    if not keeps_reference_copy(cfg):
        return None
    reference = load_base() if resumed else copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval().to(device)


def reference_key(cfg, resolved, data_key: str) -> str:
    """What the precomputed log-probs depend on: the data, and the model as it computes (its files' sizes and
    times stand for its weights; the run's precision and attention kernel)."""
    source = Path(cfg.base_model)
    files = sorted((str(path.name), path.stat().st_size, path.stat().st_mtime_ns)
                   for path in source.glob("*") if path.is_file()) if source.is_dir() else []
    settings = {"data": data_key, "model": cfg.base_model, "revision": cfg.revision_of_model, "files": files,
                "overrides": cfg.overrides_of_model_config, "weights": [cfg.bfloat16, cfg.float16],
                "precision": resolved.precision.mixed, "attention": resolved.attention.used,
                "quantized": [cfg.load_in_4bit, cfg.load_in_8bit], "tokens": cfg.tokens}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@torch.no_grad()
def store_log_probs(model, store, pad_token_id: int, accelerator) -> np.ndarray:
    """The model's summed log-probability of each sequence's targets, one per store row (float32)."""
    collate = Collator(store, pad_token_id, packed=False)
    values = np.zeros(len(store), dtype=np.float32)
    was_training = model.training
    model.eval()
    with reference_mode(model):
        for first in range(0, store.units, REFERENCE_BATCH_PAIRS):
            units = [[unit] for unit in range(first, min(first + REFERENCE_BATCH_PAIRS, store.units))]
            batch = collate(units).to(accelerator.device)
            with accelerator.autocast():
                sums, _ = sequence_log_probs(model, batch.inputs, batch.targets, batch.extra["sequence_index"],
                                             batch.extra["n_sequences"])
            rows = first * store.group
            values[rows:rows + len(sums)] = sums.float().cpu().numpy()
    model.train(was_training)
    return values


def precomputed_reference(cfg, resolved, starting_model, prepared, tokenizer, accelerator, data_key: str) -> dict:
    """{"train": log-probs per train row, "eval": per eval row (when there is an eval set)}, from the cache or
    computed now with `starting_model()` (and cached, atomically: a reader sees a whole file or none)."""
    model = None
    folder = Path(prepared.cache_dir) / f"reference-{reference_key(cfg, resolved, data_key)}"
    stores = {"train": prepared.train, "eval": prepared.eval}
    found = {}
    for name, store in stores.items():
        if store is None:
            continue
        path = folder / f"{name}.f32"
        if path.is_file() and path.stat().st_size == 4 * len(store):
            found[name] = np.fromfile(path, dtype=np.float32)
            continue
        if model is None:
            model = starting_model().to(accelerator.device)
        values = store_log_probs(model, store, tokenizer.pad_token_id, accelerator)
        folder.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(handle, "wb") as out:
            values.tofile(out)
        os.replace(temp, path)
        found[name] = values
    return found
