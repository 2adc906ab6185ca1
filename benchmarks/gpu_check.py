"""One prepared script for a session that is lent a GPU: check tuneloop's CUDA paths, then benchmark.

    python benchmarks/gpu_check.py --out DIR [--skip-bench]

Checks, each reported as ok / failed / skipped with its numbers, into DIR/gpu_check.json:
  1. environment: torch, CUDA device, bf16 support, flash-attn and bitsandbytes availability;
  2. packed == alone: a packed row's per-sequence losses equal the sequences run alone (fp32) for
     sdpa, eager and, when flash-attn is installed, flash_attention_2 (the varlen path);
  3. a bf16 `tuneloop train` run (bf16: auto, fused AdamW by default) of a tiny LLaMA: plan == run,
     finite losses, the mixed precision really used;
  4. torch.compile of the model's forward + backward (tuneloop does not compile yet: is it worth it?);
  5. QLoRA: two steps where bitsandbytes and CUDA are there;
  6. a packed bf16 DPO run (rl: dpo, full fine-tuning with its frozen reference): plan == run, first loss ln 2;
  7. one-device FSDP2 and DeepSpeed ZeRO-2 runs (bf16, packed) of the embedded model when `tuneloop setup` has
     built it, else the tiny one: plan == run, finite losses, the plan's bytes per rank against the engine's,
     peak memory against the estimate;
  8. context parallel's Ulysses exchange around each attention kernel (flash-attention's varlen path on a GPU) on
     one rank: logits on packed rows equal SDPA's;
  9. the GPU benchmark (`compare.py --gpu`), unless --skip-bench.
On a CPU machine the same script runs with the GPU-only parts skipped, which is how it was checked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # conftest's tiny tokenizer/model builders and row maker


def check_environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info.update(device=torch.cuda.get_device_name(0), bf16=torch.cuda.is_bf16_supported(),
                    memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1))
    for module in ("flash_attn", "bitsandbytes", "transformers", "accelerate", "peft", "datasets"):
        try:
            info[module] = getattr(__import__(module), "__version__", "installed")
        except ImportError:
            info[module] = None
    return info


def build_tiny(workdir: Path) -> tuple[Path, Path]:
    """The tests' tiny tokenizer and LLaMA, built without pytest."""
    import conftest

    class Factory:
        def mktemp(self, name):
            path = workdir / name
            path.mkdir(parents=True, exist_ok=True)
            return path

    tokenizer_dir = conftest.tiny_tokenizer_dir.__wrapped__(Factory())
    model_dir = conftest.tiny_model_dir.__wrapped__(Factory(), tokenizer_dir)
    return tokenizer_dir, model_dir


def check_packed_equals_alone(workdir: Path, model_dir: Path, tokenizer_dir: Path, device: str) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import conftest
    from tuneloop.config import config_from_dict
    from tuneloop.data.collate import Collator
    from tuneloop.data.labels import IGNORE_INDEX
    from tuneloop.data.prepare import prepare

    data = conftest.write_jsonl(workdir / "pack.jsonl", conftest.tiny_rows(12, seed=5))
    cfg = config_from_dict({"base_model": "unused", "datasets": [{"path": str(data), "type": "alpaca"}],
                            "dataset_prepared_path": str(workdir / "prepared"), "sequence_len": 512})
    prepared = prepare(cfg, AutoTokenizer.from_pretrained(tokenizer_dir))
    implementations = ["sdpa", "eager"]
    if device == "cuda":
        try:
            import flash_attn  # noqa: F401

            implementations.append("flash_attention_2")
        except ImportError:
            pass
    results = {}
    for attention in implementations:
        dtype = torch.bfloat16 if attention == "flash_attention_2" else torch.float32  # FA2 has no fp32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
        model.config.use_cache = False
        model.to(device).eval()

        def losses(batch):
            batch = batch.to(device)
            with torch.no_grad():
                logits = model(**batch.inputs).logits.float()
            return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none").view(batch.targets.shape)

        sequences = [0, 1, 2, 3]
        packed = losses(Collator(prepared.train, 0, packed=True)([sequences]))[0]
        alone = Collator(prepared.train, 0, packed=False)
        worst, offset = 0.0, 0
        for index in sequences:
            length = prepared.train[index]["length"]
            single = alone([[index]])
            mask = (single.targets[0, :length] != IGNORE_INDEX).to(device)
            expected = losses(single)[0, :length]
            worst = max(worst, float((packed[offset:offset + length] - expected)[mask].abs().max()))
            offset += length
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        results[attention] = {"max_abs_diff": worst, "tolerance": tolerance, "ok": worst <= tolerance}
    return {"ok": all(r["ok"] for r in results.values()), "by_attention": results}


