"""tuneloop side by side with axolotl: the same packed run, each tool at its own bf16, in interleaved rounds.

The run: the embedded SmolLM2-135M-Instruct (`tuneloop setup`'s folder), the quickstart's conversations (every 8th
chatterbot conversation, written once as a jsonl of `messages` that both tools read with `type: chat_template`),
`sequence_len` 256, `sample_packing: true`, 4 rows a micro-batch, no accumulation, learning rate 1e-4 on a cosine
schedule with 10% warm-up, `adamw_torch_fused`, seed 42, `--steps` optimizer steps, no evals, no checkpoints. Each
tool runs in a fresh process of its own venv with OMP_NUM_THREADS=2 (`--threads`) and HF_HUB_OFFLINE=1, alternating
tuneloop, axolotl, tuneloop, axolotl ... for `--rounds` rounds; both datasets are tokenized once before the rounds
(`tuneloop preprocess`, `python -m axolotl.cli.preprocess`), so every timed run reads its own tool's cache.

Precision, each tool at its bf16:
  tuneloop  `bf16: auto`: on a CPU with native bf16, bf16 compute weights with fp32 master weights, fp32 gradients
            and an fp32 optimizer state (the plan's precision line is printed with the results).
  axolotl   axolotl's `bf16: auto` asks `is_torch_bf16_gpu_available()`, which is False on a CPU, and then turns on
            fp16 (`resolve_dtype`): not its bf16 at all. So axolotl gets `bf16: true` (`--axolotl-bf16 auto` runs its
            auto instead): the model is loaded in bf16 (`torch_dtype` bfloat16) and the Trainer runs with bf16=True
            (autocast): bf16 weights, gradients and AdamW state, no fp32 master copy, except the embedding (tied to
            the head here: 28.3M of 134.5M parameters), which axolotl upcasts to fp32 for full fine-tuning
            (`_convert_embedding_modules_dtype`; the parameter count per dtype is printed). On a
            CPU transformers refuses `bf16=True` unless `use_cpu` is set, which axolotl never does: the plugin below
            returns `use_cpu: True` from `get_training_args` when there is no GPU (nothing else changes).
  Attention: axolotl `attn_implementation: sdpa` (flash attention needs CUDA; axolotl drops the attention mask and
  transformers builds the block-diagonal mask from the packed position_ids); tuneloop its default on a CPU (each
  packed sequence attended on its own). axolotl's warnings that bf16 "requires Ampere" and that packing with sdpa
  in bf16 "may result in 0.0 loss" are about GPUs; the printed losses show whether it trained.

axolotl is installed into its own venv (`--venv`, default ~/.cache/tuneloop/axolotl-venv, reused when it imports
axolotl beside torch 2.13.0): torch==2.13.0 first (the CPU wheel on this machine's disk), then the newest axolotl
PyPI offers, then older ones, each with a constraints file pinning torch==2.13.0 so no dependency replaces it. pip's
output goes to `<venv>.log`. When no release installs and imports, the script prints "skipped: axolotl could not be
installed: <pip's error>" and exits 0.

What is measured, per run:
  real tokens/s  the real (non-padding) tokens of the trained micro-batches over the time from the end of the first
                 optimizer step to the end of the last one. tuneloop: its own figure (summary.json's
                 `real_tokens_per_second_after_first_step`: the rows' lengths in each packed micro-batch). axolotl:
                 a plugin (written next to its config, named under `plugins:`) wraps `trainer.training_step` to count
                 each micro-batch's non-padding positions (axolotl's packed batches hold input_ids, labels and
                 position_ids, no attention mask: each packed sequence restarts position_ids at 0, and the padding at
                 a row's end is a segment of pad ids numbered 0, 1, 2 ... too, so every segment but those of pad ids
                 alone counts; with an attention mask its non-zero entries would) and adds a TrainerCallback that
                 records perf_counter at `on_step_end` and the logged losses; tuneloop's formula is applied to them:
                 the tokens of steps 2..N over the time from step 1's end to step N's.
  first step     wall seconds from starting the process to the first optimizer step's record appearing on disk
                 (tuneloop's first metrics.jsonl line, the plugin's first step line; polled every 50 ms): imports,
                 model load, data loading and the first step, as a user waits for them.
  peak memory    the process tree's peak resident memory: the larger of the summed RSS of the child and all its
                 descendants (read from /proc every 0.5 s) and the child's ru_maxrss from wait4 (which also covers
                 peaks between two polls).
  final loss     the last logged train loss (tuneloop's metrics.jsonl, axolotl's `on_log`): a sanity check that both
                 trained, not a quality comparison (different packing, different precision).
Ratios (tuneloop / axolotl for tokens/s and memory, axolotl / tuneloop for the time to the first step) are taken
within each round, then the median.

    python benchmarks/axolotl_peer.py                       # 2 rounds of 12 steps (installs axolotl the first time)
    python benchmarks/axolotl_peer.py --rounds 3 --steps 14 --json peer.json
    python benchmarks/axolotl_peer.py --quick               # 1 round of 4 steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"
DEFAULT_VENV = Path(os.environ.get("TUNELOOP_CACHE") or Path.home() / ".cache" / "tuneloop") / "axolotl-venv"
FALLBACKS = 2  # older axolotl releases tried after the newest, when the newest cannot be installed beside torch 2.13.0
POLL_SECONDS = 0.05  # the first step's record looked for this often
RSS_SECONDS = 0.5  # the process tree's RSS summed this often (wait4's ru_maxrss covers what happens between)

SHARED = {  # the run both tools are given, in axolotl's key names (tuneloop reads the same keys)
    "sequence_len": 256,
    "sample_packing": True,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_epochs": 1,
    "learning_rate": 1.0e-4,
    "lr_scheduler": "cosine",
    "warmup_ratio": 0.1,
    "optimizer": "adamw_torch_fused",
    "val_set_size": 0,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 42,
}

PLUGIN = '''"""Written by benchmarks/axolotl_peer.py: counts the real tokens of each micro-batch axolotl trains on and
records each optimizer step's end (perf_counter) and each logged loss, one JSON line each, in $AXOLOTL_PEER_STEPS."""
import json
import os
import time

