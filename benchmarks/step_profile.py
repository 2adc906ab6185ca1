"""Where a quickstart step's time goes, by kind of operator: torch.profiler over a few steady steps of the real
run (`tuneloop.run.TrainingSession`, watched through its hooks: nothing of tuneloop is patched).

The profiler starts when the `--skip`-th optimizer step ends (the first step warms allocators and caches) and
stops after `--steps` more. Operators are grouped by name: matmuls (mm/addmm: the
projections and the loss's products), attention (SDPA's kernels, and bmm: the math kernel's products), the loss's
other work (log-softmax, gather, scatter, the selection of trained positions), casts and copies, the optimizer,
gradient clipping's norms, and the elementwise rest (norms, activations, rotary, residuals, autograd's
bookkeeping). Self CPU time, so nothing is counted twice; names are a rough guide, not a call tree. On a GPU the
same groups add up self device time instead (the kernels each operator launched), and `--kernels N` prints the N
kernels with the most device time.

    python benchmarks/step_profile.py                      # the quickstart at its defaults, steps 3-6
    python benchmarks/step_profile.py --set attn_implementation=sdpa --set sequence_len=1024
    python benchmarks/step_profile.py --config my_run.yml --top 20
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GROUPS = [  # (group, the operator names' parts that put an operator in it), first match wins
    # (a LLaMA's projections are mm/addmm; bmm is attention's own products, in SDPA's math kernel)
    ("attention", ("scaled_dot_product", "flash_attention", "varlen", "_softmax_backward_data", "aten::_softmax",
                   "aten::bmm")),
    ("loss (besides its matmuls)", ("log_softmax", "gather", "scatter", "index_select", "index_copy", "nonzero")),
    ("optimizer", ("adam", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")),
    ("clipping", ("norm", "clamp")),
    ("matmuls (the loss's included)", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("casts and copies", ("copy_", "_to_copy", "aten::to", "contiguous", "clone")),
]


def group_of(name: str) -> str:
    for group, parts in GROUPS:
        if any(part in name for part in parts):
            return group
    return "elementwise and the rest"


def main(argv=None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tuneloop.host.import_noise import quiet_import_noise
    from tuneloop.config import load_run_config
    from tuneloop.run import TrainingSession
    from tuneloop.train.hooks import RunHooks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--config", default=str(REPO / "examples" / "quickstart.yml"),
                        help="the run to profile (default: the quickstart)")
    parser.add_argument("--top", type=int, default=0, help="also print the N operators with the most self time")
    parser.add_argument("--shapes", type=int, default=0,
                        help="also print the N (operator, input shapes) pairs with the most self time")
    parser.add_argument("--kernels", type=int, default=0, help="on a GPU: also print the N kernels with the most "
                        "device time")
    args = parser.parse_args(argv)
    quiet_import_noise()  # (as the command does: torchao's kernels failing to load on a CPU, host/import_noise.py)

    class Profiling(RunHooks):
        def __init__(self):
            self.steps, self.profiler, self.inside, self.wall = 0, None, None, 0.0

        def phase(self, name: str):
            if name == "zero_grad":  # the step's last phase
                self.steps += 1
                if self.steps == args.skip:
                    self.profiler = profile(activities=activities, record_shapes=bool(args.shapes))
                    self.profiler.__enter__()
                    self.wall = time.perf_counter()
                elif self.steps == args.skip + args.steps and self.profiler is not None:
                    if cuda:
                        torch.cuda.synchronize()
                    self.wall = time.perf_counter() - self.wall
                    self.profiler.__exit__(None, None, None)
                    self.inside = self.profiler
            return super().phase(name)

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    measure = "self_device_time_total" if cuda else "self_cpu_time_total"
    hooks = Profiling()
    with tempfile.TemporaryDirectory(prefix="tuneloop-profile-") as folder:
        overrides = [*args.set, f"output_dir={folder}/out", "eval_on_start=false", "evals_per_epoch=0",
                     f"max_steps={args.skip + args.steps + 1}", "torch_compile=false"]
        with TrainingSession(load_run_config(args.config, overrides), hooks) as session:
            result = session.run(overwrite=True)
    if result.error is not None or hooks.inside is None:
        raise SystemExit(f"the run did not reach the profiled steps: {result.error}")
    totals: dict[str, float] = {}
    averages = hooks.inside.key_averages()
    for event in averages:
        if event.key.startswith("aten::") or "adam" in event.key:
            totals[group_of(event.key)] = totals.get(group_of(event.key), 0.0) + getattr(event, measure)
    whole = sum(totals.values())
    if args.top:
        print(averages.table(sort_by=measure, row_limit=args.top))
    if args.shapes:
        print(hooks.inside.key_averages(group_by_input_shape=True).table(
            sort_by=measure, row_limit=args.shapes, max_name_column_width=40, max_shapes_column_width=90))
    if cuda and args.kernels:  # device-side events: the kernels themselves, whichever operator launched them
        kernels = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.self_device_time_total)
        for event in kernels[:args.kernels]:
            print(f"  {event.self_device_time_total / 1e3 / args.steps:8.2f} ms a step  {event.count // args.steps:5d}x"
                  f"  {event.key[:110]}")
    run = "the quickstart" if Path(args.config).resolve() == REPO / "examples" / "quickstart.yml" else args.config
    print(f"\nsteps {args.skip + 1}-{args.skip + args.steps} of {run}{' with ' + ', '.join(args.set) if args.set else ''}"
          f" ({torch.cuda.get_device_name(0) if cuda else f'{torch.get_num_threads()} threads'}), "
          f"self {'device' if cuda else 'CPU'} time of torch's operators: "
          f"{whole / 1e6 / args.steps:.3f} s a step, {hooks.wall / args.steps:.3f} s a step by the clock (profiled)")
    for group, micros in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {group:<26}{100 * micros / whole:5.1f}%  {micros / 1e6 / args.steps:6.3f} s a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