def check_bf16_train(workdir: Path, model_dir: Path) -> dict:
    import conftest

    data = conftest.write_jsonl(workdir / "train.jsonl", conftest.tiny_rows(80, seed=1))
    keys = conftest.base_config(workdir / "bf16", model_dir, data, sample_packing=True, micro_batch_size=2,
                                gradient_accumulation_steps=2, max_steps=6, bf16="auto")
    config = conftest.write_config(workdir / "bf16.yml", **keys)
    result = conftest.run_cli("train", str(config))
    out = workdir / "bf16" / "out"
    if result.returncode != 0:
        return {"ok": False, "stderr": result.stderr[-2000:]}
    plan = json.loads((out / "plan.json").read_text())
    steps = [m for m in conftest.read_metrics(out) if "loss" in m]
    import math

    from tuneloop.config import load_config
    from tuneloop.resolved import resolve_run

    precision = resolve_run(load_config(config)).precision.mixed
    ok = len(steps) == plan["total_steps"] and all(math.isfinite(m["loss"]) for m in steps)
    summary = json.loads((out / "summary.json").read_text())
    return {"ok": ok, "mixed_precision": precision, "steps": len(steps), "planned": plan["total_steps"],
            "losses": [round(m["loss"], 4) for m in steps], "memory": plan.get("memory"),
            "mfu": summary.get("mfu"), "peak": plan.get("peak_source")}


def check_chunked_loss(device: str) -> dict:
    """The chunked loss against whole logits at SmolLM2's vocabulary, 8 x 4096 tokens (6.4 GB of fp32 logits):
    the same value and gradients under bf16 autocast, and the peak memory and time of each."""
    import torch
    import torch.nn.functional as F

    from tuneloop.train.chunked_loss import chunked_linear_cross_entropy

    tokens = 8 * 4096 if device == "cuda" else 2048
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 576, device=device, requires_grad=True)
    weight = (torch.randn(49152, 576, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, 49152, (tokens,), device=device)
    results = {}
    for name in ("plain", "chunked"):
        hidden.grad = weight.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            if name == "plain":
                loss = F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")
            else:
                loss = chunked_linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        results[name] = {"loss": float(loss), "seconds": round(time.perf_counter() - start, 4),
                         "grads": (hidden.grad.clone(), weight.grad.clone())}
        if device == "cuda":
            results[name]["peak_extra_gb"] = round((torch.cuda.max_memory_allocated() - before) / 1e9, 3)
    pairs = zip(results["chunked"]["grads"], results["plain"]["grads"])
    relative = [float((a - b).norm() / b.norm()) for a, b in pairs]
    for result in results.values():
        result.pop("grads")
    ok = abs(results["chunked"]["loss"] / results["plain"]["loss"] - 1) < 1e-3 and max(relative) < 2e-2
    return {"ok": ok, "tokens": tokens, "grad_relative_diff": [round(r, 5) for r in relative], **results}


def check_dpo_train(workdir: Path, model_dir: Path) -> dict:
    """A packed bf16 DPO run (full fine-tuning, so the frozen reference copy is on the device too): plan == run,
    the first loss is -log σ(0) = ln 2 (the policy starts as its reference), finite losses, peak memory."""
    import math
    import random

    import conftest

    words = " ".join(conftest.CORPUS).split()
    rng = random.Random(0)
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 10)))}],
             "chosen": " ".join(rng.choices(words, k=rng.randint(2, 14))),
             "rejected": " ".join(rng.choices(words, k=rng.randint(2, 14)))} for _ in range(64)]
    data = conftest.write_jsonl(workdir / "pairs.jsonl", rows)
    keys = conftest.base_config(workdir / "dpo", model_dir, data, rl="dpo", rl_beta=0.1, sample_packing=True,
                                datasets=[{"path": str(data), "type": "chat_template"}], micro_batch_size=2,
                                gradient_accumulation_steps=2, max_steps=4, bf16="auto", learning_rate=1e-4)
    result = conftest.run_cli("train", str(conftest.write_config(workdir / "dpo.yml", **keys)))
    out = workdir / "dpo" / "out"
    if result.returncode != 0:
        return {"ok": False, "stderr": result.stderr[-2000:]}
    plan = json.loads((out / "plan.json").read_text())
    steps = [m for m in conftest.read_metrics(out) if "loss" in m]
    summary = json.loads((out / "summary.json").read_text())
    ok = (len(steps) == plan["total_steps"] and all(math.isfinite(m["loss"]) for m in steps)
          and abs(steps[0]["loss"] - math.log(2)) < 1e-2)
    return {"ok": ok, "steps": len(steps), "planned": plan["total_steps"],
            "losses": [round(m["loss"], 4) for m in steps], "reward_accuracy": [m["reward_accuracy"] for m in steps],
            "reference": plan.get("reference"), "peak_memory_gb": summary.get("peak_memory_gb")}


