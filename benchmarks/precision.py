"""The quickstart at four precisions, side by side: what `bf16` costs and buys.

Each variant is `tuneloop train examples/quickstart.yml` in its own fresh process (the same rows, packing, seed and
steps), interleaved A B C D, A B C D ... for `--rounds` rounds:

  fp32        `bf16: false`: fp32 weights, fp32 compute
  autocast    `bf16: true, master_weights: false`: fp32 weights that autocast casts to bf16 in every forward and
              backward (tuneloop's bf16 before master weights)
  masters     `bf16: true` (the default's meaning under `bf16: auto` on a machine with native bf16): bf16 compute
              weights, fp32 masters stepped by the optimizer, fp32 gradients (engines/masters.py)
  pure_bf16   `bfloat16: true`: bf16 weights and bf16 optimizer updates, no fp32 copy (axolotl's `bf16: true`)
  auto        `bf16: true` with `master_weights: auto`, the default: masters for a full fine-tune; beside an adapter
              (`--set adapter=lora ...`, against `autocast`) the frozen base's projections held in bf16

Throughput is tuneloop's own: real tokens/s over the training loop after its first step (summary.json; the
evals between steps are in the time, alike in every variant). Ratios are taken within each round, then the median. The eval loss is
the run's last; peak RSS is the process's.

    python benchmarks/precision.py                 # 2 rounds (~10 min on 2 cores)
    python benchmarks/precision.py --rounds 1 --max-steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from quickstart_runs import train_quickstart
VARIANTS = {
    "fp32": ["bf16=false"],
    "autocast": ["bf16=true", "master_weights=false"],
    "masters": ["bf16=true", "master_weights=true"],
    "pure_bf16": ["bf16=true", "bfloat16=true"],
    "auto": ["bf16=true"],
}


def run(variant: str, workdir: Path, max_steps: int | None, extra: list[str]) -> dict:
    return train_quickstart(variant, [*VARIANTS[variant], *extra], workdir, max_steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None, help="fewer steps than the quickstart's 14")
    parser.add_argument("--variants", default="fp32,autocast,masters,pure_bf16", help="a comma-separated subset (autocast, if given, "
                        "and fp32 are the ratios' references)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every variant")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {name: [] for name in args.variants.split(",")}
    with tempfile.TemporaryDirectory(prefix="tuneloop-precision-") as folder:
        for round_index in range(args.rounds):
            for name in runs:
                result = run(name, Path(folder), args.max_steps, args.set)
                runs[name].append(result)
                print(f"round {round_index + 1} {name:<10} {result['tokens_per_second']:7.1f} real tok/s, eval loss "
                      f"{result['eval_loss']:.5f}, peak RSS {result['peak_rss_gb']:.2f} GB", flush=True)

    def ratio(name: str, reference: str) -> float:
        if reference not in runs:
            return float("nan")
        return statistics.median(a["tokens_per_second"] / b["tokens_per_second"]
                                 for a, b in zip(runs[name], runs[reference]))

    fp32_loss = statistics.median(r["eval_loss"] for r in runs.get("fp32", runs[next(iter(runs))]))
    print(f"\nthe quickstart (embedded SmolLM2-135M, packed){' with ' + ', '.join(args.set) if args.set else ''}, "
          f"{args.rounds} interleaved round(s), {os.cpu_count()} cores; real tokens/s after the first step; "
          f"eval loss against {'fp32' if 'fp32' in runs else next(iter(runs))}'s")
    head = f"{'variant':<11}{'real tok/s':>16}{'x autocast':>11}{'x fp32':>8}{'MFU':>7}{'eval loss':>11}" \
           f"{'vs fp32':>9}{'peak RSS GB':>12}{'plan GB':>8}"
    print(head + "\n" + "-" * len(head))
    rows = []
    for name, got in runs.items():
        speeds = [r["tokens_per_second"] for r in got]
        loss = statistics.median(r["eval_loss"] for r in got)
        mfu = statistics.median(r["mfu"] for r in got) if got[0]["mfu"] is not None else None
        row = {"variant": name, "precision": got[0]["precision"], "tokens_per_second": speeds,
               "x_autocast": round(ratio(name, "autocast"), 3), "x_fp32": round(ratio(name, "fp32"), 3),
               "mfu": mfu, "eval_loss": loss, "eval_loss_vs_fp32": round(loss / fp32_loss - 1, 5),
               "peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in got), "estimated_gb": got[0]["estimated_gb"]}
        rows.append(row)
        print(f"{name:<11}{', '.join(f'{s:.0f}' for s in speeds):>16}{row['x_autocast']:>11.2f}{row['x_fp32']:>8.2f}"
              f"{'' if mfu is None else f'{100 * mfu:.1f}%':>7}{loss:>11.4f}{100 * row['eval_loss_vs_fp32']:>8.2f}%"
              f"{row['peak_rss_gb']:>12.2f}{row['estimated_gb']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
