"""DPO, tuneloop against TRL's DPOTrainer: same model, pairs, adapter, beta, optimizer and global batch.

Three variants, each in its own fresh process, interleaved A B C, A B C ... for `--repeats` rounds:

  tuneloop         `tuneloop train` (TrainingSession) with `rl: dpo`, pairs padded side by side
  tuneloop_packed  the same with `sample_packing: true` (a pair's two sequences share a packed row)
  trl              TRL's DPOTrainer (the engine axolotl's `rl: dpo` runs on), conversational rows, its defaults
                   for everything not named here

Every variant trains one epoch over the same pairs (built from the embedded chatterbot conversations: a
question, its reply as chosen, another conversation's reply as rejected) at the same precision, which each row
names. Each child times its training loop alone (tuneloop: the loop without evals and saves; TRL: trainer.train()
with no evals, saves or reports) and counts the pairs and real (non-pad) tokens it trained on.

    python benchmarks/preference.py --quick      # tiny LLaMA, full fine-tuning, fp32 (CI)
    python benchmarks/preference.py              # the embedded SmolLM2-135M with LoRA r=16, bf16 on this CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("tuneloop", "tuneloop_packed", "trl")
PRESETS = {
    "quick": dict(model="tiny", pairs=32, micro_batch_size=4, gradient_accumulation_steps=2, adapter=False,
                  precision="fp32", learning_rate=1e-3, repeats=1),
    "default": dict(model="embedded", pairs=96, micro_batch_size=4, gradient_accumulation_steps=2, adapter=True,
                    precision="bf16", learning_rate=5e-5, repeats=2),
}
BETA = 0.1
SEQUENCE_LEN = 256


# ---- the parent: data, model, rounds, the table ---------------------------------------------------------------
def benchmark_pairs(count: int, seed: int = 0) -> list[dict]:
    """Conversational pairs (TRL's format, which tuneloop reads as chat_template.default)."""
    from tuneloop.demo.embedded import chatterbot_records, preference_pairs

    pairs = preference_pairs(chatterbot_records())
    random.Random(seed).shuffle(pairs)
    return [{"prompt": pair["messages"], "chosen": [{"role": "assistant", "content": pair["chosen"]}],
             "rejected": [{"role": "assistant", "content": pair["rejected"]}]} for pair in pairs[:count]]


def tiny_model(folder: Path) -> Path:
    """A 2-layer LLaMA with the embedded model's tokenizer (and chat template), built from a config."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tuneloop.demo.embedded import ensure_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_child(variant: str, job: dict, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir / f"{variant}.job.json"
    result_file = workdir / f"{variant}.result.json"
    job_file.write_text(json.dumps({**job, "variant": variant, "result": str(result_file),
                                    "workdir": str(workdir / variant)}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, __file__, "--child", str(job_file)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--pairs", type=int)
    parser.add_argument("--workdir")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(Path(args.child).read_text()))
    preset = "quick" if args.quick else "default"
    setup = dict(PRESETS[preset])
    setup.update({key: value for key, value in (("repeats", args.repeats), ("pairs", args.pairs)) if value})
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tuneloop-dpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in benchmark_pairs(setup["pairs"])))
    if setup["model"] == "tiny":
        model = str(tiny_model(workdir / "tiny-llama"))
    else:
        from tuneloop.demo.embedded import ensure_embedded_model

        model = str(ensure_embedded_model())
    job = {**setup, "model": model, "data": str(data)}
    rounds = {variant: [] for variant in VARIANTS}
    for round_index in range(setup["repeats"]):
        for variant in VARIANTS:
            result = run_child(variant, job, workdir / f"round{round_index}")
            rounds[variant].append(result)
            print(f"round {round_index + 1} {variant:16s} {result['pairs_per_second']:8.2f} pairs/s "
                  f"{result['seconds']:7.1f} s", flush=True)
    rows = summarise(rounds, setup)
    print_table(rows, setup, preset)
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": preset, "setup": job, "rows": rows}, indent=2))


def summarise(rounds: dict, setup: dict) -> list[dict]:
    rows = []
    for variant, results in rounds.items():
        median = statistics.median(result["pairs_per_second"] for result in results)
        rows.append({"name": variant, "precision": setup["precision"], "pairs": results[0]["pairs"],
                     "steps": results[0]["steps"], "real_tokens": results[0]["real_tokens"],
                     "pairs_per_second": round(median, 3),
                     "pairs_per_second_all": [round(result["pairs_per_second"], 3) for result in results],
                     "real_tokens_per_second": round(statistics.median(
                         result["real_tokens"] / result["seconds"] for result in results), 1),
                     "peak_rss_gb": round(max(result["peak_rss_gb"] for result in results), 2),
                     "final_loss": results[0]["final_loss"]})
    trl = next(row for row in rows if row["name"] == "trl")
    for row in rows:
        row["ratio_vs_trl"] = round(row["pairs_per_second"] / trl["pairs_per_second"], 2)
    return rows


def print_table(rows: list[dict], setup: dict, preset: str) -> None:
    adapter = "LoRA r=16 on all linear layers" if setup["adapter"] else "full fine-tuning"
    print(f"\nDPO, preset {preset}: {setup['pairs']} pairs, {adapter}, global batch "
          f"{setup['micro_batch_size'] * setup['gradient_accumulation_steps']} pairs, beta {BETA}, "
          f"median of {setup['repeats']} rounds")
    print("| run | precision | pairs | steps | real tokens | pairs/s | real tokens/s | vs TRL | peak RSS GB "
          "| last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['precision']} | {row['pairs']} | {row['steps']} | {row['real_tokens']} | "
              f"{row['pairs_per_second']:.2f} | {row['real_tokens_per_second']:.0f} | {row['ratio_vs_trl']:.2f}× | "
              f"{row['peak_rss_gb']:.2f} | {row['final_loss']:.4f} |")


# ---- the children ---------------------------------------------------------------------------------------------
def child(job: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    result = run_trl(job) if job["variant"] == "trl" else run_tuneloop(job)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    result["pairs_per_second"] = result["pairs"] / result["seconds"]
    Path(job["result"]).write_text(json.dumps(result))


def run_tuneloop(job: dict) -> dict:
    from tuneloop.config import config_from_dict
    from tuneloop.run import TrainingSession

    workdir = Path(job["workdir"])
    keys = {"base_model": job["model"], "rl": "dpo", "rl_beta": BETA,
            "datasets": [{"path": job["data"], "type": "chat_template.default", "field_messages": "prompt"}],
            "dataset_prepared_path": str(workdir / "prepared"), "output_dir": str(workdir / "out"),
            "sequence_len": SEQUENCE_LEN, "sample_packing": job["variant"] == "tuneloop_packed",
            "micro_batch_size": job["micro_batch_size"],
            "gradient_accumulation_steps": job["gradient_accumulation_steps"], "num_epochs": 1,
            "learning_rate": job["learning_rate"], "lr_scheduler": "constant", "optimizer": "adamw_torch",
            "logging_steps": 1, "save_strategy": "no", "bf16": job["precision"] == "bf16", "seed": 7}
    if job["adapter"]:
        keys.update(adapter="lora", lora_r=16, lora_alpha=32, lora_target_linear=True)
    with TrainingSession(config_from_dict(keys)) as session:
        result = session.run()
    if result.error:
        raise result.error
    outcome, plan = result.outcome, result.plan
    lines = [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": outcome.training_seconds, "steps": outcome.steps, "real_tokens": outcome.real_tokens,
            "pairs": plan.train_rows - plan.rows_cut_per_epoch,
            "final_loss": [m for m in lines if "loss" in m][-1]["loss"]}


def run_trl(job: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in Path(job["data"]).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    peft_config = None
    if job["adapter"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    args = DPOConfig(output_dir=str(Path(job["workdir"]) / "trl"), beta=BETA, learning_rate=job["learning_rate"],
                     lr_scheduler_type="constant", optim="adamw_torch", num_train_epochs=1,
                     per_device_train_batch_size=job["micro_batch_size"],
                     gradient_accumulation_steps=job["gradient_accumulation_steps"], max_length=SEQUENCE_LEN,
                     bf16=job["precision"] == "bf16", use_cpu=not torch.cuda.is_available(), report_to=[],
                     save_strategy="no", eval_strategy="no", logging_steps=1, seed=7, dataloader_drop_last=True)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         peft_config=peft_config)
    counted = {"real_tokens": 0, "pairs": 0}
    collate = trainer.data_collator

    def counting_collator(features):
        batch = collate(features)
        counted["real_tokens"] += int(batch["attention_mask"].sum())
        counted["pairs"] += len(features)
        return batch

    trainer.data_collator = counting_collator
    losses = []

    class LastLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trainer.add_callback(LastLoss())
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": output.global_step, "real_tokens": counted["real_tokens"],
            "pairs": counted["pairs"], "final_loss": losses[-1] if losses else float("nan")}


if __name__ == "__main__":
    main()