from transformers import TrainerCallback

from axolotl.integrations.base import BasePlugin

class _Counts:
    def __init__(self):
        self.real = 0  # non-padding positions since the last optimizer step
        self.targets = 0  # positions with a label
        self.batch = None  # the first micro-batch's keys and shapes


def _real_tokens(inputs, pad_id):
    """The micro-batch's non-padding positions. With a per-token attention mask: its non-zero entries. Without one
    (axolotl drops it under sdpa and marks the packed sequences by position_ids restarting at 0; the collator pads
    each row with pad ids whose position_ids are 0, 1, 2, ... too): every position but those of the segments made of
    pad ids alone (a real sequence starts with the chat template's first token, never the pad id)."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None and tuple(mask.shape) == tuple(ids.shape):
        return int((mask != 0).sum())
    positions = inputs.get("position_ids")
    if positions is None or pad_id is None:
        return int(ids.numel())  # (nothing tells padding apart: every position counts)
    real = 0
    for row, places in zip(ids.tolist(), positions.reshape(ids.shape).tolist()):
        starts = [i for i, p in enumerate(places) if p == 0] + [len(row)]
        if starts[0] != 0:
            starts.insert(0, 0)
        for begin, end in zip(starts, starts[1:]):
            if any(token != pad_id for token in row[begin:end]):
                real += end - begin
    return real


class _Recorder(TrainerCallback):
    def __init__(self, counts):
        self.counts = counts
        self.handle = open(os.environ["AXOLOTL_PEER_STEPS"], "a", buffering=1)

    def _write(self, record):
        self.handle.write(json.dumps(record) + "\\n")
        self.handle.flush()

    def on_train_begin(self, args, state, control, **kwargs):
        self._write({"event": "train_begin", "perf": time.perf_counter(), "bf16": bool(args.bf16),
                     "fp16": bool(args.fp16)})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        record = {"event": "step", "step": state.global_step, "perf": time.perf_counter(),
                  "real_tokens": self.counts.real, "targets": self.counts.targets}
        if self.counts.batch is not None:
            dtypes = {}
            for parameter in model.parameters() if model is not None else []:
                dtypes[str(parameter.dtype)] = dtypes.get(str(parameter.dtype), 0) + parameter.numel()
            record.update(batch=self.counts.batch, parameter_dtypes=dtypes)
            self.counts.batch = None
        self._write(record)
        self.counts.real = self.counts.targets = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._write({"event": "log", "step": state.global_step, "loss": logs["loss"]})

    def on_train_end(self, args, state, control, **kwargs):
        self._write({"event": "train_end", "perf": time.perf_counter()})


class PeerPlugin(BasePlugin):
    def __init__(self):
        super().__init__()
        self.counts = _Counts()
        self.first = True

    def get_training_args(self, cfg):
        # transformers refuses bf16=True without a GPU unless use_cpu is set, and axolotl never sets it
        import torch
        return None if torch.cuda.is_available() else {"use_cpu": True}

    def post_trainer_create(self, cfg, trainer):
        original = trainer.training_step
        counts = self.counts
        pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)

        def training_step(model, inputs, *args, **kwargs):
            counts.real += _real_tokens(inputs, pad_id)
            labels = inputs.get("labels")
            if labels is not None:
                counts.targets += int((labels != -100).sum())
            if self.first:
                counts.batch = {k: list(v.shape) for k, v in inputs.items() if hasattr(v, "shape")}
                self.first = False
            return original(model, inputs, *args, **kwargs)

        trainer.training_step = training_step

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_Recorder(self.counts)]
'''


class Skip(Exception):
    """axolotl could not be installed or imported: the reason, in a line."""


# --------------------------------------------------------------------------- axolotl's venv


def _pip_error(log: Path) -> str:
    """The pip log's error in a line or two (the last ERROR lines), for the skip message."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [line.strip() for line in lines if line.startswith("ERROR")]
    return " / ".join(errors[-3:]) if errors else (lines[-1].strip() if lines else "no output")


