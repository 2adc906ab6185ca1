"""The forum's T5 comparison at small scale, in one run: tuneloop, Seq2SeqTrainer and the forum's hand-written loop.

The thread ("Is the Trainer slower than customised loops?") trained a T5 from scratch with its own tokenizer,
once with a bare Accelerate loop using `DataCollatorForSeq2Seq(tokenizer, model=model, padding="max_length",
max_length=...)`, once with `Seq2SeqTrainer`. This reproduces it on the embedded chatterbot conversations (each
user turn -> the assistant's reply), each variant in its own fresh process (interleaved over `--repeats` rounds):

  tuneloop         fp32   tuneloop's real run (tuneloop.run.TrainingSession, what `tuneloop train` runs) on a
                          YAML config (`bf16: false`), each micro-batch padded to its longest row (the default)
  seq2seq_trainer  fp32   transformers Seq2SeqTrainer, default arguments except those that set the shared run
                          (batch, epochs, lr, schedule, clipping, seed, no saving/eval/reporting), collator
                          DataCollatorForSeq2Seq(tokenizer, model=model): padding=True (to the longest row)
  forum_loop       fp32   the forum's loop: a bare Accelerate loop, DataCollatorForSeq2Seq(tokenizer, model=model,
                          padding="max_length", max_length=sequence_len) -- every row padded to max_length on both
                          sides -- mean loss from model(**batch).loss, accelerator.backward, step, zero_grad
  (--bf16 adds tuneloop_bf16 and seq2seq_trainer_bf16: the same with bf16 mixed precision)

Shared by every variant: one T5 (config and initial weights saved once in a folder, random init from seed 0),
one tokenizer (trained by tuneloop's own `train_tokenizer` code, a unigram model, saved in that folder), the
same tokenized rows (tokenized once by tuneloop.data.prepare: source -> input_ids ending with eos, target ->
labels ending with eos; the tuneloop child reads the same cache through its own config), the same global
batch with no accumulation (so every variant's loss is the mean over the micro-batch's target tokens), the
same epochs, AdamW (fused, the Trainer's default optim) with weight decay 0 at a constant learning rate
without warm-up (the forum's schedule), no gradient clipping (the forum's loop has none), fp32, seed 42.
Only the row order differs (each shuffles its own way) and the padding.

Each child times its training loop alone (model load, imports, data loading and the final save are outside;
the first step is inside, as in compare.py), counts the real (non-pad) encoder + decoder tokens and the
computed (padded) positions of every micro-batch, and after training computes the eval loss per target token
on the same held-out rows with one function (teacher-forced).

    python benchmarks/seq2seq.py --quick        # tiny T5, 64 rows, 2 epochs (the test; ~25 s on 2 cores)
    python benchmarks/seq2seq.py                # the example's T5 (d_model 128, 3+3 layers), whole set, 2 epochs
                                                # (~3.5 min on 2 cores, 1 thread per child)
    python benchmarks/seq2seq.py --json out.json --repeats 3   # medians of interleaved rounds (timings drift ~10%)
    python benchmarks/seq2seq.py --quick --bf16 # adds tuneloop and the Trainer in bf16 mixed precision

Note: the `tokenizers` Unigram trainer is not bit-reproducible between processes (its piece scores differ in the
last digits), so a fresh workdir may tokenize a few rows differently and the numbers move slightly run to run;
within one run all variants share the one tokenizer saved in the model folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare import child_env, peak_memory_mb, sync, write_jsonl  # noqa: E402 (benchmarks/ is sys.path[0])

# name -> (what runs, precision)
VARIANTS = {
    "tuneloop": ("tuneloop", "fp32"),
    "seq2seq_trainer": ("trainer", "fp32"),
    "forum_loop": ("forum", "fp32"),
}
BF16_VARIANTS = {
    "tuneloop_bf16": ("tuneloop", "bf16"),
    "seq2seq_trainer_bf16": ("trainer", "bf16"),
}
EVAL_BATCH = 32

# the example's model (examples/t5_from_scratch.yml), and a tiny one for the test
SMALL_T5 = dict(d_model=128, d_ff=512, d_kv=32, num_heads=4, num_layers=3, num_decoder_layers=3, dropout_rate=0.0)
TINY_T5 = dict(d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=2, num_decoder_layers=2, dropout_rate=0.0)

# train_rows None: every pair the held-out rows leave
PRESETS = {
    "quick": dict(t5=TINY_T5, vocab_size=400, train_rows=64, eval_rows=16, sequence_len=128, micro_batch_size=8,
                  epochs=2, learning_rate=3e-3),
    "default": dict(t5=SMALL_T5, vocab_size=2000, train_rows=None, eval_rows=128, sequence_len=128,
                    micro_batch_size=16, epochs=2, learning_rate=1e-3),
}
SEED = 42


# ======================================================================================== parent: assets
def conversation_pairs() -> tuple[list[dict], str]:
    """(source/target rows, where they came from): every user turn of the embedded chatterbot conversations with
    the assistant's reply after it; synthetic rows only when the embedded data cannot be had."""
    try:
        from compare import chatterbot_messages

        conversations = chatterbot_messages()
    except (ImportError, OSError) as error:
        print(f"!! the embedded chatterbot data is not available ({type(error).__name__}: {error}); "
              "using SYNTHETIC rows", flush=True)
        return synthetic_pairs(2000), "synthetic (embedded data missing)"
    pairs = []
    for messages in conversations:
        for asked, answered in zip(messages, messages[1:]):
            if asked["role"] == "user" and answered["role"] == "assistant" and asked["content"].strip() \
                    and answered["content"].strip():
                pairs.append({"source": asked["content"], "target": answered["content"]})
    return pairs, "embedded chatterbot-en (user turn -> reply)"


