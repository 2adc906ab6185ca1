"""Same model, same prepared rows, same seed, optimizer, schedule and global batch: who trains faster?

Nine variants (five on a GPU), each in its own fresh process, interleaved A B C ..., A B C ... for `--repeats`
rounds. Each row says its precision:

  tuneloop                      fp32   tuneloop's real run (tuneloop.run.TrainingSession, what `tuneloop train`
                                       runs), unpacked, `bf16: false`
  trainer                       fp32   transformers Trainer, default arguments, DataCollatorForSeq2Seq
  trainer_group_by_length       fp32   the same with train_sampling_strategy="group_by_length"
  bare_loop                     fp32   a bare Accelerate loop as in Accelerate's docs (DataLoader + padding
                                       collator, accelerator.prepare / accumulate / backward), on the very
                                       micro-batches of the `tuneloop` row -- the "hand-written" reference
  tuneloop_packed               fp32   tuneloop with sample_packing: true
  tuneloop_defaults             auto   tuneloop at its defaults (bf16: auto -- bf16 where the CPU has it --,
                                       the chunked loss, its own attention), unpacked
  tuneloop_packed_defaults      auto   the same, packed
  trainer_bf16                  bf16   the Trainer with bf16=True
  trainer_bf16_group_by_length  bf16   and with group_by_length

On a GPU every row runs bf16, so the last four would repeat the first five and are left out.

Every variant runs one epoch over the same prepared train rows (tokenized once by tuneloop.data.prepare and read
back from its Arrow cache), so every run processes the same real tokens; packed runs take fewer optimizer steps.
Each child times only its training loop (perf_counter, with a CUDA sync on GPU) and reports its own count of
real (non-pad) tokens, its optimizer steps, its peak memory up to the end of the loop, and then an eval loss per
target token on a fixed held-out set, computed by the same function for every variant after training.

    python benchmarks/compare.py --quick                 # tiny LLaMA on chatterbot rows of 20-512 tokens (CI)
    python benchmarks/compare.py                         # the embedded SmolLM2-135M on the quickstart data
    python benchmarks/compare.py --gpu                   # H200: bf16 + SDPA, SmolLM2-135M and a ~1B LLaMA; MFU
    python benchmarks/compare.py --quick --profile-only  # where tuneloop's step time goes

See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tuneloop.data.token_store import TokenRows  # light (numpy): the prepared rows, memory-mapped
from tuneloop.train.hooks import RunHooks  # light: torch and transformers load in the children

# name -> (what runs, its precision). "fp32" rows compare the loops on the same arithmetic; "defaults" rows are
# tuneloop as a user gets it (bf16: auto, the chunked loss), next to the Trainer asked for bf16. On a GPU every
# row runs bf16, so the bf16-only rows would repeat the others and are left out (see variants_for).
VARIANTS = {
    "tuneloop": ("tuneloop", "fp32"),
    "trainer": ("trainer", "fp32"),
    "trainer_group_by_length": ("trainer_group_by_length", "fp32"),
    "bare_loop": ("bare_loop", "fp32"),
    "tuneloop_packed": ("tuneloop_packed", "fp32"),
    "tuneloop_defaults": ("tuneloop", "bf16: auto"),
    "tuneloop_packed_defaults": ("tuneloop_packed", "bf16: auto"),
    "trainer_bf16": ("trainer", "bf16"),
    "trainer_bf16_group_by_length": ("trainer_group_by_length", "bf16"),
}
PROFILES = {"profile": "tuneloop", "profile_packed": "tuneloop_packed", "profile_bare": "bare_loop"}
BF16_ONLY = ("tuneloop_defaults", "tuneloop_packed_defaults", "trainer_bf16", "trainer_bf16_group_by_length")
REPO = Path(__file__).resolve().parents[1]
EVAL_BATCH = 8

# ------------------------------------------------------------------------------------------------ presets
# rows/eval_rows: train and held-out rows; mbs x accum = the global batch (rows) of every variant.
PRESETS = {
    "quick": dict(model="tiny-llama", data="chatterbot-mix", train_rows=64, eval_rows=24, min_len=20, max_len=512,
                  sequence_len=512, micro_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                  repeats=1, device="cpu"),
    "default": dict(model="embedded", data="quickstart", train_rows=64, eval_rows=16, sequence_len=256,
                    micro_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-4, repeats=1, device="cpu"),
    "gpu": dict(model="embedded,llama-1b", data="chatterbot-mix", train_rows=2048, eval_rows=128, min_len=20,
                max_len=2048, sequence_len=2048, micro_batch_size=8, gradient_accumulation_steps=2,
                learning_rate=1e-4, repeats=1, device="cuda"),
    # `--config FILE` / `tuneloop bench FILE`: the config's model, first dataset and batch settings
    "config": dict(model="config", data="config", train_rows=64, eval_rows=16, repeats=1, device="auto"),
}
MODEL_NAMES = {"embedded": "smollm2-135m (embedded)", "tiny-llama": "tiny LLaMA (hidden 256, 4 layers)",
               "llama-1b": "LLaMA ~1.1B from config (TinyLlama shape)"}


# ======================================================================================== parent: assets
def chatterbot_messages() -> list[list[dict]]:
    from tuneloop.demo.embedded import ensure_embedded_dataset

    path = ensure_embedded_dataset()
    return [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_small_tokenizer(target: Path) -> Path:
    """A byte-level BPE (vocab 1024) trained on the chatterbot text: a small vocabulary for the tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tuneloop.data.chat_template_texts import CHATML

    texts = [message["content"] for conversation in chatterbot_messages() for message in conversation]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                   "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts + ["user", "assistant", "system"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token=None,
                                   pad_token="<pad>", unk_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(target)
    return target


