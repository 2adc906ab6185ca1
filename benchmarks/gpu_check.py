"""One prepared script for a session that is lent a GPU: check tuneloop's CUDA paths, then benchmark.

    python benchmarks/gpu_check.py --out DIR [--skip-bench] [--skip-mfu] [--only CHECK,...]

Checks, each reported as ok / failed / skipped with its numbers, into DIR/gpu_check.json:
  1. environment: torch, CUDA device, bf16 support, flash-attn and bitsandbytes availability;
  2. packed == alone: a packed row's per-sequence losses equal the sequences run alone (fp32) for
     sdpa, eager, sdpa_per_sequence (bf16 on a GPU: torch's varlen flash kernel) and, when flash-attn is
     installed, flash_attention_2 (the varlen path); then torch's varlen kernel against SDPA on each sequence alone
     (outputs, q/k/v gradients) and its time against SDPA under the block-diagonal mask (check `varlen_kernel`);
  3. a bf16 `tuneloop train` run (bf16: auto, fused AdamW by default) of a tiny LLaMA: plan == run,
     finite losses, the mixed precision really used;
  4. torch.compile of the model's forward + backward, eager against compiled: the first call's cost and the steady
     step on this device. tuneloop compiles under `torch_compile: auto` (the default) where its plan predicts the
     run repays it (plan/compile_choice.py: from this machine's records of earlier compiled and eager runs of the
     same shape, else only for runs predicted to last over 10 minutes eager on a GPU, 30 on a CPU), and always or never under
     `torch_compile: true` / `false`; these are the numbers that decision weighs;
  5. the chunked loss against whole logits at SmolLM2's vocabulary, 8 × 4096 tokens under bf16 autocast (value,
     gradients, time, peak memory) and, on CUDA where `liger_kernel` imports, Liger's fused linear cross-entropy
     beside them. The device machine cannot reach PyPI: put the wheel in benchmarks/wheels/ (git-ignored) with
     `pip download liger-kernel --no-deps -d benchmarks/wheels`, carry that folder (the device tool's `carry`),
     and the check installs it (--no-deps, into a folder of its own) when liger_kernel is missing;
  6. context parallel's Ulysses exchange around each attention kernel (flash-attention's varlen path on a GPU) on
     one rank: logits on packed rows equal SDPA's;
  7. QLoRA: two steps where bitsandbytes and CUDA are there;
  8. a packed bf16 DPO run (rl: dpo, full fine-tuning with its frozen reference): plan == run, first loss ln 2;
     GRPO's trainer half (the GPU machine has no vLLM): fed completions trained on the device and on the CPU give
     the same losses and grad norms in fp32, and a bf16 run generating with transformers on the device: plan == run;
  9. one-device FSDP2 and DeepSpeed ZeRO-2 runs (bf16, packed) of the embedded model when `tuneloop setup` has
     built it, else the tiny one: plan == run, finite losses, the plan's bytes per rank against the engine's,
     peak memory against the estimate;
 10. MFU of a ~1B LLaMA (TinyLlama's shape, random weights, no download): `tuneloop train` of packed rows of varied
     length at 2048 tokens, bf16: auto, flash-attention 2 where installed else tuneloop's choice (torch's varlen
     kernel where it has one), 25 steps, once as a full
     fine-tune and once as LoRA (r 16, every linear layer). tuneloop's own MFU (against the device's dense bf16
     data-sheet peak) and real tokens/s, beside the goals: 40% full, 30% LoRA (`meets_goal`; missing it is
     reported, not a failure: ok is ran + plan == run). ~2-3 minutes on an H200; --skip-mfu leaves it out,
     --mfu-smoke runs it with a 2-layer model (so on a CPU too), --mfu-micro-batch / --mfu-sequence-len /
     --mfu-attention change the runs;
 11. the GPU benchmark (`compare.py --gpu`), unless --skip-bench.
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
WHEELS = REPO / "benchmarks" / "wheels"  # git-ignored: wheels carried to a machine that cannot reach PyPI
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
    from tuneloop.kernels.packed_attention import PER_SEQUENCE_SDPA, loadable, varlen_kernel

    implementations = ["sdpa", "eager", PER_SEQUENCE_SDPA]
    if device == "cuda":
        try:
            import flash_attn  # noqa: F401

            implementations.append("flash_attention_2")
        except ImportError:
            pass
    results = {}
    for attention in implementations:
        # flash-attention and, on a GPU, the per-sequence split (torch's varlen flash kernel) run 16-bit only
        sixteen_bit = attention == "flash_attention_2" or (attention == PER_SEQUENCE_SDPA and device == "cuda")
        dtype = torch.bfloat16 if sixteen_bit else torch.float32
        if attention == PER_SEQUENCE_SDPA and device == "cuda" and varlen_kernel() is None:
            results[attention] = {"ok": True, "skipped": "this torch has no varlen flash kernel"}
            continue
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=loadable(attention))
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


def check_varlen_kernel(device: str) -> dict:
    """packed_attention.varlen_attention (torch's varlen flash kernel, what a packed bf16 run on a GPU uses) against
    SDPA run on each sequence alone: outputs and the gradients of q, k and v, with grouped kv heads and a scale
    that is not 1/sqrt(dim); and its time against SDPA under the rows' block-diagonal mask (forward + backward)."""
    import torch
    import torch.nn.functional as F

    from tuneloop.kernels.packed_attention import varlen_attention, varlen_kernel

    if device != "cuda" or varlen_kernel() is None:
        return {"ok": None, "skipped": "needs CUDA and a torch with torch.nn.attention.varlen"}
    torch.manual_seed(0)
    lengths = [[700, 900, 448], [2048], [1, 1023, 1024]]
    width, dim = 2048, 64
    q = torch.randn(3, 32, width, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(3, 4, width, dim, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    results = {}
    for scale in (None, 0.1):
        out = varlen_attention(q, k, v, lengths, scale)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        rows = []
        for b, row in enumerate(lengths):
            parts, start = [], 0
            for n in row:
                parts.append(F.scaled_dot_product_attention(
                    q[b:b + 1, :, start:start + n], k[b:b + 1, :, start:start + n], v[b:b + 1, :, start:start + n],
                    is_causal=True, scale=scale, enable_gqa=True))
                start += n
            rows.append(torch.cat(parts, 2))
        expected = torch.cat(rows).transpose(1, 2)
        expected_grads = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
        relative = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads, expected_grads)]
        results[f"scale_{scale}"] = {"max_abs_out": float((out.float() - expected.float()).abs().max()),
                                     "grad_relative": [round(r, 5) for r in relative]}
    ok = all(r["max_abs_out"] < 2e-2 and max(r["grad_relative"]) < 2e-2 for r in results.values())
    positions = torch.cat([torch.cat([torch.arange(n) for n in row]) for row in lengths]).view(3, width).to(device)
    sequence = (positions == 0).cumsum(1)  # which sequence of its row each position is in
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]  # the block-diagonal mask
    timings = {}
    for name, function in (("varlen", lambda: varlen_attention(q, k, v, lengths)),
                           ("sdpa_mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                enable_gqa=True))):
        for attempt in range(6):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            function().sum().backward()
            torch.cuda.synchronize()
            timings.setdefault(name, []).append(time.perf_counter() - begin)
    return {"ok": ok, **results, "fwd_bwd_ms": {name: round(min(t[1:]) * 1000, 3) for name, t in timings.items()}}


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


def liger_loss(workdir: Path, device: str):
    """(Liger's fused linear cross-entropy summed over tokens, its version), or (None, why not). Liger's kernels are
    Triton, so CUDA only. Where `liger_kernel` does not import but a wheel lies in benchmarks/wheels/ (put there by
    `pip download liger-kernel --no-deps -d benchmarks/wheels`), the wheel is installed with --no-deps into a
    folder of this run (its one dependency beside torch, triton, comes with the CUDA image's torch)."""
    import importlib
    import importlib.util

    import torch

    if device != "cuda":
        return None, "needs CUDA (Liger's kernels are Triton)"
    if importlib.util.find_spec("liger_kernel") is None:
        wheels = sorted(WHEELS.glob("liger_kernel-*.whl"))
        if not wheels:
            return None, (f"liger_kernel is not installed and no wheel is in {WHEELS} (`pip download liger-kernel "
                          "--no-deps -d benchmarks/wheels`, and carry that folder)")
        target = workdir / "liger"
        install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                                  "--no-compile", "--target", str(target), str(wheels[-1])],
                                 capture_output=True, text=True)
        if install.returncode != 0:
            return None, f"installing {wheels[-1].name} failed: {install.stderr[-800:]}"
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    try:
        import liger_kernel  # noqa: F401
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as error:  # (an import that breaks on this torch/triton is reported, not fatal)
        return None, f"liger_kernel does not import: {type(error).__name__}: {error}"[:800]
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("liger-kernel")
    except PackageNotFoundError:
        found = getattr(liger_kernel, "__version__", "installed")
    # forward(lin_weight, _input, target, bias=None) -> the loss (a CrossEntropyOutput only where z-loss, token
    # accuracy or predicted tokens are asked for, which they are not). accum_dtype fp32: the head's gradient is
    # summed over Liger's chunks in fp32 (by default in the weight's bf16), as one autocast matmul sums it
    try:
        return LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32), f"{found}, fp32 accum"
    except TypeError:  # (older releases have no accum_dtype)
        return LigerFusedLinearCrossEntropyLoss(reduction="sum"), found


