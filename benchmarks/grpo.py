"""GRPO, tuneloop against TRL's GRPOTrainer: same model, prompts, rewards, group size, completion length, steps.

Two variants, each in its own fresh process, interleaved A B, A B ... for `--repeats` rounds:

  tuneloop   `tuneloop train` (TrainingSession) with `rl: grpo`: generation by transformers' generate on the
             training weights, in one left-padded batch per rank per step
  trl        TRL's GRPOTrainer (what axolotl's `rl: grpo` runs), its defaults for everything not named here
             (generation by transformers too: vLLM is not installed on these machines)

Both train `steps` optimizer steps of micro_batch_size × gradient_accumulation_steps completions (= prompts per
step × num_generations) on examples/grpo_prompts.jsonl, scored by examples/grpo_rewards.py (correct + brief), with
loss_type dapo and beta 0, at the precision each row names. Each child times its training loop (tuneloop: the
loop without saves; TRL: trainer.train() with no evals, saves or reports) and, inside it, the time that goes to
making the completions: tuneloop's "generation" phase (generate, rewards, advantages), TRL's
_generate_and_score_completions (the same work). The rest is training (forward, backward, optimizer).

    python benchmarks/grpo.py --quick      # tiny LLaMA (the embedded model's tokenizer), 3 steps, fp32 (CI)
    python benchmarks/grpo.py              # the embedded SmolLM2-135M, 8 steps, fp32, 2 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preference import tiny_model  # benchmarks/preference.py (a script's own folder is on its path): the same LLaMA

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("tuneloop", "trl")
PRESETS = {
    "quick": dict(model="tiny", steps=3, num_generations=4, micro_batch_size=4, gradient_accumulation_steps=2,
                  max_completion_length=8, precision="fp32", learning_rate=1e-3, repeats=1),
    "default": dict(model="embedded", steps=8, num_generations=8, micro_batch_size=8, gradient_accumulation_steps=2,
                    max_completion_length=24, precision="fp32", learning_rate=2e-5, repeats=2),
}
PROMPTS = REPO / "examples" / "grpo_prompts.jsonl"
REWARDS = ("correct", "brief")  # of examples/grpo_rewards.py


# ---- the parent ---------------------------------------------------------------------------------------------
def run_child(variant: str, job: dict, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result_file = workdir / f"{variant}.job.json", workdir / f"{variant}.result.json"
    job_file.write_text(json.dumps({**job, "variant": variant, "result": str(result_file),
                                    "workdir": str(workdir / variant)}))
    path = os.pathsep.join([str(REPO / "src"), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    done = subprocess.run([sys.executable, __file__, "--child", str(job_file)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--bf16", action="store_true", help="both in bf16 autocast (the CPU must have bf16)")
    parser.add_argument("--workdir")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(Path(args.child).read_text()))
    preset = "quick" if args.quick else "default"
    setup = dict(PRESETS[preset])
    setup.update({key: value for key, value in (("repeats", args.repeats), ("steps", args.steps)) if value})
    if args.bf16:
        setup["precision"] = "bf16"
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tuneloop-grpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if setup["model"] == "tiny":
        model = str(tiny_model(workdir / "tiny-llama"))
    else:
        from tuneloop.demo.embedded import ensure_embedded_model

        model = str(ensure_embedded_model())
    job = {**setup, "model": model}
    rounds = {variant: [] for variant in VARIANTS}
    for round_index in range(setup["repeats"]):
        for variant in VARIANTS:
            result = run_child(variant, job, workdir / f"round{round_index}")
            rounds[variant].append(result)
            print(f"round {round_index + 1} {variant:9s} {result['completions_per_second']:7.2f} completions/s "
                  f"{result['seconds']:7.1f} s (generation {result['generation_seconds']:.1f} s)", flush=True)
    rows = summarise(rounds, setup)
    print_table(rows, setup, preset)
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": preset, "setup": job, "rows": rows}, indent=2))


def summarise(rounds: dict, setup: dict) -> list[dict]:
    rows = []
    for variant, results in rounds.items():
        def median(key):
            return statistics.median(result[key] for result in results)

        steps = results[0]["steps"]
        rows.append({"name": variant, "precision": setup["precision"], "steps": steps,
                     "completions": results[0]["completions"],
                     "completions_per_second": round(median("completions_per_second"), 3),
                     "completions_per_second_all": [round(r["completions_per_second"], 3) for r in results],
                     "seconds_per_step": round(median("seconds") / steps, 3),
                     "generation_seconds_per_step": round(median("generation_seconds") / steps, 3),
                     "training_seconds_per_step": round((median("seconds") - median("generation_seconds")) / steps, 3),
                     "completion_tokens": results[0]["completion_tokens"],
                     "peak_rss_gb": round(max(result["peak_rss_gb"] for result in results), 2),
                     "first_reward": results[0]["first_reward"], "last_reward": results[0]["last_reward"]})
    trl = next(row for row in rows if row["name"] == "trl")
    for row in rows:
        row["ratio_vs_trl"] = round(row["completions_per_second"] / trl["completions_per_second"], 2)
    return rows


def print_table(rows: list[dict], setup: dict, preset: str) -> None:
    per_step = setup["micro_batch_size"] * setup["gradient_accumulation_steps"]
    prompts = per_step // setup["num_generations"]
    print(f"\nGRPO, preset {preset}: {setup['steps']} steps of {per_step} completions ({prompts}"
          f" prompts × {setup['num_generations']}), at most {setup['max_completion_length']} tokens each, full "
          f"fine-tuning, loss dapo, beta 0, median of {setup['repeats']} rounds")
    print("| run | precision | steps | completions | completion tokens | completions/s | s/step | generation s/step "
          "| training s/step | vs TRL | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['precision']} | {row['steps']} | {row['completions']} | "
              f"{row['completion_tokens']} | {row['completions_per_second']:.2f} | {row['seconds_per_step']:.2f} | "
              f"{row['generation_seconds_per_step']:.2f} | {row['training_seconds_per_step']:.2f} | "
              f"{row['ratio_vs_trl']:.2f}× | {row['peak_rss_gb']:.2f} |")


# ---- the children -------------------------------------------------------------------------------------------
def child(job: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    result = run_trl(job) if job["variant"] == "trl" else run_tuneloop(job)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    result["completions_per_second"] = result["completions"] / result["seconds"]
    Path(job["result"]).write_text(json.dumps(result))


def run_tuneloop(job: dict) -> dict:
    from tuneloop.config import config_from_dict
    from tuneloop.run import TrainingSession
    from tuneloop.train.hooks import RunHooks

    class GenerationClock(RunHooks):
        seconds = 0.0

        @contextlib.contextmanager
        def phase(self, name: str):
            begin = time.perf_counter()
            try:
                yield
            finally:
                if name == "generation":
                    GenerationClock.seconds += time.perf_counter() - begin

    workdir = Path(job["workdir"])
    keys = {"base_model": job["model"], "rl": "grpo",
            "trl": {"num_generations": job["num_generations"], "max_completion_length": job["max_completion_length"],
                    "loss_type": "dapo", "beta": 0.0, "reward_funcs": [f"grpo_rewards.{name}" for name in REWARDS]},
            "datasets": [{"path": str(PROMPTS)}], "output_dir": str(workdir / "out"), "sequence_len": 128,
            "micro_batch_size": job["micro_batch_size"],
            "gradient_accumulation_steps": job["gradient_accumulation_steps"],
            "max_steps": job["steps"], "learning_rate": job["learning_rate"], "lr_scheduler": "constant",
            "optimizer": "adamw_torch", "logging_steps": 1, "save_strategy": "no",
            "bf16": job["precision"] == "bf16", "seed": 7}
    cfg = config_from_dict(keys)
    cfg._config_dir = REPO / "examples"
    with TrainingSession(cfg, GenerationClock()) as session:
        result = session.run()
    if result.error:
        raise result.error
    outcome = result.outcome
    lines = [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": outcome.training_seconds, "generation_seconds": GenerationClock.seconds,
            "steps": outcome.steps, "completions": outcome.steps * job["micro_batch_size"]
            * job["gradient_accumulation_steps"], "completion_tokens": outcome.tokens,
            "first_reward": lines[0]["reward"], "last_reward": lines[-1]["reward"]}


def run_trl(job: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo_rewards

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    per_step = job["micro_batch_size"] * job["gradient_accumulation_steps"]
    args = GRPOConfig(output_dir=str(Path(job["workdir"]) / "trl"), learning_rate=job["learning_rate"],
                      lr_scheduler_type="constant", optim="adamw_torch", max_steps=job["steps"],
                      per_device_train_batch_size=job["micro_batch_size"],
                      gradient_accumulation_steps=job["gradient_accumulation_steps"],
                      num_generations=job["num_generations"], max_completion_length=job["max_completion_length"],
                      loss_type="dapo", beta=0.0, bf16=job["precision"] == "bf16",
                      use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no", eval_strategy="no",
                      logging_steps=1, seed=7)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          reward_funcs=[getattr(grpo_rewards, name) for name in REWARDS])
    clock = {"generation": 0.0, "tokens": 0}
    make = trainer._generate_and_score_completions

    def timed_generation(inputs):
        begin = time.perf_counter()
        made = make(inputs)
        clock["generation"] += time.perf_counter() - begin
        clock["tokens"] += int(made["completion_mask"].sum())
        return made

    trainer._generate_and_score_completions = timed_generation
    rewards = []

    class Rewards(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer.add_callback(Rewards())
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generation_seconds": clock["generation"], "steps": output.global_step,
            "completions": output.global_step * per_step, "completion_tokens": clock["tokens"],
            "first_reward": rewards[0] if rewards else None, "last_reward": rewards[-1] if rewards else None}


if __name__ == "__main__":
    main()