def _venv_works(python: Path) -> str | None:
    """axolotl's version when `python` imports axolotl's trainer beside torch 2.13.0, else None."""
    if not python.is_file():
        return None
    check = ("import torch, axolotl, axolotl.cli.train, axolotl.cli.preprocess; "
             f"assert torch.__version__.split('+')[0] == {TORCH_PIN.split('==')[1]!r}, torch.__version__; "
             "print(axolotl.__version__)")
    done = subprocess.run([str(python), "-c", check], capture_output=True, text=True, env=_quiet_env())
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def _quiet_env(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               WANDB_MODE="disabled", AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def ensure_axolotl(venv: Path) -> tuple[Path, str]:
    """(the venv's python, axolotl's version), installing the first time; raises Skip saying why not."""
    python = venv / "bin" / "python"
    version = _venv_works(python)
    if version:
        return python, version
    log = venv.with_name(venv.name + ".log")
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing axolotl into {venv} (a few minutes; pip's output in {log}) ...", flush=True)
    constraints = venv.with_name(venv.name + "-constraints.txt")
    constraints.write_text(TORCH_PIN + "\n")
    # a pip config may already name a constraints file (this machine's caps the torch releases on its disk):
    # PIP_CONSTRAINT replaces the config's value, so both are passed
    configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.constraint"],
                                capture_output=True, text=True).stdout.split()
    pip_env = _quiet_env(PIP_CONSTRAINT=" ".join([*configured, str(constraints)]), PIP_DISABLE_PIP_VERSION_CHECK="1")
    with log.open("w") as out:
        def pip(*args: str) -> int:
            out.write(f"\n$ pip {' '.join(args)}\n")
            out.flush()
            return subprocess.run([str(python), "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT,
                                  env=pip_env).returncode

        if not python.is_file() or subprocess.run([str(python), "-c", "pass"]).returncode != 0:
            made = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], stdout=out,
                                  stderr=subprocess.STDOUT)
            if made.returncode != 0:
                raise Skip(f"python -m venv {venv} failed (see {log})")
        if pip("install", TORCH_PIN) != 0:
            raise Skip(f"pip install {TORCH_PIN}: {_pip_error(log)} (log: {log})")
        releases = subprocess.run([str(python), "-m", "pip", "index", "versions", "axolotl"], capture_output=True,
                                  text=True, env=pip_env).stdout
        listed = next((line.split(":", 1)[1] for line in releases.splitlines()
                       if line.startswith("Available versions:")), "")
        candidates = [f"axolotl=={v.strip()}" for v in listed.split(",") if v.strip()][:1 + FALLBACKS] or ["axolotl"]
        errors = []
        for spec in candidates:
            print(f"  pip install {spec} (torch pinned to {TORCH_PIN.split('==')[1]}) ...", flush=True)
            if pip("install", spec) == 0:
                version = _venv_works(python)
                if version:
                    return python, version
                errors.append(f"{spec} installed but does not import beside {TORCH_PIN}")
            else:
                errors.append(f"{spec}: {_pip_error(log)}")
    raise Skip("; ".join(errors) + f" (log: {log})")