def check_chunked_loss(workdir: Path, device: str) -> dict:
    """The chunked loss against whole logits at SmolLM2's vocabulary, 8 x 4096 tokens (6.4 GB of fp32 logits):
    the same value and gradients under bf16 autocast, and the peak memory and time of each. On CUDA, Liger's
    fused linear cross-entropy beside them where it imports (or installs from benchmarks/wheels/: liger_loss):
    its Triton kernels take the bf16 hidden states and head weight as a bf16 model hands them (cast from the same
    fp32 leaves, so the gradients compare), not autocast."""
    import torch
    import torch.nn.functional as F

    from tuneloop.train.chunked_loss import chunked_linear_cross_entropy

    liger, liger_about = liger_loss(workdir, device)
    tokens = 8 * 4096 if device == "cuda" else 2048
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 576, device=device, requires_grad=True)
    weight = (torch.randn(49152, 576, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, 49152, (tokens,), device=device)
    results = {}
    # on CUDA the first call warms up (cuBLAS handles; Liger's Triton kernels compile): timed apart, then the best
    # of two more; on a CPU one call each
    calls = 3 if device == "cuda" else 1
    for name in ("plain", "chunked") + (("liger",) if liger is not None else ()):
        hidden.grad = weight.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        seconds = []
        for _ in range(calls):
            hidden.grad = weight.grad = None
            start = time.perf_counter()
            if name == "liger":
                loss = liger(weight.to(torch.bfloat16), hidden.to(torch.bfloat16), targets)
                loss = getattr(loss, "loss", loss)
            else:
                with torch.autocast(device, dtype=torch.bfloat16):
                    if name == "plain":
                        loss = F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")
                    else:
                        loss = chunked_linear_cross_entropy(hidden, weight, targets)
            loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            value = float(loss.detach())
            del loss
        results[name] = {"loss": value, "seconds": round(min(seconds[1:] or seconds), 4),
                         "grads": (hidden.grad.clone(), weight.grad.clone())}
        if device == "cuda":
            results[name]["first_call_seconds"] = round(seconds[0], 4)
            results[name]["peak_extra_gb"] = round((torch.cuda.max_memory_allocated() - before) / 1e9, 3)
    agreement, ok = {}, True
    for name in results:
        if name == "plain":
            continue
        pairs = zip(results[name]["grads"], results["plain"]["grads"])
        relative = [float((a - b).norm() / b.norm()) for a, b in pairs]
        agreement[name] = [round(r, 5) for r in relative]
        ok = ok and abs(results[name]["loss"] / results["plain"]["loss"] - 1) < 1e-3 and max(relative) < 2e-2
    for result in results.values():
        result.pop("grads")
    return {"ok": ok, "tokens": tokens, "grad_relative_diff": agreement.pop("chunked"),
            **({"liger_grad_relative_diff": agreement["liger"]} if "liger" in agreement else {}),
            "liger_kernel": liger_about, **results}


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


def check_grpo_train(workdir: Path, model_dir: Path, device: str) -> dict:
    """GRPO's trainer half on this device (the lent GPU has no vLLM): the same fed completions (by token id) trained
    two fp32 steps here and on the CPU give the same losses and grad norms (log-probs, advantages, loss, step);
    then a bf16 run that generates with transformers on this device: plan == run, finite losses, rewards."""
    import math

    import conftest

    from tuneloop.online_rl.rollout import FIXED_COMPLETIONS_ENV
    from transformers import AutoTokenizer

    words = ["cat", "dog", "sun", "tree", "red", "blue", "one", "two"]
    (workdir / "grpo_rewards.py").write_text("def short(prompts, completions, **kwargs):\n"
                                             "    return [-len(c[0]['content']) / 10 for c in completions]\n")
    prompts = conftest.write_jsonl(workdir / "grpo_prompts.jsonl",
                                   [{"prompt": [{"role": "user", "content": f"say {w}"}]} for w in words])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fed = {str(p): [tokenizer(" ".join(words[(p + j) % 8: (p + j) % 8 + 1 + j % 3]))["input_ids"]
                    + [tokenizer.eos_token_id] for j in range(4)] for p in range(len(words))}
    (workdir / "grpo_fed.json").write_text(json.dumps(fed))

    def config(name: str, **keys) -> Path:
        values = {"base_model": str(model_dir), "rl": "grpo", "datasets": [{"path": str(prompts)}],
                  "trl": {"num_generations": 4, "max_completion_length": 8, "reward_funcs": ["grpo_rewards.short"]},
                  "output_dir": str(workdir / name), "sequence_len": 64, "micro_batch_size": 4,
                  "gradient_accumulation_steps": 2, "max_steps": 2, "learning_rate": 1e-2, "optimizer": "sgd",
                  "lr_scheduler": "constant", "logging_steps": 1, "save_strategy": "no", "seed": 7, **keys}
        return conftest.write_config(workdir / f"{name}.yml", **values)

    lines = {}
    for where, env in (("device", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        if where == "cpu" and device != "cuda":
            break
        result = conftest.run_cli("train", str(config(f"grpo-fed-{where}", bf16=False)), cwd=workdir,
                                  env={FIXED_COMPLETIONS_ENV: str(workdir / "grpo_fed.json"), **env})
        if result.returncode != 0:
            return {"ok": False, "stage": f"fed completions on {where}", "stderr": result.stderr[-2000:]}
        lines[where] = [m for m in conftest.read_metrics(workdir / f"grpo-fed-{where}") if "loss" in m]
    generated = conftest.run_cli("train", str(config("grpo-bf16", bf16="auto")), cwd=workdir)
    if generated.returncode != 0:
        return {"ok": False, "stage": "bf16 generation", "stderr": generated.stderr[-2000:]}
    steps = [m for m in conftest.read_metrics(workdir / "grpo-bf16") if "loss" in m]
    plan = json.loads((workdir / "grpo-bf16" / "plan.json").read_text())
    agree = True
    if "cpu" in lines:
        agree = all(math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6)
                    and math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
                    for a, b in zip(lines["device"], lines["cpu"]))
    ok = agree and len(steps) == plan["total_steps"] and all(math.isfinite(m["loss"]) for m in steps)
    return {"ok": ok, "device_equals_cpu": agree if "cpu" in lines else None,
            "fed": {where: [(m["loss"], m["grad_norm"]) for m in found] for where, found in lines.items()},
            "bf16_generated": [{k: m.get(k) for k in ("loss", "reward", "completion_length", "generation_seconds",
                                                      "training_seconds")} for m in steps]}


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
    from tuneloop.kernels.packed_attention import loadable

    if importlib.util.find_spec("deepspeed") is None:
        return {"ok": None, "skipped": "needs deepspeed (context parallel's Ulysses all-to-alls are DeepSpeed's)"}
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


MFU_GOALS = {"full": 0.40, "lora": 0.30}  # the share of the device's dense bf16 peak each run should reach
# TinyLlama-1.1B's shape (random weights, saved once): a ~1B model whose matmuls can fill a GPU
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "vocab_size": 32000}
SMOKE_LLAMA = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 32000}
TOKENS_PER_WORD = 2.2  # the tiny tokenizer on the tests' corpus words (2.14 measured over 1000 words)