def build_llama(target: Path, tokenizer_dir: Path, shape: str) -> Path:
    """A LLaMA built from a config (random init, seed 0), saved once; every variant loads this folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if shape == "tiny-llama":
        dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True)
    else:  # TinyLlama-1.1B's shape
        dims = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                    num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, use_cache=False,
                         **dims)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def embedded_model_dir() -> Path:
    from tuneloop.demo.embedded import ensure_embedded_model

    return Path(ensure_embedded_model())


def mixed_length_rows(tokenizer, count: int, min_len: int, max_len: int, seed: int) -> list[dict]:
    """Chat rows of min_len..max_len tokens, each made of k chatterbot conversations (k log-uniform)."""
    conversations = chatterbot_messages()
    rng = random.Random(seed)
    rows, attempts = [], 0
    k_max = 1
    while k_max < len(conversations):  # the k whose rows reach about max_len tokens
        text = tokenizer.apply_chat_template([m for c in conversations[:k_max] for m in c], tokenize=False)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= max_len:
            break
        k_max += 1
    while len(rows) < count:
        attempts += 1
        if attempts > count * 50:
            raise RuntimeError("cannot make enough rows in the asked length range")
        k = max(1, round(math.exp(rng.uniform(0, math.log(k_max)))))
        messages = [m for c in rng.sample(conversations, k) for m in c]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if min_len <= length <= max_len:
            rows.append({"messages": messages})
    return rows


def quickstart_rows(count: int) -> tuple[list[dict], dict]:
    """The rows examples/quickstart.yml trains on (its dataset, after its dataset_shard_num/idx), in file order."""
    import yaml

    from tuneloop.config import config_from_dict
    from tuneloop.data.load import read_rows

    raw = yaml.safe_load((REPO / "examples" / "quickstart.yml").read_text())
    cfg = config_from_dict(raw)
    rows = []
    for entry in cfg.datasets:
        rows.extend(row.values for row in read_rows(entry))
    if cfg.dataset_shard_num:
        rows = [row for i, row in enumerate(rows) if i % cfg.dataset_shard_num == cfg.dataset_shard_idx]
    if len(rows) < count:
        raise SystemExit(f"quickstart data has {len(rows)} rows; fewer than the {count} asked")
    return rows, raw


def config_rows(config_path: Path, count: int) -> tuple[list[dict], dict]:
    """The first `count` raw rows of a tuneloop config's first dataset, and the settings to mirror."""
    import yaml

    from tuneloop.config import config_from_dict
    from tuneloop.data.load import read_rows

    cfg = config_from_dict(yaml.safe_load(config_path.read_text()))
    entry = cfg.datasets[0]
    rows = [row.values for row in read_rows(entry)]
    if len(rows) < count:
        raise SystemExit(f"{config_path}: its first dataset has {len(rows)} rows; the benchmark needs {count} "
                         "(lower --train-rows/--eval-rows)")
    dataset_entry = entry.model_dump(exclude_none=True, exclude={"path", "data_files", "ds_type", "split"})
    extra = {key: value for key, value in cfg.model_dump(exclude_none=True).items()
             if key in ("chat_template", "chat_template_jinja", "train_on_inputs", "special_tokens")}
    settings = {"sequence_len": cfg.sequence_len, "learning_rate": cfg.learning_rate,
                "micro_batch_size": cfg.micro_batch_size,
                "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                "dataset_entry": dataset_entry, "extra": extra}
    return rows, settings


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def tuneloop_config(setup: dict, model_dir: Path, data_file: Path, workdir: Path, extra: dict) -> dict:
    """The run's tuneloop config: the shared settings every variant mirrors."""
    cfg = {
        "base_model": str(model_dir),
        "datasets": [{**setup.get("dataset_entry", {"type": "chat_template"}), "path": str(data_file)}],
        "dataset_prepared_path": str(workdir / "prepared"),
        "sequence_len": setup["sequence_len"],
        "micro_batch_size": setup["micro_batch_size"],
        "gradient_accumulation_steps": setup["gradient_accumulation_steps"],
        "num_epochs": 1,
        "learning_rate": setup["learning_rate"],
        "lr_scheduler": "cosine",
        "warmup_steps": 0,  # no warm-up: every implementation's cosine is then the same formula
        "optimizer": "adamw_torch_fused",  # tuneloop's default, and the Trainer's
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "attn_implementation": "sdpa",
        "bf16": setup["device"] == "cuda",
        "logging_steps": 10,
        "save_strategy": "no",
        "output_dir": str(workdir / "out" / "tuneloop"),
        "seed": 42,
    }
    cfg.update(extra)
    return cfg


def make_setup(preset: str, model_key: str, args, workdir: Path) -> dict:
    """Build model/tokenizer/data for one model of a preset, prepare the rows once; return the children's job."""
    import yaml

    from tuneloop.config import config_from_dict
    from tuneloop.data.prepare import prepare
    from tuneloop.model.tokenizer import load_tokenizer

    setup = dict(PRESETS[preset])
    for key in ("train_rows", "eval_rows", "micro_batch_size", "gradient_accumulation_steps", "sequence_len"):
        if getattr(args, key, None):
            setup[key] = getattr(args, key)
    workdir.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    extra = {}
    if model_key == "tiny-llama":
        tokenizer_dir = build_small_tokenizer(workdir / "tokenizer")
        model_dir = build_llama(workdir / "model", tokenizer_dir, "tiny-llama")
        extra["chat_template"] = "chatml"
    elif model_key == "llama-1b":
        # (SmolLM2's tokenizer, from the embedded model or --tokenizer where that cannot be built: a GPU machine
        # without the package that carries its GGUF)
        model_dir = build_llama(workdir / "model", Path(args.tokenizer) if args.tokenizer else embedded_model_dir(),
                                "llama-1b")
    elif model_key == "config":
        from tuneloop.config import load_run_config

        model_dir = Path(load_run_config(args.config).base_model)
    else:
        model_dir = embedded_model_dir()
    if setup["device"] == "auto":
        import torch

        setup["device"] = "cuda" if torch.cuda.is_available() else "cpu"

    if setup["data"] in ("quickstart", "config"):
        if setup["data"] == "config":
            rows, raw = config_rows(Path(args.config), setup["train_rows"] + setup["eval_rows"])
            for key in ("micro_batch_size", "gradient_accumulation_steps"):
                if not getattr(args, key, None):
                    setup[key] = raw.get(key, setup.get(key, 1))
            setup["dataset_entry"] = raw["dataset_entry"]
            extra.update(raw["extra"])
        else:
            rows, raw = quickstart_rows(setup["train_rows"] + setup["eval_rows"])
        for key in ("sequence_len", "learning_rate"):  # the quickstart's own values, unless overridden
            if key in raw and not getattr(args, key, None):
                setup[key] = raw[key]
        # hold out a fixed, seeded sample; train on the next train_rows
        order = list(range(len(rows)))
        random.Random(0).shuffle(order)
        eval_rows = [rows[i] for i in order[:setup["eval_rows"]]]
        train_rows = [rows[i] for i in order[setup["eval_rows"]:setup["eval_rows"] + setup["train_rows"]]]
        if raw.get("chat_template"):
            extra["chat_template"] = raw["chat_template"]
    else:
        # tuneloop's own tokenizer for the run (chat template included) measures the rows' lengths
        probe = load_tokenizer(config_from_dict(tuneloop_config(setup, model_dir, workdir, workdir, extra)),
                               encoder_decoder=False)
        made = mixed_length_rows(probe, setup["train_rows"] + setup["eval_rows"], setup["min_len"],
                                 setup["max_len"], seed=0)
        train_rows, eval_rows = made[:setup["train_rows"]], made[setup["train_rows"]:]
    train_file = write_jsonl(workdir / "train.jsonl", train_rows)
    eval_file = write_jsonl(workdir / "heldout.jsonl", eval_rows)

    train_raw = tuneloop_config(setup, model_dir, train_file, workdir, extra)
    eval_raw = dict(train_raw, datasets=[{**train_raw["datasets"][0], "path": str(eval_file)}])
    config_path = workdir / "tuneloop.yml"
    config_path.write_text(yaml.safe_dump(train_raw, sort_keys=False))
    train_cfg, eval_cfg = config_from_dict(train_raw), config_from_dict(eval_raw)
    tokenizer = load_tokenizer(train_cfg, encoder_decoder=False)
    train_prepared = prepare(train_cfg, tokenizer)  # the tuneloop children hit this same cache
    eval_prepared = prepare(eval_cfg, tokenizer)
    lengths = list(train_prepared.train["length"])
    return {
        "preset": preset, "model_key": model_key, "model": MODEL_NAMES.get(model_key, str(model_dir)),
        "model_dir": str(model_dir),
        "config_path": str(config_path), "train_cache": str(train_prepared.cache_dir / "train"),
        "eval_cache": str(eval_prepared.cache_dir / "train"), "device": setup["device"],
        "micro_batch_size": setup["micro_batch_size"],
        "gradient_accumulation_steps": setup["gradient_accumulation_steps"],
        "sequence_len": train_cfg.sequence_len, "learning_rate": train_cfg.learning_rate, "seed": train_cfg.seed,
        "bf16": setup["device"] == "cuda", "workdir": str(workdir),
        "bf16_rows_left_out": bf16_rows_left_out(setup["device"]),
        "bf16_rows": bf16_rows_left_out(setup["device"]) is None,
        "data": {"train_rows": len(lengths), "eval_rows": len(eval_prepared.train),
                 "train_tokens": int(sum(lengths)), "min_len": int(min(lengths)), "max_len": int(max(lengths)),
                 "median_len": float(statistics.median(lengths)),
                 "dropped_too_long": train_prepared.stats.dropped_too_long},
    }


# ======================================================================================== parent: running
def child_env(threads: int, variant: str | None = None) -> dict:
    """A variant's process environment. tuneloop's rows start under mimalloc, as the `tuneloop` command would
    (host/allocator.py: they run TrainingSession in this script's child, which cannot change its allocator once
    started); the other tools' rows get glibc as their users do (no preload inherited from a `tuneloop bench`)."""
    from tuneloop.host.allocator import RESTARTED, preloaded_environment

    env = {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", RESTARTED)}
    runs = PROFILES.get(variant) or VARIANTS.get(variant, ("",))[0]  # (the profile children: "profile", ...)
    if variant is not None and runs.startswith("tuneloop"):
        env = preloaded_environment(env) or env
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_child(job: dict, variant: str, round_index: int, threads: int, timeout: int) -> dict:
    workdir = Path(job["workdir"])
    (workdir / "logs").mkdir(exist_ok=True)
    tag = f"{variant}-r{round_index}"
    job_file, result_file, log_file = (workdir / "logs" / f"{tag}.job.json", workdir / "logs" / f"{tag}.result.json",
                                       workdir / "logs" / f"{tag}.log")
    result_file.unlink(missing_ok=True)
    shutil.rmtree(workdir / "out" / tag, ignore_errors=True)  # a fresh run each time (tuneloop refuses old files)
    job_file.write_text(json.dumps(dict(job, variant=variant, result_file=str(result_file),
                                        output_dir=str(workdir / "out" / tag))))
    with open(log_file, "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(job_file)],
                              env=child_env(threads, variant), stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              cwd=str(workdir))
    if proc.returncode != 0 or not result_file.exists():
        tail = log_file.read_text(errors="replace")[-4000:]
        raise SystemExit(f"variant {variant} (round {round_index}) failed with exit code {proc.returncode}; "
                         f"log {log_file}:\n{tail}")
    return json.loads(result_file.read_text())


def variants_for(job: dict) -> list[str]:
    return [name for name in VARIANTS if name not in BF16_ONLY or job["bf16_rows"]]


def bf16_rows_left_out(device: str) -> str | None:
    """Why the bf16-only rows are not run here, or None where they are (a CPU with native bf16)."""
    from tuneloop.host.hardware import native_bf16

    if device == "cuda":
        return "on a GPU every row runs bf16"
    if native_bf16() is None:
        return ("this CPU has no native bf16: tuneloop's `bf16: auto` would train in fp32, as the fp32 rows do, and "
                "the Trainer's bf16 would be emulated")
    return None


def precision_of(job: dict, name: str) -> str:
    """The row's precision as the table prints it: on a GPU every row is bf16."""
    return "bf16" if job["device"] == "cuda" else VARIANTS[name][1]


def summarise(job: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """Medians over rounds; ratios are taken within each round (interleaved), then the median of those."""
    rows = []
    rounds = len(runs["tuneloop"])
    for name in variants_for(job):
        got = runs[name]
        speed = [r["real_tokens"] / r["train_seconds"] for r in got]
        ratio = lambda ref: statistics.median(  # noqa: E731
            (got[i]["real_tokens"] / got[i]["train_seconds"])
            / (runs[ref][i]["real_tokens"] / runs[ref][i]["train_seconds"]) for i in range(rounds))
        row = {
            "name": name,
            "precision": precision_of(job, name),
            "real_tokens": got[0]["real_tokens"] if len({r["real_tokens"] for r in got}) == 1 else None,
            "real_tokens_per_s": round(statistics.median(speed), 2),
            "steps_per_s": round(statistics.median(r["steps"] / r["train_seconds"] for r in got), 4),
            "peak_mem_mb": round(statistics.median(r["peak_mem_mb"] for r in got), 1),
            "final_loss": round(statistics.median(r["eval_loss"] for r in got), 5),
            "ratio_vs_bare": round(ratio("bare_loop"), 3),
            "ratio_vs_trainer": round(ratio("trainer"), 3),
            "steps": got[0]["steps"],
            "computed_tokens": got[0]["computed_tokens"],
            "padding_fraction": (round(1 - got[0]["real_tokens"] / got[0]["computed_tokens"], 4)
                                 if got[0]["computed_tokens"] else None),
            "train_seconds_median": round(statistics.median(r["train_seconds"] for r in got), 3),
            "per_round": [{k: r[k] for k in ("real_tokens", "train_seconds", "steps", "peak_mem_mb", "eval_loss",
                                             "train_loss_last", "optimizer")} for r in got],
        }
        if got[0].get("mfu") is not None:  # tuneloop's own MFU (model FLOPs over the measured or listed peak)
            row["mfu"] = round(statistics.median(r["mfu"] for r in got), 4)
        rows.append(row)
    return rows


def fmt_pct(value) -> str:
    return "?" if value is None else f"{100 * value:.1f}"


def print_table(job: dict, rows: list[dict], rounds: int, threads: int) -> None:
    data = job["data"]
    print(f"\n== {job['preset']} preset: {job['model']}, {data['train_rows']} train rows "
          f"({data['train_tokens']} tokens, lengths {data['min_len']}-{data['max_len']}, median "
          f"{data['median_len']:g}), seq {job['sequence_len']}, global batch {job['micro_batch_size']} x "
          f"{job['gradient_accumulation_steps']} rows, 1 epoch, lr {job['learning_rate']:g} cosine, "
          f"{job['device']}, {rounds} round(s), {threads} thread(s)")
    if job.get("tuneloop_set"):
        print(f"   tuneloop rows run with --set {' --set '.join(job['tuneloop_set'])}")
    print("   final loss = eval loss per target token on the "
          f"{data['eval_rows']} held-out rows, after training (same function for every variant)")
    print("   MFU = tuneloop's own figure (model FLOPs per real token over the peak its plan names); "
          "x trainer = against the fp32 Trainer row")
    head = (f"{'variant':<29}{'precision':>11}{'real tok/s':>11}{'steps/s':>9}{'steps':>6}{'pad %':>7}"
            f"{'peak MB':>9}{'final loss':>11}{'x bare':>8}{'x trainer':>10}{'MFU':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (f"{r['name']:<29}{r['precision']:>11}{r['real_tokens_per_s']:>11.1f}{r['steps_per_s']:>9.3f}"
                f"{r['steps']:>6}{fmt_pct(r['padding_fraction']):>7}{r['peak_mem_mb']:>9.0f}"
                f"{r['final_loss']:>11.4f}{r['ratio_vs_bare']:>8.2f}{r['ratio_vs_trainer']:>10.2f}")
        print(line + (f"{100 * r['mfu']:>6.1f}%" if r.get("mfu") is not None else f"{'':>7}"))
    tokens = {r["real_tokens"] for r in rows}  # None: the rounds of one variant disagreed
    print(f"real tokens per run: {', '.join(str(t) for t in sorted(tokens, key=str))}"
          + (" (identical in every variant)" if len(tokens) == 1 else "  <-- NOT the same: unfair comparison"))


# ======================================================================================== child helpers
def peak_memory_mb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def eval_loss_per_token(model, eval_cache: str, pad_token_id: int, device: str, bf16: bool) -> float:
    """Mean cross-entropy per target token over the held-out rows: the same function for every variant."""
    import contextlib

    import torch
    import torch.nn.functional as F

    data = TokenRows(eval_cache)
    ids_all, labels_all = data["input_ids"], data["labels"]
    order = sorted(range(len(ids_all)), key=lambda i: len(ids_all[i]))
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if bf16 and device == "cuda"
                else contextlib.nullcontext())
    with torch.no_grad():
        for start in range(0, len(order), EVAL_BATCH):
            batch = order[start:start + EVAL_BATCH]
            width = max(len(ids_all[i]) for i in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                n = len(ids_all[i])
                ids[row, :n] = torch.tensor(ids_all[i])
                labels[row, :n] = torch.tensor(labels_all[i])
                mask[row, :n] = 1
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            with autocast:
                logits = model(input_ids=ids, attention_mask=mask).logits
            shifted = labels[:, 1:]
            total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), shifted.flatten(),
                                           ignore_index=-100, reduction="sum"))
            count += int((shifted != -100).sum())
    model.train(was_training)
    return total / count


