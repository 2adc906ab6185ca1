"""QLoRA against LoRA against a full fine-tune, on the embedded SmolLM2-135M and the quickstart's rows.

Each variant is `tuneloop train examples/quickstart.yml` with the same packed rows, micro-batch, steps and seed, in
its own fresh process, interleaved A B C, A B C ... for `--repeats` rounds; evals and saves are off, so the run is
the training loop. Each row says its precision:

  full    every weight trained, AdamW; bf16 autocast over fp32 weights where the CPU has bf16 (`bf16: auto`)
  lora    LoRA r=16 on every linear layer, the base in fp32 under the same autocast
  qlora   the same LoRA on the base in NF4 (double quantization, bf16 compute: QLoRA's own settings), through
          bitsandbytes (its CPU backend on a machine without a GPU)

From each run's summary.json: real (non-pad) tokens per second after the first step, the peak host RSS (on a GPU
the peak CUDA allocation) and the plan's estimate.

    python benchmarks/qlora.py                 # 8 steps, 2 rounds (about 6 minutes on 2 cores)
    python benchmarks/qlora.py --steps 4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yml"
LORA = ["adapter=lora", "lora_r=16", "lora_alpha=32", "lora_dropout=0.0", "lora_target_linear=true",
        "learning_rate=2.0e-4"]
VARIANTS = {
    "full": [],
    "lora": LORA,
    "qlora": [*LORA, "adapter=qlora", "load_in_4bit=true"],
}


def run(variant: str, steps: int, work: Path) -> dict:
    out = work / f"{variant}-out"
    settings = [*VARIANTS[variant], f"max_steps={steps}", "val_set_size=0", "eval_on_start=false",
                "save_strategy=no", f"output_dir={out}", f"dataset_prepared_path={work / 'prepared'}"]
    command = [sys.executable, "-m", "tuneloop", "train", str(QUICKSTART), "--overwrite"]
    for setting in settings:
        command += ["--set", setting]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{variant}: tuneloop train failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    peak = summary["peak_memory_gb"]
    return {"variant": variant, "precision": plan["resolved"]["precision"]["mixed"],
            "tokens_per_second": summary["real_tokens_per_second_after_first_step"],
            "peak_gb": peak["cuda_allocated"] if peak["cuda_allocated"] is not None else peak["host_rss"],
            "estimated_gb": peak["estimated"], "trained_parameters": plan["memory"]["trainable_parameters"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.repeats):
            for variant in VARIANTS:
                rows[variant].append(run(variant, args.steps, Path(work)))
                print(json.dumps({"round": round_, **rows[variant][-1]}), flush=True)
    print("\n| variant | precision | trained parameters | real tokens/s (median; rounds) | peak memory GB | "
          "plan estimate GB |\n|---|---|---|---|---|---|")
    for variant, runs in rows.items():
        print(f"| {variant} | {runs[0]['precision']} | {runs[0]['trained_parameters']:,} | "
              f"{statistics.median(r['tokens_per_second'] for r in runs):.1f} "
              f"({', '.join(str(r['tokens_per_second']) for r in runs)}) | "
              f"{max(r['peak_gb'] for r in runs):.2f} | {runs[0]['estimated_gb']:.2f} |")


if __name__ == "__main__":
    main()
