"""How `tuneloop preprocess` scales: N synthetic alpaca rows, prepared with 1 process and with every core,
in interleaved rounds; rows/s and peak memory (summed over the process and its workers) for each.

    python benchmarks/prepare_scale.py --rows 1000000 [--rounds 2] [--processes 1,2] [--json FILE]

The rows are generated from a seed, never stored in the repository: each is an instruction, an optional
input and an output recombined from the embedded chatterbot conversations and numbered, so every row is
unique; outputs are sized to give rows of about 100-200 tokens with SmolLM2's tokenizer. Each timing is a
fresh `tuneloop preprocess --force` (tokenizer load and cache write included) in its own process; memory is
sampled from /proc every 50 ms: RSS summed over the process tree (shared pages count once per process,
so it overstates), and PSS (shared pages split between the processes that map them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def conversation_turns() -> list[str]:
    from tuneloop.demo.embedded import ensure_embedded_dataset

    turns = []
    for line in ensure_embedded_dataset().read_text().splitlines():
        turns += [message["content"] for message in json.loads(line)["messages"] if message["content"].strip()]
    return turns


def synthetic_rows(count: int, seed: int, path: Path) -> Path:
    """`count` alpaca rows, written as JSON lines to `path` (about 650 bytes a row)."""
    rng = random.Random(seed)
    turns = conversation_turns()
    with open(path, "w") as handle:
        for number in range(count):
            instruction = f"({number}) {rng.choice(turns)} {rng.choice(turns)}"
            given = rng.choice(turns) if rng.random() < 0.4 else ""
            words, output = rng.randint(25, 65), []
            while sum(len(text.split()) for text in output) < words:
                output.append(rng.choice(turns))
            handle.write(json.dumps({"instruction": instruction, "input": given, "output": " ".join(output)}) + "\n")
    return path


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes of `pid` and its descendants, now."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    rss = pss = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        stack += children.get(current, [])
        try:
            for line in open(f"/proc/{current}/smaps_rollup"):
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def timed_preprocess(config: Path, processes: int) -> dict:
    command = [sys.executable, "-m", "tuneloop", "preprocess", str(config), "--force",
               "--set", f"dataset_processes={processes}"]
    peak = {"rss": 0, "pss": 0}
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))

    def sample() -> None:
        while child.poll() is None:
            rss, pss = tree_memory(child.pid)
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"preprocess failed ({child.returncode}):\n{err[-3000:]}")
    return {"seconds": seconds, "peak_rss_gb": peak["rss"] / 1e9, "peak_pss_gb": peak["pss"] / 1e9,
            "said": out.strip().splitlines()[-1] if out.strip() else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", default=f"1,{len(os.sched_getaffinity(0))}",
                        help="process counts to compare, comma-separated (default: 1 and every core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequence-len", type=int, default=1024)
    parser.add_argument("--val-set-size", type=float, default=0.05, help="held out, as most configs do (0.05)")
    parser.add_argument("--workdir", help="where the rows and caches go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    counts = [int(n) for n in args.processes.split(",")]

    from tuneloop.demo.embedded import ensure_embedded_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tuneloop-prepare-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / f"alpaca-{args.rows}-seed{args.seed}.jsonl"
    if not data.exists():
        started = time.perf_counter()
        synthetic_rows(args.rows, args.seed, data)
        print(f"generated {args.rows} rows ({data.stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    config = workdir / "prepare.yml"
    config.write_text(yaml.safe_dump({
        "base_model": str(ensure_embedded_model()), "datasets": [{"path": str(data), "type": "alpaca"}],
        "dataset_prepared_path": str(workdir / "prepared"), "output_dir": str(workdir / "out"),
        "sequence_len": args.sequence_len, "sample_packing": True, "micro_batch_size": 1,
        "val_set_size": args.val_set_size}))

    results = {count: [] for count in counts}
    for round_index in range(args.rounds):
        for count in counts:  # interleaved: each round runs every process count once
            result = timed_preprocess(config, count)
            results[count].append(result)
            print(f"round {round_index + 1}, {count} process{'es' if count > 1 else ''}: {result['seconds']:.1f} s, "
                  f"{args.rows / result['seconds']:,.0f} rows/s, peak RSS {result['peak_rss_gb']:.2f} GB (summed), "
                  f"PSS {result['peak_pss_gb']:.2f} GB", flush=True)
    plan_seconds = time_plan(config)
    summary = {"rows": args.rows, "data_mb": round(data.stat().st_size / 1e6, 1), "plan_seconds": plan_seconds,
               "by_processes": {}}
    print(f"\n{args.rows:,} rows, sequence_len {args.sequence_len}, packing, val_set_size {args.val_set_size:g}; "
          f"medians of {args.rounds} rounds")
    print("| processes | wall | rows/s | peak RSS (summed) | peak PSS |")
    print("|---|---|---|---|---|")
    for count, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        row = {"seconds": round(seconds, 1), "rows_per_second": round(args.rows / seconds),
               "peak_rss_gb": round(max(r["peak_rss_gb"] for r in runs), 2),
               "peak_pss_gb": round(max(r["peak_pss_gb"] for r in runs), 2)}
        summary["by_processes"][count] = row
        print(f"| {count} | {seconds:.1f} s | {row['rows_per_second']:,} | {row['peak_rss_gb']:.2f} GB | "
              f"{row['peak_pss_gb']:.2f} GB |")
    print(f"`tuneloop plan` on the prepared cache: {plan_seconds:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not args.keep and not args.workdir:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def time_plan(config: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tuneloop", "plan", str(config)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise SystemExit(f"plan failed:\n{done.stderr[-3000:]}")
    return round(time.perf_counter() - started, 1)


if __name__ == "__main__":
    main()