class CountingCollator:
    """Wraps a padding collator; counts real (attention-mask) and computed (padded) tokens of every batch."""

    def __init__(self, inner):
        self.inner, self.real, self.computed = inner, 0, 0

    def __call__(self, features):
        batch = self.inner(features)
        self.real += int(batch["attention_mask"].sum())
        self.computed += batch["attention_mask"].numel()
        return batch


def load_hf_model(job: dict):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False  # as tuneloop does: no KV cache built during training (same compute)
    return model


def job_tokenizer(job: dict):
    """tuneloop's tokenizer for the run (same pad token and chat template the rows were prepared with)."""
    from tuneloop.config import load_config
    from tuneloop.model.tokenizer import load_tokenizer

    return load_tokenizer(load_config(job["config_path"]), encoder_decoder=False)


def train_loss_of_last_log(log_history: list[dict]) -> float | None:
    losses = [entry["loss"] for entry in log_history if "loss" in entry]
    return losses[-1] if losses else None


# ======================================================================================== child variants
class BenchHooks(RunHooks):
    """How the benchmark watches a tuneloop run, through its hooks (tuneloop/train/hooks.py): it counts the real
    and computed tokens of every micro-batch (as the other variants count theirs in their collator), keeps the
    trained model and reads peak memory when the loop ends, and with `profile` times each phase of the loop (with
    a CUDA sync around each on GPU). What is left of the loop's wall time is the loop's own code."""

    def __init__(self, device: str, profile: bool):
        self.device, self.profile = device, profile
        self.real = self.computed = 0
        self.phases: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.kept: dict = {}

    def micro_batch(self, batch) -> None:
        self.real += batch.n_real_tokens
        self.computed += batch.inputs["input_ids"].numel()

    def loop_started(self) -> None:
        sync(self.device)
        self.kept["loop_start"] = time.perf_counter()

    def loop_ended(self, model) -> None:
        sync(self.device)
        self.kept.update(loop_end=time.perf_counter(), peak_mem_mb=peak_memory_mb(self.device), model=model)

    def phase(self, name: str):
        return self._timed(name) if self.profile else super().phase(name)

    @contextlib.contextmanager
    def _timed(self, name: str):
        sync(self.device)
        begin = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - begin
            self.calls[name] = self.calls.get(name, 0) + 1