def synthetic_pairs(count: int) -> list[dict]:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    sentence = lambda low, high: " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))  # noqa: E731
    return [{"source": sentence(3, 15), "target": sentence(3, 40)} for _ in range(count)]


def tokenizer_config(setup: dict, files: list[Path], workdir: Path) -> dict:
    """What tuneloop's `train_tokenizer` trains from (T5 from scratch, as examples/t5_from_scratch.yml)."""
    return {"base_model_config": "t5", "overrides_of_model_config": dict(setup["t5"]),
            "train_tokenizer": {"type": "unigram", "vocab_size": setup["vocab_size"]},
            "datasets": [{"path": str(path), "type": "seq2seq"} for path in files],
            "dataset_prepared_path": str(workdir / "prepared"), "sequence_len": setup["sequence_len"],
            "output_dir": str(workdir / "out" / "tokenizer"), "bf16": False}


def build_model_folder(setup: dict, train_file: Path, eval_file: Path, workdir: Path) -> Path:
    """The tokenizer (tuneloop's train_tokenizer, on the train and held-out text as `val_set_size` would) and a T5
    sized to it by tuneloop's own model_config, random weights from seed 0, saved once: every variant loads it."""
    import torch
    from transformers import T5ForConditionalGeneration

    from tuneloop.config import config_from_dict
    from tuneloop.model.model_config import model_config
    from tuneloop.model.tokenizer import load_tokenizer

    cfg = config_from_dict(tokenizer_config(setup, [train_file, eval_file], workdir))
    tokenizer = load_tokenizer(cfg, encoder_decoder=True)
    config = model_config(cfg, tokenizer)
    config.use_cache = False  # no decoder KV cache built in training, in any variant (tuneloop sets it anyway)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    target = workdir / "model"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def tuneloop_config(setup: dict, model_dir: Path, data_file: Path, workdir: Path) -> dict:
    """The tuneloop row's config: the shared settings every variant mirrors; everything else tuneloop's defaults
    (random order, each micro-batch padded to its longest row, the summed/token-weighted loss)."""
    return {
        "base_model": str(model_dir),
        "datasets": [{"path": str(data_file), "type": "seq2seq"}],  # field_source: source, field_target: target
        "dataset_prepared_path": str(workdir / "prepared"),
        "sequence_len": setup["sequence_len"],
        "micro_batch_size": setup["micro_batch_size"],
        "gradient_accumulation_steps": 1,
        "num_epochs": setup["epochs"],
        "learning_rate": setup["learning_rate"],
        "lr_scheduler": "constant",  # the forum's get_scheduler("constant")
        "warmup_steps": 0,
        "optimizer": "adamw_torch_fused",  # tuneloop's default, the Trainer's default
        "weight_decay": 0.0,
        "max_grad_norm": 0,  # no clipping: the forum's loop has none
        "bf16": False,
        "save_strategy": "no",
        "output_dir": str(workdir / "out" / "tuneloop"),
        "seed": SEED,
    }


