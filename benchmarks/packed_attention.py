"""Packed rows under one mask against each sequence on its own (kernels/packed_attention.py), side by side.

Each variant is `tuneloop train examples/quickstart.yml` in its own fresh process (the same rows, packing, seed,
precision and steps), interleaved A B, A B ... for `--rounds` rounds:

  per_sequence  the default on a CPU: SDPA over each packed sequence apart where that is cheaper
  masked        `attn_implementation: sdpa`: transformers' SDPA over whole rows under the block-diagonal mask

Presets (`--preset`, repeatable): `quickstart` (its own 4 × 256-token rows), `long_rows` (1 × 1024-token rows:
the same tokens per step, sequences of 39–109 tokens packed ~14 to a row). Ratios are taken within each round,
then the median; the plan's own line says how many micro-batches split.

    python benchmarks/packed_attention.py                      # both presets, 2 rounds (~12 min on 2 cores)
    python benchmarks/packed_attention.py --preset long_rows --rounds 1
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

VARIANTS = {"per_sequence": [], "masked": ["attn_implementation=sdpa"]}
PRESETS = {"quickstart": [], "long_rows": ["sequence_len=1024", "micro_batch_size=1"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--preset", action="append", choices=PRESETS, help="default: all")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every variant")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    rows = []
    for preset in args.preset or list(PRESETS):
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        with tempfile.TemporaryDirectory(prefix="tuneloop-attention-") as folder:
            for round_index in range(args.rounds):
                for name, sets in VARIANTS.items():
                    result = train_quickstart(name, [*PRESETS[preset], *sets, *args.set], Path(folder),
                                              args.max_steps)
                    runs[name].append(result)
                    print(f"{preset} round {round_index + 1} {name:<13} {result['tokens_per_second']:7.1f} real "
                          f"tok/s, eval loss {result['eval_loss']:.5f}, peak RSS {result['peak_rss_gb']:.2f} GB",
                          flush=True)
        split = runs["per_sequence"][0]["plan"].get("attention_split")
        speedup = statistics.median(a["tokens_per_second"] / b["tokens_per_second"]
                                    for a, b in zip(runs["per_sequence"], runs["masked"]))
        rows.append({"preset": preset, "precision": runs["masked"][0]["precision"], "split": split,
                     "x_masked": round(speedup, 3),
                     **{f"{name}_tokens_per_second": [r["tokens_per_second"] for r in got] for name, got in
                        runs.items()},
                     **{f"{name}_eval_loss": statistics.median(r["eval_loss"] for r in got) for name, got in
                        runs.items()},
                     **{f"{name}_peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in got) for name, got in
                        runs.items()}})
    print(f"\nthe quickstart's rows packed, {args.rounds} interleaved round(s), {os.cpu_count()} cores; real "
          "tokens/s after the first step")
    for row in rows:
        print(f"\n{row['preset']} ({row['precision']})\n  plan: {row['split']}")
        for name in VARIANTS:
            print(f"  {name:<13} {', '.join(f'{s:.0f}' for s in row[name + '_tokens_per_second']):>14} real tok/s"
                  f"  eval loss {row[name + '_eval_loss']:.4f}  peak RSS {row[name + '_peak_rss_gb']:.2f} GB")
        print(f"  per_sequence × masked: {row['x_masked']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