# --------------------------------------------------------------------------- the run's inputs


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return name


def build_inputs(workdir: Path) -> tuple[Path, Path]:
    """The embedded model's folder (built as `tuneloop setup` builds it, if it is not there yet) and the quickstart's
    rows (every 8th conversation: `dataset_shard_num: 8, dataset_shard_idx: 0`) as a jsonl of `messages`."""
    from tuneloop.demo.embedded import ensure_embedded_dataset, ensure_embedded_model

    model = ensure_embedded_model()
    rows = ensure_embedded_dataset().read_text().splitlines()[0::8]
    data = workdir / "quickstart_rows.jsonl"
    data.write_text("".join(json.dumps({"messages": json.loads(r)["messages"]}) + "\n" for r in rows))
    return model, data


def write_configs(workdir: Path, model: Path, data: Path, steps: int, axolotl_bf16,
                  tuneloop_keys: dict | None = None) -> dict[str, Path]:
    common = {"base_model": str(model), "datasets": [{"path": str(data), "ds_type": "json", "type": "chat_template"}],
              **SHARED, "max_steps": steps}
    configs = {
        "tuneloop": {**common, "bf16": "auto", "dataset_prepared_path": str(workdir / "prepared-tuneloop"),
                     "output_dir": str(workdir / "out-tuneloop"), **(tuneloop_keys or {})},
        "axolotl": {**common, "bf16": axolotl_bf16, "attn_implementation": "sdpa",
                    "dataset_prepared_path": str(workdir / "prepared-axolotl"),
                    "output_dir": str(workdir / "out-axolotl"), "plugins": ["axolotl_peer_plugin.PeerPlugin"],
                    "use_tensorboard": False, "dataloader_num_workers": 0},
    }
    paths = {}
    for tool, cfg in configs.items():
        paths[tool] = workdir / f"{tool}.yml"
        paths[tool].write_text(yaml.safe_dump(cfg, sort_keys=False))
    (workdir / "axolotl_peer_plugin.py").write_text(PLUGIN)
    return paths


# --------------------------------------------------------------------------- one run, watched