def make_setup(preset: str, args, workdir: Path) -> dict:
    """Rows, tokenizer, model folder, tuneloop config and the prepared rows, once; returns the children's job."""
    import numpy as np
    import yaml
    from transformers.utils import logging as hf_logging

    from tuneloop.config import config_from_dict
    from tuneloop.data.prepare import prepare
    from tuneloop.model.tokenizer import load_tokenizer

    hf_logging.disable_progress_bar()
    setup = dict(PRESETS[preset])
    for key in ("train_rows", "eval_rows", "micro_batch_size", "epochs", "sequence_len", "learning_rate"):
        if getattr(args, key, None):
            setup[key] = getattr(args, key)
    workdir.mkdir(parents=True, exist_ok=True)

    pairs, source = conversation_pairs()
    order = list(range(len(pairs)))
    random.Random(0).shuffle(order)
    eval_rows = [pairs[i] for i in order[:setup["eval_rows"]]]
    rest = order[setup["eval_rows"]:]
    train_rows = [pairs[i] for i in (rest if setup["train_rows"] is None else rest[:setup["train_rows"]])]
    if setup["train_rows"] is not None and len(train_rows) < setup["train_rows"]:
        raise SystemExit(f"only {len(train_rows)} train rows; {setup['train_rows']} asked")
    train_file = write_jsonl(workdir / "train.jsonl", train_rows)
    eval_file = write_jsonl(workdir / "heldout.jsonl", eval_rows)

    model_dir = build_model_folder(setup, train_file, eval_file, workdir)
    train_raw = tuneloop_config(setup, model_dir, train_file, workdir)
    eval_raw = dict(train_raw, datasets=[{**train_raw["datasets"][0], "path": str(eval_file)}])
    config_path = workdir / "tuneloop.yml"
    config_path.write_text(yaml.safe_dump(train_raw, sort_keys=False))
    train_cfg, eval_cfg = config_from_dict(train_raw), config_from_dict(eval_raw)
    tokenizer = load_tokenizer(train_cfg, encoder_decoder=True)  # the model folder's: what the tuneloop child loads
    train_prepared = prepare(train_cfg, tokenizer, encoder_decoder=True)  # the tuneloop child hits this cache
    eval_prepared = prepare(eval_cfg, tokenizer, encoder_decoder=True)

    # the same rows for the transformers variants: input_ids (the encoder's, ending with eos) and labels (the
    # target, ending with eos), as DataCollatorForSeq2Seq takes them
    store = train_prepared.train
    sources = np.asarray(store["source_length"]).astype(np.int64)
    lengths = np.asarray(store["length"]).astype(np.int64)
    n_targets = np.asarray(store["n_targets"]).astype(np.int64)
    if not np.array_equal(n_targets, lengths - sources):
        raise SystemExit("some target tokens are masked (-100) in the prepared rows: the token counts would differ")
    token_rows = []
    for index in range(len(store)):
        split = int(sources[index])
        token_rows.append({"input_ids": store.tokens("input_ids", index)[:split].tolist(),
                           "labels": store.tokens("labels", index)[split:].tolist()})
    tokens_file = write_jsonl(workdir / "train_tokens.jsonl", token_rows)
    eos = tokenizer.eos_token_id
    assert all(row["input_ids"][-1] == eos and row["labels"][-1] == eos for row in token_rows)

    steps_per_epoch = math.ceil(len(store) / setup["micro_batch_size"])
    return {
        "preset": preset, "workdir": str(workdir), "model_dir": str(model_dir), "config_path": str(config_path),
        "train_tokens_file": str(tokens_file), "eval_cache": str(eval_prepared.cache_dir / "train"),
        "sequence_len": setup["sequence_len"], "micro_batch_size": setup["micro_batch_size"],
        "epochs": setup["epochs"], "learning_rate": setup["learning_rate"], "seed": SEED,
        "model": model_line(model_dir, tokenizer),
        "data": {"source": source, "train_rows": len(store), "eval_rows": len(eval_prepared.train),
                 "pairs_available": len(pairs),
                 "dropped_too_long": train_prepared.stats.dropped_too_long,
                 "train_tokens_per_epoch": int(lengths.sum()), "encoder_tokens_per_epoch": int(sources.sum()),
                 "decoder_tokens_per_epoch": int((lengths - sources).sum()),
                 "max_source_len": int(sources.max()), "max_target_len": int((lengths - sources).max()),
                 "median_source_len": float(np.median(sources)),
                 "median_target_len": float(np.median(lengths - sources)),
                 "expected_real_tokens": int(lengths.sum()) * setup["epochs"],
                 "steps_per_epoch": steps_per_epoch},
    }