def check_sharded_train(workdir: Path, model_dir: Path, engine: str) -> dict:
    """One device, a sharding engine: what a user runs before renting more (FSDP2 with bf16 mixed precision, or
    DeepSpeed ZeRO-2 with its own bf16)."""
    import math

    import conftest

    keys = {"fsdp2": {"fsdp": ["full_shard", "auto_wrap"], "fsdp_version": 2},
            "zero2": {"deepspeed": "zero2"}}[engine]
    from tuneloop.demo.embedded import EMBEDDED_MODEL_ALIAS, find_smollm2_gguf
    from tuneloop.errors import UserError

    try:
        find_smollm2_gguf()  # the package that carries it is installed: the run builds (or reuses) the model
        model = EMBEDDED_MODEL_ALIAS
    except UserError:
        model = model_dir
    data = conftest.write_jsonl(workdir / f"{engine}.jsonl", conftest.tiny_rows(120, seed=5))
    config = conftest.base_config(workdir / engine, model, data, sample_packing=True, micro_batch_size=2,
                                  gradient_accumulation_steps=2, max_steps=6, bf16="auto", sequence_len=512,
                                  optimizer="adamw_torch", **keys)
    result = conftest.run_cli("train", str(conftest.write_config(workdir / f"{engine}.yml", **config)))
    out = workdir / engine / "out"
    if result.returncode != 0:
        return {"ok": False, "stderr": result.stderr[-2500:]}
    plan = json.loads((out / "plan.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    steps = [m for m in conftest.read_metrics(out) if "loss" in m]
    ok = len(steps) == plan["total_steps"] and all(math.isfinite(m["loss"]) for m in steps)
    return {"ok": ok, "model": str(model), "engine": plan.get("engine"), "steps": len(steps),
            "losses": [round(m["loss"], 4) for m in steps], "held_bytes": summary.get("held_bytes_per_rank"),
            "planned_bytes": plan["memory"].get("per_rank_bytes"), "peak_memory_gb": summary.get("peak_memory_gb"),
            "tokens_per_second": summary.get("real_tokens_per_second_after_first_step"), "mfu": summary.get("mfu")}


def check_qlora_train(workdir: Path, model_dir: Path) -> dict:
    """Two QLoRA steps (4-bit NF4 base, LoRA on every linear layer) where bitsandbytes and CUDA are there."""
    import importlib.util

    import torch

    if not (torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes")):
        return {"ok": None, "skipped": "needs CUDA and bitsandbytes"}
    import conftest

    data = conftest.write_jsonl(workdir / "qlora.jsonl", conftest.tiny_rows(40, seed=3))
    keys = conftest.base_config(workdir / "qlora", model_dir, data, adapter="qlora", lora_r=4, lora_alpha=8,
                                lora_target_linear=True, max_steps=2, bf16="auto")
    result = conftest.run_cli("train", str(conftest.write_config(workdir / "qlora.yml", **keys)))
    out = workdir / "qlora" / "out"
    ok = result.returncode == 0 and (out / "adapter_model.safetensors").is_file()
    return {"ok": ok, "stderr": result.stderr[-1500:] if not ok else ""}


def check_compile(model_dir: Path, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    ids = torch.randint(0, model.config.vocab_size, (4, 256), device=device)
    timings = {}
    for name, runner in (("eager", model), ("compiled", torch.compile(model))):
        for attempt in range(4):  # the first call of the compiled model compiles
            start = time.perf_counter()
            runner(input_ids=ids, labels=ids).loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            timings.setdefault(name, []).append(time.perf_counter() - start)
    return {"ok": True, "first_call_s": {k: round(v[0], 3) for k, v in timings.items()},
            "steady_ms": {k: round(min(v[1:]) * 1000, 2) for k, v in timings.items()}}


def check_context_parallel_kernel(model_dir: Path, device: str) -> dict:
    """Context parallel's exchange (engines/context_parallel.py) around each attention kernel this device runs, on
    one rank (the all-to-alls of a 1-rank group hand every head through): the model's logits on packed rows equal
    SDPA's under the block-diagonal mask transformers builds from the positions. On a GPU the flash-attention
    kernel behind the exchange gets the whole rows' positions (its varlen path) — the route axolotl's ALST example
    takes. Multi-rank equality is tests/test_context_parallel.py's (gloo)."""
    import importlib.util

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tuneloop.engines import context_parallel
    from tuneloop.packed_attention import loadable

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    kernels = ["sdpa", "sdpa_per_sequence"]
    if device == "cuda" and importlib.util.find_spec("flash_attn"):
        kernels.append("flash_attention_2")
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(40), torch.arange(56)]).expand(2, 96).to(device)
    ids = torch.randint(0, 300, (2, 96), device=device)
    results = {}
    for kernel in kernels:
        dtype = torch.bfloat16 if kernel.startswith("flash") else torch.float32
        reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=dtype).to(device)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation=context_parallel.loadable(loadable(kernel)), dtype=dtype).to(device)
        context_parallel.join(dist.group.WORLD)
        with torch.no_grad():
            # (use_cache=False: transformers builds the packed rows' mask only without a cache, as training runs)
            expected = reference(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
            got = model(input_ids=ids, position_ids=positions, use_cache=False,
                        **{context_parallel.WHOLE_POSITIONS: positions}).logits.float()
        results[kernel] = float((got - expected).abs().max())
    tolerance = {"sdpa": 1e-4, "sdpa_per_sequence": 1e-4, "flash_attention_2": 5e-2}
    return {"ok": all(results[k] <= tolerance[k] for k in results), "max_abs_logit_difference": results}


def run(name: str, function, *args) -> dict:
    start = time.perf_counter()
    try:
        result = function(*args)
    except Exception:  # a check that breaks is reported, the others still run
        result = {"ok": False, "error": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    status = {None: "skipped", False: "FAILED"}.get(result.get("ok", True), "ok")
    print(f"[{status}] {name}: "
          f"{json.dumps({k: v for k, v in result.items() if k != 'error'})[:600]}", flush=True)
    if "error" in result:
        print(result["error"], flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="folder for gpu_check.json (and gpu_bench.json)")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": run("environment", check_environment)}
    device = "cuda" if report["environment"]["cuda"] else "cpu"
    with tempfile.TemporaryDirectory(prefix="tuneloop-gpu-check-") as temp:
        workdir = Path(temp)
        tokenizer_dir, model_dir = build_tiny(workdir)
        report["packed_equals_alone"] = run("packed == alone", check_packed_equals_alone, workdir, model_dir,
                                            tokenizer_dir, device)
        report["bf16_train"] = run("bf16 train", check_bf16_train, workdir, model_dir)
        report["compile"] = run("torch.compile", check_compile, model_dir, device)
        report["chunked_loss"] = run("chunked loss", check_chunked_loss, device)
        report["context_parallel_kernel"] = run("context parallel kernel", check_context_parallel_kernel, model_dir,
                                                device)
        report["qlora"] = run("qlora train", check_qlora_train, workdir, model_dir)
        report["dpo"] = run("dpo train", check_dpo_train, workdir, model_dir)
        for engine in ("fsdp2", "zero2"):
            report[f"{engine}_train"] = run(f"{engine} train (one device)", check_sharded_train, workdir, model_dir,
                                            engine)
    if device == "cuda" and not args.skip_bench:
        bench = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare.py"), "--gpu", "--json",
                                str(out / "gpu_bench.json")], text=True)
        report["bench"] = {"ok": bench.returncode == 0, "json": str(out / "gpu_bench.json")}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if all(v.get("ok") is not False for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