def _tree_rss(root: int) -> int:
    """Bytes resident in `root` and all its descendants now."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, parent = int(entry), int(fields[1])
        children.setdefault(parent, []).append(pid)
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def watch(command: list[str], env: dict, cwd: Path, log: Path, first_step_seen) -> dict:
    """Run `command`, polling `first_step_seen()` every POLL_SECONDS and its process tree's RSS every RSS_SECONDS
    (a scan of /proc: kept rare so that the watching takes no CPU worth counting from the run it watches); the wall
    time to the first step, the peak memory, the exit status."""
    with log.open("w") as out:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        first_step, peak_polled, status, usage, next_scan = None, 0, None, None, start
        while status is None:
            now = time.perf_counter()
            if now >= next_scan:
                peak_polled, next_scan = max(peak_polled, _tree_rss(child.pid)), now + RSS_SECONDS
            if first_step is None and first_step_seen():
                first_step = now - start
            pid, wait_status, rusage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                status, usage = os.waitstatus_to_exitcode(wait_status), rusage
                child.returncode = status  # (reaped here: Popen must not wait for it again)
            else:
                time.sleep(POLL_SECONDS)
        wall = time.perf_counter() - start
    if first_step is None and first_step_seen():
        first_step = wall
    maxrss = usage.ru_maxrss * 1024  # kilobytes on Linux
    return {"exit": status, "wall_seconds": round(wall, 2),
            "first_step_wall_seconds": round(first_step, 2) if first_step is not None else None,
            "peak_rss_gb": round(max(peak_polled, maxrss) / 1e9, 3), "peak_rss_polled_gb": round(peak_polled / 1e9, 3),
            "maxrss_gb": round(maxrss / 1e9, 3)}


def _appeared(path: Path, wanted) -> "callable":
    """A cheap poll: True once a line of the jsonl at `path` satisfies `wanted` (the file is parsed only when its
    size changed)."""
    seen = {"size": -1, "found": False}

    def check() -> bool:
        if not seen["found"]:
            try:
                size = path.stat().st_size
            except OSError:
                return False
            if size != seen["size"]:
                seen["size"] = size
                seen["found"] = any(wanted(r) for r in _lines_quiet(path))
        return seen["found"]
    return check


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _failed(tool: str, log: Path) -> SystemExit:
    return SystemExit(f"{tool} failed (log: {log}):\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))


def run_tuneloop(config: Path, workdir: Path, env: dict, index: int) -> dict:
    out = workdir / f"out-tuneloop-{index}"  # a fresh folder: no metrics.jsonl of an earlier round to mistake
    metrics = out / "metrics.jsonl"

    log = workdir / f"tuneloop-{index}.log"
    command = [sys.executable, "-m", "tuneloop", "train", str(config), "--set", f"output_dir={out}"]
    got = watch(command, env, REPO, log, _appeared(metrics, lambda r: "loss" in r))
    if got["exit"] != 0:
        raise _failed("tuneloop", log)
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    train = [m for m in _lines(metrics) if "loss" in m]
    return {**got, "tokens_per_second": summary["real_tokens_per_second_after_first_step"],
            "steps": summary["steps"], "real_tokens": summary["real_tokens"],
            "first_step_loop_seconds": summary["first_step_seconds"], "final_loss": train[-1]["loss"],
            "own_peak_rss_gb": summary["peak_memory_gb"]["host_rss"], "precision": plan["precision"],
            "attention": plan["attention"]}


def _lines_quiet(path: Path) -> list[dict]:
    try:
        return _lines(path)
    except (OSError, ValueError):  # a line being written
        return []


def run_axolotl(python: Path, config: Path, workdir: Path, env: dict, index: int) -> dict:
    steps_file = workdir / f"axolotl-steps-{index}.jsonl"
    steps_file.unlink(missing_ok=True)

    log = workdir / f"axolotl-{index}.log"
    got = watch([str(python), "-m", "axolotl.cli.train", str(config)],
                {**env, "AXOLOTL_PEER_STEPS": str(steps_file), "PYTHONPATH": str(workdir)}, workdir, log,
                _appeared(steps_file, lambda r: r.get("event") == "step"))
    records = _lines(steps_file)
    steps = [r for r in records if r["event"] == "step"]
    if got["exit"] != 0 or len(steps) < 2:
        raise _failed("axolotl", log)
    begin = next(r for r in records if r["event"] == "train_begin")
    losses = [r["loss"] for r in records if r["event"] == "log"]
    after_first = sum(r["real_tokens"] for r in steps[1:]) / (steps[-1]["perf"] - steps[0]["perf"])
    return {**got, "tokens_per_second": round(after_first, 1), "steps": len(steps),
            "real_tokens": sum(r["real_tokens"] for r in steps), "targets": sum(r["targets"] for r in steps),
            "first_step_loop_seconds": round(steps[0]["perf"] - begin["perf"], 3),
            "final_loss": losses[-1] if losses else None, "trainer_bf16": begin["bf16"], "trainer_fp16": begin["fp16"],
            "parameter_dtypes": steps[0].get("parameter_dtypes"), "first_batch": steps[0].get("batch")}


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the rows hold ~14)")
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for both tools")
    parser.add_argument("--axolotl-bf16", default="true", choices=["true", "auto"],
                        help="axolotl's bf16 key (auto means fp16 on a CPU: see above)")
    parser.add_argument("--tuneloop-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a key of tuneloop's config (YAML value), e.g. bfloat16=true: axolotl's bf16 weights")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="axolotl's venv (made the first time)")
    parser.add_argument("--json", type=Path, default=REPO / "outputs" / "axolotl_peer.json")
    parser.add_argument("--keep", type=Path, help="a folder for the configs, logs and outputs (default: temporary)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 4
    if args.steps < 3:
        parser.error("--steps: at least 3 (throughput is taken after the first step)")

    try:
        python, version = ensure_axolotl(args.venv)
    except Skip as reason:
        print(f"skipped: axolotl could not be installed: {reason}")
        return 0

    cpu = machine()
    env = _quiet_env(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    holder = None if args.keep else tempfile.TemporaryDirectory(prefix="tuneloop-axolotl-peer-")
    workdir = args.keep or Path(holder.name)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model, data = build_inputs(workdir)
        axolotl_bf16 = True if args.axolotl_bf16 == "true" else "auto"
        tuneloop_keys = {key: yaml.safe_load(value) for key, _, value in
                         (item.partition("=") for item in args.tuneloop_set)}
        configs = write_configs(workdir, model, data, args.steps, axolotl_bf16, tuneloop_keys)
        print(f"axolotl {version} ({args.venv}); tokenizing once for each tool ...", flush=True)
        for tool, command in (("tuneloop", [sys.executable, "-m", "tuneloop", "preprocess", str(configs["tuneloop"])]),
                              ("axolotl", [str(python), "-m", "axolotl.cli.preprocess", str(configs["axolotl"])])):
            log = workdir / f"{tool}-preprocess.log"
            with log.open("w") as out:
                if subprocess.run(command, env={**env, "PYTHONPATH": str(workdir)} if tool == "axolotl" else env,
                                  cwd=workdir if tool == "axolotl" else REPO, stdout=out,
                                  stderr=subprocess.STDOUT).returncode:
                    raise _failed(f"{tool} preprocess", log)

        runs: dict[str, list[dict]] = {"tuneloop": [], "axolotl": []}
        for index in range(args.rounds):
            for tool in runs:
                if tool == "tuneloop":
                    got = run_tuneloop(configs[tool], workdir, env, index)
                else:
                    got = run_axolotl(python, configs[tool], workdir, env, index)
                runs[tool].append(got)
                print(f"round {index + 1} {tool:<9}{got['tokens_per_second']:8.1f} real tok/s after the first step, "
                      f"first step at {got['first_step_wall_seconds']:.1f} s, peak RSS {got['peak_rss_gb']:.2f} GB, "
                      f"final loss {got['final_loss']:.4f}", flush=True)
    finally:
        if holder is not None:
            holder.cleanup()

    def per_round(key: str, numerator: str, denominator: str) -> list[float]:
        return [round(a[key] / b[key], 3) for a, b in zip(runs[numerator], runs[denominator])]

    ratios = {"tokens_per_second": per_round("tokens_per_second", "tuneloop", "axolotl"),
              "first_step_sooner": per_round("first_step_wall_seconds", "axolotl", "tuneloop"),
              "peak_rss": per_round("peak_rss_gb", "tuneloop", "axolotl")}
    medians = {key: round(statistics.median(values), 3) for key, values in ratios.items()}
    t, a = runs["tuneloop"][0], runs["axolotl"][0]
    precisions = {
        "tuneloop": f"bf16: auto{''.join(', ' + item for item in args.tuneloop_set)} -> {t['precision']}",
        "axolotl": (f"bf16: {args.axolotl_bf16} -> Trainer bf16={a['trainer_bf16']} fp16={a['trainer_fp16']}, "
                    "parameters " + ", ".join(f"{n / 1e6:.1f}M {d.replace('torch.', '')}"
                                         for d, n in (a["parameter_dtypes"] or {}).items()) + " (no fp32 master copy)"),
    }
    short = {"tuneloop": "bf16" if t["precision"].startswith("bf16") else t["precision"].split()[0],
             "axolotl": "bf16" if a["trainer_bf16"] else "fp16" if a["trainer_fp16"] else "fp32"}
    print(f"\ntuneloop against axolotl {version}: embedded SmolLM2-135M-Instruct, packed (sequence_len "
          f"{SHARED['sequence_len']}, {SHARED['micro_batch_size']} rows a step), {args.steps} steps, "
          f"{args.rounds} interleaved round(s); machine: {cpu}, {args.threads} threads (OMP_NUM_THREADS)")
    for tool in runs:
        print(f"  {tool:<9} {precisions[tool]}")
    print(f"  attention: tuneloop {t['attention']}; axolotl sdpa (block-diagonal mask over the packed row)")
    head = (f"{'tool':<10}{'precision':<10}{'real tok/s':>22}{'first step s':>22}{'peak RSS GB':>22}"
            f"{'final loss':>24}{'real tokens':>13}")
    print(head + "\n" + "-" * len(head))

    def joined(got: list[dict], key: str, form: str) -> str:
        return ", ".join(format(r[key], form) for r in got)

    for tool, got in runs.items():
        print(f"{tool:<10}{short[tool]:<10} {joined(got, 'tokens_per_second', '.0f'):>21}"
              f" {joined(got, 'first_step_wall_seconds', '.1f'):>21} {joined(got, 'peak_rss_gb', '.2f'):>21}"
              f" {joined(got, 'final_loss', '.3f'):>23}{got[0]['real_tokens']:>13}")
    head = f"{'ratio (per round; median)':<44}{'precision':<10}{'machine':<40}"
    print("\n" + head + "\n" + "-" * (len(head) + 24))
    for key, words in (("tokens_per_second", "tuneloop / axolotl real tok/s"),
                       ("first_step_sooner", "axolotl / tuneloop time to first step"),
                       ("peak_rss", "tuneloop / axolotl peak RSS")):
        precision = f"{short['tuneloop']}/{short['axolotl']}"
        print(f"{words:<44}{precision:<10}{cpu[:38]:<40}{', '.join(f'{v:.2f}' for v in ratios[key])}; "
              f"median {medians[key]:.2f}")

    result = {"axolotl_version": version, "machine": cpu, "threads": args.threads, "steps": args.steps,
              "rounds": args.rounds, "run": SHARED, "precision": precisions, "runs": runs, "ratios": ratios,
              "medians": medians}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