def model_line(model_dir: Path, tokenizer) -> str:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return (f"T5 from scratch (d_model {config.d_model}, d_ff {config.d_ff}, {config.num_heads} heads, "
            f"{config.num_layers}+{config.num_decoder_layers} layers, vocab {config.vocab_size}: tuneloop-trained "
            f"unigram tokenizer of {len(tokenizer)} tokens)")


# ======================================================================================== parent: running
def run_child(job: dict, variant: str, round_index: int, threads: int, timeout: int) -> dict:
    workdir = Path(job["workdir"])
    (workdir / "logs").mkdir(exist_ok=True)
    tag = f"{variant}-r{round_index}"
    job_file, result_file, log_file = (workdir / "logs" / f"{tag}.job.json", workdir / "logs" / f"{tag}.result.json",
                                       workdir / "logs" / f"{tag}.log")
    result_file.unlink(missing_ok=True)
    shutil.rmtree(workdir / "out" / tag, ignore_errors=True)
    job_file.write_text(json.dumps(dict(job, variant=variant, result_file=str(result_file),
                                        output_dir=str(workdir / "out" / tag))))
    with open(log_file, "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(job_file)],
                              env=child_env(threads), stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              cwd=str(workdir))
    if proc.returncode != 0 or not result_file.exists():
        tail = log_file.read_text(errors="replace")[-4000:]
        raise SystemExit(f"variant {variant} (round {round_index}) failed with exit code {proc.returncode}; "
                         f"log {log_file}:\n{tail}")
    return json.loads(result_file.read_text())


def speed(result: dict) -> float:
    return result["real_tokens"] / result["train_seconds"]


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """Medians over rounds; ratios (real tokens/s) within each round, then their median."""
    rows = []
    rounds = len(runs["tuneloop"])
    for name, got in runs.items():
        ratio = lambda ref: round(statistics.median(  # noqa: E731
            speed(got[i]) / speed(runs[ref][i]) for i in range(rounds)), 3)
        first = got[0]
        rows.append({
            "name": name,
            "precision": precision_name(name),
            "steps": first["steps"],
            "real_tokens": first["real_tokens"] if len({r["real_tokens"] for r in got}) == 1 else None,
            "computed_tokens": first["computed_tokens"],
            "padding_fraction": round(1 - first["real_tokens"] / first["computed_tokens"], 4),
            "real_tokens_per_s": round(statistics.median(speed(r) for r in got), 1),
            "computed_tokens_per_s": round(statistics.median(r["computed_tokens"] / r["train_seconds"]
                                                             for r in got), 1),
            "train_seconds": round(statistics.median(r["train_seconds"] for r in got), 3),
            "eval_loss": round(statistics.median(r["eval_loss"] for r in got), 5),
            "train_loss_last": first["train_loss_last"],
            "ratio_vs_forum_loop": ratio("forum_loop"),
            "ratio_vs_trainer": ratio("seq2seq_trainer"),
            "peak_mem_mb": round(statistics.median(r["peak_mem_mb"] for r in got), 1),
            "attention": first["attention"],
            "optimizer": first["optimizer"],
            "per_round": [{k: r[k] for k in ("real_tokens", "computed_tokens", "train_seconds", "steps", "eval_loss",
                                             "train_loss_last", "peak_mem_mb")} for r in got],
        })
    return rows


def precision_name(name: str) -> str:
    return {**VARIANTS, **BF16_VARIANTS}[name][1]