def child_tuneloop(job: dict, packed: bool, profile: bool = False) -> dict:
    """tuneloop's real run (tuneloop.run.TrainingSession, what `tuneloop train` runs) in this process, watched
    through its hooks (BenchHooks): nothing of tuneloop is patched."""
    from tuneloop.config import load_run_config
    from tuneloop.run import TrainingSession

    device = job["device"]
    hooks = BenchHooks(device, profile)
    overrides = [*job.get("tuneloop_set", []), f"output_dir={job['output_dir']}",
                 f"sample_packing={'true' if packed else 'false'}"]
    if job.get("precision") == "bf16: auto":  # tuneloop's default (the fp32 rows run the config's bf16: false)
        overrides.append("bf16=auto")
    if packed or job.get("precision") == "bf16: auto":
        # packed rows have no other tool's counterpart, and the defaults rows are tuneloop at its defaults: they run
        # tuneloop's own attention (on a CPU each packed sequence, or each padded row's real tokens, apart where
        # cheaper; torch's varlen kernel for packed rows on a GPU at 16 bits), not the SDPA under a mask that the
        # fp32 `tuneloop` row shares with the Trainer and the bare loop
        overrides.append("attn_implementation=null")
    with TrainingSession(load_run_config(job["config_path"], overrides), hooks) as session:
        result = session.run(overwrite=True)
    if result.error is not None or "model" not in hooks.kept:
        raise SystemExit(f"tuneloop train failed: {result.error or 'no final model'}")
    summary = result.summary
    metrics = [json.loads(line) for line in (Path(job["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    model = hooks.kept["model"]
    if profile:
        total = hooks.kept["loop_end"] - hooks.kept["loop_start"]
        return {"variant": "tuneloop_packed" if packed else "tuneloop", "steps": summary["steps"],
                "micro_batches": hooks.calls.get("collate", 0), "total_seconds": total,
                "phases": hooks.phases, "calls": hooks.calls, "other_seconds": total - sum(hooks.phases.values())}
    return {"real_tokens": hooks.real, "train_seconds": summary["train_seconds"], "steps": summary["steps"],
            "peak_mem_mb": hooks.kept["peak_mem_mb"], "computed_tokens": hooks.computed,
            "train_loss_last": [m["loss"] for m in metrics if "loss" in m][-1],
            "eval_loss": eval_loss_per_token(model, job["eval_cache"], job_tokenizer(job).pad_token_id,
                                             device, job["bf16"]),
            "n_params": sum(p.numel() for p in model.parameters()), "mfu": summary.get("mfu"),
            "optimizer": "torch.optim.AdamW(fused=True) (tuneloop's adamw_torch_fused)"}


def child_trainer(job: dict, group_by_length: bool) -> dict:
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    device = job["device"]
    tokenizer = job_tokenizer(job)
    model = load_hf_model(job)
    train = TokenRows(job["train_cache"]).to_datasets()  # input_ids, labels (+ length, n_targets: unused)
    collator = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True))  # pads labels with -100

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            sync(device)
            self.start = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kwargs):
            sync(device)
            self.seconds = time.perf_counter() - self.start
            self.peak = peak_memory_mb(device)

    clock = Clock()
    extra = {"train_sampling_strategy": "group_by_length"} if group_by_length else {}
    args = TrainingArguments(
        output_dir=job["output_dir"], per_device_train_batch_size=job["micro_batch_size"],
        gradient_accumulation_steps=job["gradient_accumulation_steps"], num_train_epochs=1,
        learning_rate=job["learning_rate"], lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, seed=job["seed"], bf16=job["bf16"] or job.get("precision") == "bf16",
        use_cpu=device != "cuda",
        report_to="none", save_strategy="no", **extra)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator,
                      processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    model = trainer.model
    return {"real_tokens": collator.real, "train_seconds": clock.seconds, "steps": trainer.state.global_step,
            "peak_mem_mb": clock.peak, "computed_tokens": collator.computed,
            "train_loss_last": train_loss_of_last_log(trainer.state.log_history),
            "eval_loss": eval_loss_per_token(model, job["eval_cache"], tokenizer.pad_token_id, device, job["bf16"]),
            "n_params": sum(p.numel() for p in model.parameters()),
            "optimizer": f"Trainer default optim={args.optim}"}


def child_bare(job: dict, profile: bool = False) -> dict:
    """A bare Accelerate loop, written as in Accelerate's docs (gradient accumulation guide)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForSeq2Seq, get_cosine_schedule_with_warmup

    device = job["device"]
    accum = job["gradient_accumulation_steps"]
    accelerator = Accelerator(cpu=device != "cuda", mixed_precision="bf16" if job["bf16"] else "no",
                              gradient_accumulation_steps=accum)
    set_seed(job["seed"])
    tokenizer = job_tokenizer(job)
    model = load_hf_model(job)
    train = TokenRows(job["train_cache"]).to_datasets().select_columns(["input_ids", "labels"])
    collator = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True))
    # Identical batches: the bare loop takes the very micro-batches the `tuneloop` row trains on (its seeded
    # epoch-0 order), so the two differ only in the loop around them — the overhead comparison. Otherwise it is
    # Accelerate's docs' loop (there, DataLoader(shuffle=True), whose padding differs by the luck of the draw).
    import numpy as np

    from tuneloop.config import load_config
    from tuneloop.data.batching import epoch_micro_batches
    from tuneloop.plan.build import train_spec
    from tuneloop.resolved import resolve_config

    lengths = np.asarray(TokenRows(job["train_cache"])["length"])
    cfg = load_config(job["config_path"])
    micro_batches = epoch_micro_batches(lengths, train_spec(cfg, resolve_config(cfg), 1), 0)[0]
    batch_sampler = [[row[0] for row in micro] for micro in micro_batches]
    dataloader = DataLoader(train, batch_sampler=batch_sampler, collate_fn=collator)
    # as in Accelerate's docs, except fused=True: every variant then runs the same optimizer as the
    # Trainer's default (adamw_torch_fused), so the comparison measures the loops, not AdamW kernels
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["learning_rate"], weight_decay=0.0, fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 0, math.ceil(len(dataloader) / accum))
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    model.train()
    if profile:
        return profile_bare_loop(job, accelerator, model, optimizer, dataloader, scheduler)
    steps, last_loss = 0, None

    sync(device)
    start = time.perf_counter()
    for batch in dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            last_loss = loss.detach()
    sync(device)
    seconds = time.perf_counter() - start
    peak = peak_memory_mb(device)
    unwrapped = accelerator.unwrap_model(model)
    return {"real_tokens": collator.real, "train_seconds": seconds, "steps": steps, "peak_mem_mb": peak,
            "computed_tokens": collator.computed, "train_loss_last": float(last_loss),
            "eval_loss": eval_loss_per_token(unwrapped, job["eval_cache"], tokenizer.pad_token_id, device,
                                             job["bf16"]),
            "n_params": sum(p.numel() for p in unwrapped.parameters()),
            "optimizer": "torch.optim.AdamW(fused=True)"}


def profile_bare_loop(job, accelerator, model, optimizer, dataloader, scheduler) -> dict:
    """The bare loop above with a lap (CUDA sync on GPU) between its phases: the reference profile."""
    device = job["device"]
    names = ["data: next batch (collate)", "forward + loss", "backward", "clip grad norm",
             "optimizer + scheduler + zero_grad"]
    phases = dict.fromkeys(names, 0.0)
    calls = dict.fromkeys(names, 0)
    mark = [0.0]

    def lap(name: str) -> None:
        sync(device)
        now = time.perf_counter()
        phases[name] += now - mark[0]
        calls[name] += 1
        mark[0] = now

    steps = micro = 0
    sync(device)
    start = mark[0] = time.perf_counter()
    iterator = iter(dataloader)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        lap("data: next batch (collate)")
        micro += 1
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            lap("forward + loss")
            accelerator.backward(loss)
            lap("backward")
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                lap("clip grad norm")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lap("optimizer + scheduler + zero_grad")
        if accelerator.sync_gradients:
            steps += 1
    sync(device)
    total = time.perf_counter() - start
    return {"variant": "bare_loop", "steps": steps, "micro_batches": micro, "total_seconds": total,
            "phases": phases, "calls": calls, "other_seconds": total - sum(phases.values())}


# ======================================================================================== profile
def print_profile(result: dict) -> None:
    total, steps = result["total_seconds"], result["steps"]
    print(f"\n-- profile: {result['variant']}: {steps} optimizer steps, {result['micro_batches']} micro-batches, "
          f"loop {total:.2f} s = {1000 * total / steps:.1f} ms/step")
    print(f"{'phase':<36}{'calls':>6}{'seconds':>9}{'share':>8}{'ms/step':>9}")
    order = ["sampler", "data", "collate", "to(device)", "forward", "loss", "backward", "clip", "optimizer",
             "scheduler", "zero_grad", "logging"]
    rank = lambda name: next((i for i, key in enumerate(order) if name.startswith(key)), len(order))  # noqa: E731
    items = [(name, result["calls"].get(name, 0), result["phases"][name])
             for name in sorted(result["phases"], key=rank)]
    items.append(("other (the loop's own code)", "", result["other_seconds"]))
    for name, count, seconds in items:
        print(f"{name:<36}{count:>6}{seconds:>9.3f}{100 * seconds / total:>7.1f}%{1000 * seconds / steps:>9.2f}")


# ======================================================================================== child entry
def child_main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    import torch

    if job["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the gpu preset needs a CUDA device")
    variant = job["variant"]
    if variant in VARIANTS:  # a row: what runs, at the row's precision
        variant, job["precision"] = VARIANTS[variant]
    if variant == "tuneloop":
        result = child_tuneloop(job, packed=False)
    elif variant == "tuneloop_packed":
        result = child_tuneloop(job, packed=True)
    elif variant == "trainer":
        result = child_trainer(job, group_by_length=False)
    elif variant == "trainer_group_by_length":
        result = child_trainer(job, group_by_length=True)
    elif variant == "bare_loop":
        result = child_bare(job)
    elif variant in ("profile", "profile_packed"):
        result = child_tuneloop(job, packed=variant == "profile_packed", profile=True)
    elif variant == "profile_bare":
        result = child_bare(job, profile=True)
    else:
        raise SystemExit(f"unknown variant {variant}")
    result["threads"] = torch.get_num_threads()
    Path(job["result_file"]).write_text(json.dumps(result, indent=2))


# ======================================================================================== parent entry
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="tiny LLaMA on chatterbot rows of 20-512 tokens (CI)")
    which.add_argument("--config", metavar="FILE",
                       help="the config's model, first dataset and batch settings (what `tuneloop bench FILE` runs)")
    which.add_argument("--gpu", action="store_true", help="H200 preset: bf16 + SDPA; SmolLM2-135M and ~1B LLaMA")
    parser.add_argument("--gpu-model", choices=["embedded", "llama-1b", "all"], default="all",
                        help="which model(s) the gpu preset runs (default: both)")
    parser.add_argument("--tokenizer", metavar="DIR", help="the ~1B LLaMA's tokenizer folder (default: the embedded "
                        "model's, SmolLM2's)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/torch threads per child (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--profile", action="store_true", help="also profile tuneloop's step phases")
    parser.add_argument("--profile-only", action="store_true", help="only the profile, no comparison")
    parser.add_argument("--train-rows", type=int, help="override the preset's number of train rows")
    parser.add_argument("--eval-rows", type=int, help="override the preset's number of held-out rows")
    parser.add_argument("--micro-batch-size", dest="micro_batch_size", type=int)
    parser.add_argument("--gradient-accumulation-steps", dest="gradient_accumulation_steps", type=int)
    parser.add_argument("--sequence-len", dest="sequence_len", type=int)
    parser.add_argument("--tuneloop-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra `--set` for both tuneloop rows (A/B a setting, e.g. optimizer=adamw_torch_fused)")
    parser.add_argument("--workdir", help="keep models, data, logs here (default: a temporary folder, removed)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds allowed per child process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    os.environ.update({k: v for k, v in child_env(args.threads).items() if k != "PYTHONPATH"})
    preset = "quick" if args.quick else "gpu" if args.gpu else "config" if args.config else "default"
    repeats = args.repeats or PRESETS[preset]["repeats"]
    models = PRESETS[preset]["model"].split(",")
    if preset == "gpu" and args.gpu_model != "all":
        models = [args.gpu_model]
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tuneloop-bench-"))
    results = []
    try:
        for model_key in models:
            started = time.perf_counter()
            job = make_setup(preset, model_key, args, root / model_key)
            job["tuneloop_set"] = args.tuneloop_set
            print(f"[{model_key}] prepared {job['data']['train_rows']} train / {job['data']['eval_rows']} held-out "
                  f"rows in {time.perf_counter() - started:.1f} s (workdir {job['workdir']})", flush=True)
            if job["bf16_rows_left_out"]:
                print(f"  bf16 rows left out ({', '.join(BF16_ONLY)}): {job['bf16_rows_left_out']}", flush=True)
            runs = {name: [] for name in variants_for(job)}
            if not args.profile_only:
                for round_index in range(repeats):
                    for name in variants_for(job):
                        t0 = time.perf_counter()
                        result = run_child(job, name, round_index, args.threads, args.timeout)
                        runs[name].append(result)
                        print(f"  round {round_index + 1}/{repeats} {name:<29} {result['real_tokens']:>8} real tokens "
                              f"in {result['train_seconds']:.2f} s ({result['steps']} steps; eval loss "
                              f"{result['eval_loss']:.4f}; process {time.perf_counter() - t0:.1f} s)", flush=True)
                rows = summarise(job, runs)
                print_table(job, rows, repeats, args.threads)
            else:
                rows = []
            profiles = []
            if args.profile or args.profile_only:
                for name in ("profile", "profile_packed", "profile_bare"):
                    profiles.append(run_child(job, name, 0, args.threads, args.timeout))
                    print_profile(profiles[-1])
            results.append({"preset": preset, "model": job["model"], "device": job["device"],
                            "threads": args.threads, "repeats": repeats, "data": job["data"],
                            "settings": {k: job[k] for k in ("sequence_len", "micro_batch_size",
                                                             "gradient_accumulation_steps", "learning_rate",
                                                             "seed", "bf16", "tuneloop_set")},
                            "final_loss_is": "eval loss per target token on the held-out rows, after training",
                            "bf16_rows_left_out": job["bf16_rows_left_out"],
                            "rows": rows, "profile": profiles})
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        document = dict(results[0])
        if len(results) > 1:
            document["models"] = results
        Path(args.json).write_text(json.dumps(document, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