def save_random_llama(target: Path, tokenizer_dir: Path, shape: dict, sequence_len: int, device: str) -> Path:
    """A LLaMA of `shape` with random weights (seed 0), built on `device` and saved in bf16 with the tiny tokenizer
    (its ~400 tokens are ids of the model's larger vocabulary: the head still computes every row)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(max_position_embeddings=sequence_len, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the training runs are other processes
    return target


def varied_rows(count: int, sequence_len: int, seed: int = 11) -> list[dict]:
    """Alpaca rows of the tests' words whose lengths spread from ~5% to ~85% of sequence_len tokens, so that packing
    fills rows with sequences of many lengths and none is dropped as too long."""
    import random

    import conftest

    rng = random.Random(seed)
    words = " ".join(conftest.CORPUS).split()
    longest = int(sequence_len * 0.85 / TOKENS_PER_WORD)
    return [{"instruction": " ".join(rng.choices(words, k=rng.randint(3, 12))), "input": "",
             "output": " ".join(rng.choices(words, k=rng.randint(max(2, longest // 20), longest)))}
            for _ in range(count)]


def mfu_settings(device: str, smoke: bool, micro_batch: int | None, sequence_len: int | None,
                 attention: str | None) -> dict:
    """The shape of the MFU runs: a ~1B LLaMA at 2048 tokens a row on a GPU, micro-batch by the device's memory
    (8 rows = 16k tokens a step on a 100+ GB card: tuneloop's plan puts the full fine-tune at ~71 GB, 51 of them
    activations, and LoRA at ~56); `smoke`: a 2-layer model, to run the same code path on a CPU."""
    import importlib.util

    import torch

    if smoke:
        settings = {"shape": SMOKE_LLAMA, "sequence_len": 256, "micro_batch_size": 2, "steps": 4}
    else:
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        settings = {"shape": LLAMA_1B, "sequence_len": 2048, "steps": 25,
                    "micro_batch_size": 8 if memory_gb >= 100 else 4 if memory_gb >= 60 else 2 if memory_gb >= 35
                    else 1}
    if micro_batch:
        settings["micro_batch_size"] = micro_batch
    if sequence_len:
        settings["sequence_len"] = sequence_len
    flash = device == "cuda" and importlib.util.find_spec("flash_attn") is not None
    settings["attention"] = attention or ("flash_attention_2" if flash else None)  # None: tuneloop's own choice
    return settings


def check_mfu(workdir: Path, tokenizer_dir: Path, device: str, smoke: bool = False, micro_batch: int | None = None,
              sequence_len: int | None = None, attention: str | None = None, compiled_too: bool = False,
              profile: bool = False) -> dict:
    """tuneloop's MFU on a ~1B LLaMA (TinyLlama's shape, random weights), `tuneloop train` through the CLI: packed
    rows of varied length at 2048 tokens, bf16: auto, flash-attention 2 where installed (else tuneloop's choice),
    eager (`torch_compile: false`: what `auto` picks for a run this short), ~25 steps; a full fine-tune, then LoRA
    r 16 on every linear layer. MFU and real tokens/s are the run's own (summary.json: after the first step, against the
    peak plan.json names: the data sheet's dense bf16 figure on a GPU it knows). ok: each run ran its planned steps
    with finite losses; `meets_goal` says whether it reached MFU_GOALS (not a failure when it does not).
    `compiled_too`: each kind once more with `torch_compile: true` ("full_compiled", "lora_compiled"); `profile`:
    step_profile.py over steps 3-5 of the eager full fine-tune (device time by group, the top kernels)."""
    import math

    import conftest

    if device != "cuda" and not smoke:
        return {"ok": None, "skipped": "needs CUDA (--mfu-smoke runs the same path with a tiny model anywhere)"}
    settings = mfu_settings(device, smoke, micro_batch, sequence_len, attention)
    length, rows_per_step = settings["sequence_len"], settings["micro_batch_size"]
    start = time.perf_counter()
    model_dir = save_random_llama(workdir / "llama_mfu", tokenizer_dir, settings["shape"], length, device)
    built_seconds = round(time.perf_counter() - start, 1)
    # rows of ~45% of sequence_len on average, packed: enough for every step with a quarter to spare
    count = int(settings["steps"] * rows_per_step / 0.45 * 1.25) + 8
    data = conftest.write_jsonl(workdir / "mfu.jsonl", varied_rows(count, length))
    runs = {}
    variants = [("full", False), ("lora", False), "profile",
                *([("full", True), ("lora", True)] if compiled_too else [])]
    for variant in variants:
        if variant == "profile":  # eager first, then the profile: compiling may not fit in what is left of a lease
            if profile:
                runs["profile"] = profile_run(workdir / "mfu_full.yml")
            continue
        kind, compiled = variant
        name = f"{kind}_compiled" if compiled else kind
        adapter = ({"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_linear": True,
                    "learning_rate": 2e-4} if kind == "lora" else {"learning_rate": 2e-5})
        keys = conftest.base_config(workdir / f"mfu_{name}", model_dir, data, sample_packing=True,
                                    sequence_len=length, micro_batch_size=rows_per_step,
                                    gradient_accumulation_steps=1, max_steps=settings["steps"], num_epochs=1,
                                    bf16="auto", torch_compile=compiled,
                                    **({"attn_implementation": settings["attention"]} if settings["attention"] else {}),
                                    logging_steps=5, dataset_prepared_path=str(workdir / "mfu_prepared"),
                                    **adapter)
        try:
            result = conftest.run_cli("train", str(conftest.write_config(workdir / f"mfu_{name}.yml", **keys)),
                                      timeout=420 if compiled else 300)
        except subprocess.TimeoutExpired:
            runs[name] = {"ok": False, "stderr": "timed out"}
            continue
        out = workdir / f"mfu_{name}" / "out"
        if result.returncode != 0:
            runs[name] = {"ok": False, "stderr": result.stderr[-2000:]}
            continue
        plan = json.loads((out / "plan.json").read_text())
        summary = json.loads((out / "summary.json").read_text())
        losses = [m["loss"] for m in conftest.read_metrics(out) if "loss" in m]
        utilisation, goal = summary.get("mfu"), MFU_GOALS[kind]
        peak = plan.get("peak_flops")
        runs[name] = {
            "ok": summary["steps"] == plan["total_steps"] and bool(losses) and all(map(math.isfinite, losses)),
            "mfu": utilisation, "goal": goal,
            "meets_goal": utilisation is not None and utilisation >= goal,
            "real_tokens_per_second": summary.get("real_tokens_per_second_after_first_step"),
            "model_tflops_per_second": round(utilisation * peak / 1e12, 3) if utilisation and peak else None,
            "peak": plan.get("peak_source"), "steps": summary["steps"], "planned": plan["total_steps"],
            "first_step_seconds": summary.get("first_step_seconds"), "train_seconds": summary.get("train_seconds"),
            "losses": [round(loss, 4) for loss in losses], "precision": plan.get("precision"),
            "attention": plan.get("attention"), "attention_context": plan.get("attention_context"),
            "flops_per_token": plan.get("flops_per_token"), "estimated_memory_gb": plan.get("estimated_memory_gb"),
            "peak_memory_gb": summary.get("peak_memory_gb"), "seconds": summary.get("seconds")}
        print(f"  mfu {name}: {utilisation if utilisation is None else f'{utilisation:.1%}'} (goal {goal:.0%}), "
              f"{runs[name]['real_tokens_per_second']} real tok/s, first step {summary.get('first_step_seconds')} s, {summary['steps']}/{plan['total_steps']} steps, "
              f"{plan.get('attention')}, peak {plan.get('peak_source')}", flush=True)
    return {"ok": all(run["ok"] for run in runs.values()), "smoke": smoke, "model_built_seconds": built_seconds,
            "sequence_len": length, "micro_batch_size": rows_per_step, "steps": settings["steps"],
            "attention_asked": settings["attention"], **runs}


def profile_run(config: Path) -> dict:
    """step_profile.py over steps 3-5 of the run `config` describes: time by group of operators, the top kernels."""
    if not config.exists():
        return {"ok": None, "skipped": f"{config.name} was not written"}
    profiled = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_profile.py"), "--config", str(config),
                               "--skip", "2", "--steps", "3", "--kernels", "30"],
                              text=True, capture_output=True, timeout=300)
    print(profiled.stdout[-6000:], profiled.stderr[-1500:] if profiled.returncode else "", flush=True)
    return {"ok": profiled.returncode == 0, "stdout": profiled.stdout[-6000:]}


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


CHECKS = ("packed_equals_alone", "varlen_kernel", "bf16_train", "compile", "chunked_loss", "context_parallel_kernel",
          "qlora", "dpo", "grpo", "fsdp2_train", "zero2_train", "mfu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="folder for gpu_check.json (and gpu_bench.json)")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-mfu", action="store_true", help="leave out the ~1B model's MFU runs (~2-3 min on "
                        "an H200)")
    parser.add_argument("--mfu-smoke", action="store_true", help="the MFU check with a 2-layer model at 256 tokens, "
                        "on any device (a CPU too): the code path, not the numbers")
    parser.add_argument("--mfu-micro-batch", type=int, help="rows per micro-batch of the MFU runs (default: by the "
                        "GPU's memory, 8 on 100 GB or more)")
    parser.add_argument("--mfu-sequence-len", type=int, help="tokens per row of the MFU runs (default 2048)")
    parser.add_argument("--mfu-attention", help="attn_implementation of the MFU runs (default: flash_attention_2 "
                        "where flash-attn is installed, else tuneloop's choice: torch's varlen kernel where it has "
                        "one; sdpa keeps transformers' mask over packed rows)")
    parser.add_argument("--mfu-compiled-too", action="store_true", help="the MFU runs once more each with "
                        "torch_compile: true")
    parser.add_argument("--mfu-profile", action="store_true", help="step_profile.py over the eager full fine-tune's "
                        "steps 3-5: device time by group and the top kernels")
    parser.add_argument("--only", help=f"comma-separated checks to run (the environment always): {', '.join(CHECKS)}")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else set(CHECKS)
    if unknown := only - set(CHECKS):
        parser.error(f"--only: unknown checks {', '.join(sorted(unknown))}")
    if args.skip_mfu:
        only.discard("mfu")
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": run("environment", check_environment)}
    device = "cuda" if report["environment"]["cuda"] else "cpu"
    with tempfile.TemporaryDirectory(prefix="tuneloop-gpu-check-") as temp:
        workdir = Path(temp)
        tokenizer_dir, model_dir = build_tiny(workdir)
        checks = {
            "packed_equals_alone": ("packed == alone", check_packed_equals_alone, workdir, model_dir, tokenizer_dir,
                                    device),
            "varlen_kernel": ("varlen kernel", check_varlen_kernel, device),
            "bf16_train": ("bf16 train", check_bf16_train, workdir, model_dir),
            "compile": ("torch.compile", check_compile, model_dir, device),
            "chunked_loss": ("chunked loss", check_chunked_loss, workdir, device),
            "context_parallel_kernel": ("context parallel kernel", check_context_parallel_kernel, model_dir, device),
            "qlora": ("qlora train", check_qlora_train, workdir, model_dir),
            "dpo": ("dpo train", check_dpo_train, workdir, model_dir),
            "grpo": ("grpo trainer half", check_grpo_train, workdir, model_dir, device),
            **{f"{engine}_train": (f"{engine} train (one device)", check_sharded_train, workdir, model_dir, engine)
               for engine in ("fsdp2", "zero2")},
            "mfu": ("mfu (~1B LLaMA, full and LoRA)", check_mfu, workdir, tokenizer_dir, device, args.mfu_smoke,
                    args.mfu_micro_batch, args.mfu_sequence_len, args.mfu_attention, args.mfu_compiled_too,
                    args.mfu_profile),
        }
        for key, (name, function, *arguments) in checks.items():
            if key in only:
                report[key] = run(name, function, *arguments)
                # written after every check: a lease that runs out mid-way still leaves the checks done so far
                (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    if device == "cuda" and not args.skip_bench:
        bench = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare.py"), "--gpu", "--json",
                                str(out / "gpu_bench.json")], text=True)
        report["bench"] = {"ok": bench.returncode == 0, "json": str(out / "gpu_bench.json")}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if all(v.get("ok") is not False for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