def print_table(job: dict, rows: list[dict], rounds: int, threads: int) -> None:
    data = job["data"]
    print(f"\n== {job['preset']} preset: {job['model']}")
    print(f"   data: {data['source']}: {data['train_rows']} train rows ({data['dropped_too_long']} dropped as "
          f"longer than {job['sequence_len']}), {data['eval_rows']} held-out; per epoch "
          f"{data['encoder_tokens_per_epoch']} encoder + {data['decoder_tokens_per_epoch']} decoder tokens "
          f"(median {data['median_source_len']:g} + {data['median_target_len']:g} a row, max "
          f"{data['max_source_len']} + {data['max_target_len']})")
    print(f"   batch {job['micro_batch_size']} rows (no accumulation), {job['epochs']} epoch(s) = "
          f"{data['steps_per_epoch'] * job['epochs']} steps, AdamW (fused) lr {job['learning_rate']:g} constant, "
          f"no warm-up, no clipping, weight decay 0, cpu, {threads} thread(s), {rounds} round(s)")
    print("   real tok/s = non-pad encoder+decoder tokens per second of the training loop; pad % = padded share of "
          "the positions computed;\n   eval loss = per target token on the held-out rows after training (one "
          "function for every row); x forum / x trainer = real tok/s ratios")
    head = (f"{'name':<22}{'precision':>10}{'steps':>7}{'real tok/s':>12}{'computed/s':>12}{'pad %':>7}"
            f"{'eval loss':>11}{'x forum loop':>14}{'x trainer':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<22}{r['precision']:>10}{r['steps']:>7}{r['real_tokens_per_s']:>12.1f}"
              f"{r['computed_tokens_per_s']:>12.1f}{100 * r['padding_fraction']:>7.1f}{r['eval_loss']:>11.4f}"
              f"{r['ratio_vs_forum_loop']:>14.2f}{r['ratio_vs_trainer']:>11.2f}")
    tokens = {r["real_tokens"] for r in rows}
    same = tokens == {data["expected_real_tokens"]}
    print(f"real tokens per run: {', '.join(str(t) for t in sorted(tokens, key=str))}"
          + (" (identical in every row: every prepared token, every epoch)" if same
             else f"  <-- NOT all {data['expected_real_tokens']}: unfair comparison"))
    by_name = {r["name"]: r for r in rows}
    print(f"tuneloop / seq2seq_trainer = {by_name['tuneloop']['ratio_vs_trainer']:.2f}x, tuneloop / forum_loop = "
          f"{by_name['tuneloop']['ratio_vs_forum_loop']:.2f}x, forum_loop / seq2seq_trainer = "
          f"{by_name['forum_loop']['ratio_vs_trainer']:.2f}x (real tokens/s)")


# ======================================================================================== child helpers
class CountingSeq2SeqCollator:
    """Wraps DataCollatorForSeq2Seq; counts real tokens (encoder attention mask + decoder labels that are not -100)
    and computed positions (encoder + decoder widths) of every batch."""

    def __init__(self, inner):
        self.inner, self.real, self.computed = inner, 0, 0

    def __call__(self, features):
        batch = self.inner(features)
        self.real += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        self.computed += batch["input_ids"].numel() + batch["labels"].numel()
        return batch


def eval_loss_per_target_token(model, eval_cache: str, pad_id: int, start_id: int) -> float:
    """Teacher-forced cross-entropy per target token over the held-out rows, in fp32, rows of similar length
    batched together (encoder padding masked; decoder padding after the targets, out of the loss): the same
    function for every variant."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from tuneloop.data.token_store import TokenRows

    rows = TokenRows(eval_cache)
    sources = np.asarray(rows["source_length"])
    pairs = []
    for index in range(len(rows)):
        ids, labels, split = rows.tokens("input_ids", index), rows.tokens("labels", index), int(sources[index])
        pairs.append((ids[:split].astype(np.int64), labels[split:].astype(np.int64)))
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(order), EVAL_BATCH):
            batch = [pairs[i] for i in order[start:start + EVAL_BATCH]]
            source_width = max(len(s) for s, _ in batch)
            target_width = max(len(t) for _, t in batch)
            ids = torch.full((len(batch), source_width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), source_width), dtype=torch.long)
            labels = torch.full((len(batch), target_width), -100, dtype=torch.long)
            decoder = torch.full((len(batch), target_width), pad_id, dtype=torch.long)
            for row, (source, target) in enumerate(batch):
                ids[row, :len(source)] = torch.from_numpy(source)
                mask[row, :len(source)] = 1
                labels[row, :len(target)] = torch.from_numpy(target)
                decoder[row, 0] = start_id
                decoder[row, 1:len(target)] = torch.from_numpy(target[:-1])
            logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits
            total += float(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                           reduction="sum"))
            count += int((labels != -100).sum())
    model.train(was_training)
    return total / count


def load_hf_model(job: dict):
    import torch
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    model.config.use_cache = False  # (saved so; as tuneloop sets it)
    return model


def load_token_rows(job: dict) -> list[dict]:
    return [json.loads(line) for line in Path(job["train_tokens_file"]).read_text().splitlines() if line]


def evaluate(model, job: dict, tokenizer) -> float:
    return eval_loss_per_target_token(model, job["eval_cache"], tokenizer.pad_token_id,
                                      model.config.decoder_start_token_id)


def child_result(model, tokenizer, job: dict, **measured) -> dict:
    return {**measured, "eval_loss": evaluate(model, job, tokenizer),
            "attention": model.config._attn_implementation,
            "n_params": sum(p.numel() for p in model.parameters())}


# ======================================================================================== child variants
def child_tuneloop(job: dict, bf16: bool) -> dict:
    """tuneloop's real run (TrainingSession, what `tuneloop train` runs) on the YAML config, watched through its
    hooks: nothing of tuneloop is patched."""
    from tuneloop.config import load_run_config
    from tuneloop.run import TrainingSession
    from tuneloop.train.hooks import RunHooks

    class Hooks(RunHooks):
        def __init__(self):
            self.real = self.computed = 0
            self.kept = {}

        def micro_batch(self, batch) -> None:
            self.real += batch.n_real_tokens
            self.computed += batch.inputs["input_ids"].numel() + batch.inputs["decoder_input_ids"].numel()

        def loop_ended(self, model) -> None:
            self.kept.update(model=model, peak_mem_mb=peak_memory_mb("cpu"))

    hooks = Hooks()
    overrides = [f"output_dir={job['output_dir']}", f"bf16={'true' if bf16 else 'false'}"]
    with TrainingSession(load_run_config(job["config_path"], overrides), hooks) as session:
        result = session.run(overwrite=True)
    if result.error is not None or "model" not in hooks.kept:
        raise SystemExit(f"tuneloop train failed: {result.error or 'no final model'}")
    summary = result.summary
    metrics = [json.loads(line) for line in (Path(job["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    return child_result(hooks.kept["model"], tokenizer, job, real_tokens=hooks.real, computed_tokens=hooks.computed,
                        train_seconds=summary["train_seconds"], steps=summary["steps"],
                        peak_mem_mb=hooks.kept["peak_mem_mb"],
                        train_loss_last=[m["loss"] for m in metrics if "loss" in m][-1],
                        optimizer="torch.optim.AdamW(fused=True) (tuneloop's adamw_torch_fused)")


def child_trainer(job: dict, bf16: bool) -> dict:
    """Seq2SeqTrainer with its default arguments, except the run's shared settings (see the docstring)."""
    import datasets
    from transformers import (AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments,
                              TrainerCallback)

    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    model = load_hf_model(job)
    train = datasets.Dataset.from_list(load_token_rows(job))
    collator = CountingSeq2SeqCollator(DataCollatorForSeq2Seq(tokenizer, model=model))  # padding=True: longest

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kwargs):  # the last epoch's end: the loop's
            self.seconds = time.perf_counter() - self.start
            self.peak = peak_memory_mb("cpu")

    clock = Clock()
    args = Seq2SeqTrainingArguments(
        output_dir=job["output_dir"], per_device_train_batch_size=job["micro_batch_size"],
        num_train_epochs=job["epochs"], learning_rate=job["learning_rate"],
        lr_scheduler_type="constant",  # (default linear decay) the forum's, and every variant's
        max_grad_norm=0.0,  # (default 1.0) the forum's loop does not clip
        seed=job["seed"], bf16=bf16, use_cpu=True,
        save_strategy="no", report_to=[])  # (default: a checkpoint every 500 steps) nothing is saved
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                             processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return child_result(trainer.model, tokenizer, job, real_tokens=collator.real, computed_tokens=collator.computed,
                        train_seconds=clock.seconds, steps=trainer.state.global_step, peak_mem_mb=clock.peak,
                        train_loss_last=losses[-1] if losses else None,  # (logged every 500 steps by default)
                        train_loss_mean=trainer.state.log_history[-1].get("train_loss"),
                        optimizer=f"Trainer default optim={args.optim}")


def child_forum(job: dict) -> dict:
    """The forum's loop (its `train`, without its per-step accuracy and logging): every row padded to
    max_length by DataCollatorForSeq2Seq, the model's mean loss, accelerator.backward, step, zero_grad."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, get_scheduler

    accelerator = Accelerator(cpu=True, mixed_precision="no")
    set_seed(job["seed"])
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    model = load_hf_model(job)
    collator = CountingSeq2SeqCollator(DataCollatorForSeq2Seq(tokenizer=tokenizer, model=model, padding="max_length",
                                                              max_length=job["sequence_len"]))
    # the forum's DataLoader had shuffle=False over a generator dataset; shuffled here (seeded) so that every
    # variant sees the rows in a random order
    dataloader = DataLoader(load_token_rows(job), batch_size=job["micro_batch_size"], shuffle=True,
                            generator=torch.Generator().manual_seed(job["seed"]), collate_fn=collator)
    # the forum's optimizer (weight decay 0 as every variant here), fused as the Trainer's default
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["learning_rate"], weight_decay=0.0, fused=True)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    dataloader = accelerator.prepare(dataloader)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    model.train()
    steps, last_loss = 0, None
    start = time.perf_counter()
    for _ in range(job["epochs"]):
        for batch in dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            steps += 1
            last_loss = loss.detach()
    seconds = time.perf_counter() - start
    peak = peak_memory_mb("cpu")
    return child_result(accelerator.unwrap_model(model), tokenizer, job, real_tokens=collator.real,
                        computed_tokens=collator.computed, train_seconds=seconds, steps=steps, peak_mem_mb=peak,
                        train_loss_last=float(last_loss), optimizer="torch.optim.AdamW(fused=True)")


def child_main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    import torch

    kind, precision = {**VARIANTS, **BF16_VARIANTS}[job["variant"]]
    if kind == "tuneloop":
        result = child_tuneloop(job, bf16=precision == "bf16")
    elif kind == "trainer":
        result = child_trainer(job, bf16=precision == "bf16")
    else:
        result = child_forum(job)
    result["threads"] = torch.get_num_threads()
    sync("cpu")
    Path(job["result_file"]).write_text(json.dumps(result, indent=2))


# ======================================================================================== parent entry
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny T5 on 64 rows (the test)")
    parser.add_argument("--bf16", action="store_true", help="also tuneloop and the Trainer in bf16 mixed precision")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/torch threads per child (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--train-rows", dest="train_rows", type=int, help="override the preset's train rows")
    parser.add_argument("--eval-rows", dest="eval_rows", type=int, help="override the preset's held-out rows")
    parser.add_argument("--micro-batch-size", dest="micro_batch_size", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--sequence-len", dest="sequence_len", type=int, help="also the forum loop's max_length")
    parser.add_argument("--learning-rate", dest="learning_rate", type=float)
    parser.add_argument("--workdir", help="keep model, data, logs here (default: a temporary folder, removed)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per child process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    os.environ.update({k: v for k, v in child_env(args.threads).items() if k != "PYTHONPATH"})
    preset = "quick" if args.quick else "default"
    names = list(VARIANTS) + (list(BF16_VARIANTS) if args.bf16 else [])
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tuneloop-seq2seq-"))
    started = time.perf_counter()
    try:
        job = make_setup(preset, args, root)
        print(f"prepared {job['data']['train_rows']} train / {job['data']['eval_rows']} held-out rows, tokenizer and "
              f"model in {time.perf_counter() - started:.1f} s (workdir {root})", flush=True)
        runs = {name: [] for name in names}
        for round_index in range(args.repeats):
            for name in names:
                t0 = time.perf_counter()
                result = run_child(job, name, round_index, args.threads, args.timeout)
                runs[name].append(result)
                print(f"  round {round_index + 1}/{args.repeats} {name:<21} {result['real_tokens']:>8} real / "
                      f"{result['computed_tokens']:>8} computed tokens in {result['train_seconds']:.2f} s "
                      f"({result['steps']} steps; eval loss {result['eval_loss']:.4f}; process "
                      f"{time.perf_counter() - t0:.1f} s)", flush=True)
        rows = summarise(runs)
        print_table(job, rows, args.repeats, args.threads)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"total wall time {time.perf_counter() - started:.1f} s")
    if args.json:
        document = {"preset": preset, "model": job["model"], "device": "cpu", "threads": args.threads,
                    "repeats": args.repeats, "data": job["data"],
                    "settings": {k: job[k] for k in ("sequence_len", "micro_batch_size", "epochs", "learning_rate",
                                                     "seed")},
                    "shared": "same model folder (config + initial weights), tokenizer, tokenized rows, global batch "
                              "(no accumulation), epochs, AdamW fused lr constant no warm-up, no clipping, wd 0",
                    "final_loss_is": "eval loss per target token on the held-out rows, after training",
                    "rows": rows}
        Path(args.json).write_text(json.dumps(document, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
