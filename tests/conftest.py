"""Shared fixtures: a tiny tokenizer and a tiny LLaMA built from configs (no download), and helpers
to write data and configs and to run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach a model hub

def pytest_collection_modifyitems(items):
    """The modules with the most end-to-end (slow) runs first, each module's tests together and in their order:
    the two workers start on the long runs and finish on short tests, rather than one waiting idle while the other
    ends on a two-minute benchmark. (Whole modules move, so a module's fixtures are still built once a worker.)"""
    slow_in = {}
    for item in items:
        slow_in.setdefault(item.module.__name__, 0)
        slow_in[item.module.__name__] += item.get_closest_marker("slow") is not None
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-slow_in[item.module.__name__], order[id(item)]))


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "The quick brown fox jumps over the lazy dog. Hello there, how are you today?",
    "I am fine, thank you. What is your name? My name is Tiny. Count: one two three four five six seven.",
    "Translate the sentence into French. Name three colours: red, green and blue. Add two numbers.",
]


@pytest.fixture(autouse=True, scope="session")
def compile_records_of_the_suite(tmp_path_factory):
    """Every test plans `torch_compile: auto` from the suite's own records (plan/compile_choice.py), never from
    what this machine ran before; subprocesses inherit the variable."""
    os.environ["TUNELOOP_COMPILE_RECORDS"] = str(tmp_path_factory.mktemp("compile_records") / "records.json")
    # and measures peak FLOPS into its own file: with two busy workers a probe reads low, and this machine's cache
    # would keep that figure for the user's runs
    os.environ["TUNELOOP_PEAK_FLOPS"] = str(tmp_path_factory.mktemp("peak_flops") / "peak_flops.json")
    # and bounds the CPU's matmul kernel caches as the command does (host/kernel_caches.py), for its processes' plans
    from tuneloop.host.kernel_caches import bound_kernel_caches

    bound_kernel_caches()


def tiny_rows(count: int, seed: int = 0) -> list[dict]:
    """Alpaca rows of varied lengths, built from a fixed vocabulary of words (deterministic)."""
    import random

    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    rows = []
    for i in range(count):
        instruction = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        output = " ".join(rng.choices(words, k=rng.randint(2, 30)))
        given_input = " ".join(rng.choices(words, k=rng.randint(1, 6))) if i % 3 == 0 else ""
        rows.append({"instruction": instruction, "input": given_input, "output": output})
    return rows


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target = tmp_path_factory.mktemp("tiny_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token=None,
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(target)
    return target


def save_llama(target: Path, tokenizer_dir: Path, **sizes) -> Path:
    """A LLaMA of the given sizes with random weights (seed 0) and the tiny tokenizer, saved in `target`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **sizes)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return save_llama(tmp_path_factory.mktemp("tiny_llama"), tiny_tokenizer_dir, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def free_port() -> int:
    """A TCP port nothing listens on now, for a torchrun/accelerate rendezvous (a fixed one can be taken)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_config(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    assert_rerunnable(keys)
    return path


def assert_rerunnable(keys: dict) -> None:
    """Every config the suite writes that tuneloop accepts is one a run's run_config.yml reruns: that file (every
    key with its value, as the run used it) reads back as the same config."""
    import warnings

    from tuneloop.config import config_from_dict
    from tuneloop.errors import UserError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = config_from_dict(keys)
        except UserError:
            return  # a config the test means to be refused
        written = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        assert config_from_dict(written).model_dump(mode="json") == cfg.model_dump(mode="json")


def base_config(tmp_path: Path, model_dir: Path, data_file: Path, **overrides) -> dict:
    keys = {
        "base_model": str(model_dir),
        "datasets": [{"path": str(data_file), "type": "alpaca"}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"),
        "sequence_len": 256,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "num_epochs": 1,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 7,
        "bf16": False,  # tests that assert equality pin fp32 (bf16: auto is bf16 on this machine's CPU)
    }
    keys.update(overrides)
    return keys


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """The real command line in a fresh process, as a user runs it: for runs that are killed or signalled,
    and for what only a fresh process shows (the exit code of the console entry point)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "tuneloop", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def two_rank_launcher(kind: str = "torchrun", ranks: int = 2) -> list[str]:
    """The command that starts 2 gloo ranks (torchrun: `ranks`) of `-m tuneloop ...`, as a user launches them: torchrun,
    or accelerate.
    On a CPU machine accelerate 1.15 wants --multi_gpu without --cpu (it refuses both; --cpu alone starts ONE
    process); tuneloop's Accelerator(cpu=True) then runs gloo DDP."""
    port = str(free_port())
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", port]
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    return [accelerate, "launch", "--multi_gpu", "--num_processes", str(ranks), "--main_process_port", port]


def run_two_ranks(*args: str, env: dict | None = None, timeout: int = 600,
                  kind: str = "torchrun") -> subprocess.CompletedProcess:
    """`tuneloop ARGS` on 2 gloo ranks (two_rank_launcher), one thread each."""
    command = [*two_rank_launcher(kind), "-m", "tuneloop", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def start_train(config: Path, env: dict | None = None) -> subprocess.Popen:
    """`tuneloop train CONFIG` in a fresh process, left running: for a run that is killed."""
    return subprocess.Popen([sys.executable, "-m", "tuneloop", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, **(env or {})))


def wait_for_steps(output_dir: Path, steps: int, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until metrics.jsonl holds `steps` train lines (or the process ended)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        metrics = output_dir / "metrics.jsonl"
        if metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)


def killed_then_resumed(config: Path, output_dir: Path, after_steps: int,
                        how: str = "signal") -> tuple[Path, subprocess.CompletedProcess]:
    """The suite's one kill-and-resume protocol: the run stopped after `after_steps` steps, then the same command
    again (auto_resume_from_checkpoints), in this process. Returns the checkpoint the resume started from and its
    result (checked: exit 0, "resuming from" it).

    how="sigkill": a true `kill -9` of a fresh process once metrics.jsonl shows the steps (it may have gone a step
    or two further): what only a real kill shows, that whatever the process was doing, a resume finds a whole
    checkpoint. One such test per engine and data kind; the kills inside a save are the crash-during-save tests.
    how="signal": SIGTERM raised inside this process at the end of that step (the signal-at-step hook): the run
    checkpoints and exits 75, as on a preemption, without a fresh interpreter."""
    from tuneloop.run_files import complete_checkpoints
    from tuneloop.train.guards import SIGNAL_AT_STEP_ENV

    if how == "sigkill":
        import signal

        process = start_train(config)
        wait_for_steps(output_dir, after_steps, process)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert process.returncode == -signal.SIGKILL, f"the run ended before the kill after step {after_steps}"
    else:
        assert how == "signal", how
        os.environ[SIGNAL_AT_STEP_ENV] = f"0:{after_steps}"
        try:
            stopped = run_in_process("train", str(config))
        finally:
            del os.environ[SIGNAL_AT_STEP_ENV]
        assert stopped.returncode == 75, stopped.stdout[-2000:] + stopped.stderr[-2000:]
        assert f"stopped by a signal after step {after_steps}" in stopped.stdout, stopped.stdout[-2000:]
    newest = complete_checkpoints(output_dir)[-1]
    resumed = run_in_process("train", str(config))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming from {newest}" in resumed.stdout, resumed.stdout[-2000:]
    return newest, resumed


def run_in_one_launch(*runs, env: dict | None = None, timeout: int = 1200,
                      ranks: int = 2) -> list[subprocess.CompletedProcess]:
    """Several `tuneloop` commands one after another in ONE torchrun launch of `ranks` gloo ranks
    (tests/launch_runs.py). Each run is a list of arguments, or (arguments, env for that run alone), or
    {"args": ..., "env": ..., "then_copy": (FROM, TO)} (rank 0 copies FROM to TO after the run: a folder as the run
    left it, before the next run changes it). A launch costs an interpreter importing torch and transformers per rank
    (~7 s each here), and a proof of "N ranks == one process" often needs several runs: they share it.
    Each run comes back as a launch of its own would: the first non-zero exit code of its ranks, and what its ranks
    printed (rank 0's, then rank 1's, ...). A run after one that killed its process (the kill-during-save hook) or
    raised did not happen: it comes back with the launch's exit code and output, and so does the run that ended it."""
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="tuneloop_launch_"))
    spec = [run if isinstance(run, dict) else {"args": list(run), "env": {}} if isinstance(run[0], str)
            else {"args": list(run[0]), "env": run[1]} for run in runs]
    for run in spec:
        run["args"] = [str(arg) for arg in run["args"]]
        run["then_copy"] = [str(path) for path in run.get("then_copy", ())]
    (workdir / "runs.json").write_text(json.dumps(spec))
    launch = subprocess.run([*two_rank_launcher(ranks=ranks), str(Path(__file__).with_name("launch_runs.py")),
                             str(workdir / "runs.json"), str(workdir)], capture_output=True, text=True,
                            timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    results = []
    for index, run in enumerate(spec):
        said = [json.loads((workdir / f"{index}.{rank}.json").read_text()) for rank in range(ranks)
                if (workdir / f"{index}.{rank}.json").is_file()]
        command = ["tuneloop", *run["args"]]
        if len(said) < ranks:  # this run ended the launch, or came after the run that did
            results.append(subprocess.CompletedProcess(command, launch.returncode or -9, launch.stdout,
                                                       launch.stderr))
            continue
        code = next((rank["returncode"] for rank in said if rank["returncode"]), 0)
        results.append(subprocess.CompletedProcess(command, code, "".join(rank["stdout"] for rank in said),
                                                   "".join(rank["stderr"] for rank in said)))
    return results


def assert_every_rank_stopped_with(result: subprocess.CompletedProcess, message: str) -> None:
    """A two-rank user error: both ranks print the message and exit 2; the one traceback is torchrun's own
    report that a child exited non-zero, and no rank died of gloo's connection-closed error."""
    assert result.returncode != 0
    assert result.stderr.count(message) == 2, result.stderr[-3000:]
    assert result.stderr.count("Traceback") == 1 and "raise ChildFailedError" in result.stderr
    assert "Connection closed" not in result.stderr and "exitcode  : 2" in result.stderr


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    """`tuneloop ARGS` through the same code as the command line (cli.main), in this process: no kill, signal
    or second rank involved, and without the ~7 s that starting an interpreter with torch and transformers
    costs here. Output is captured as a subprocess's would be; an unexpected exception fails the test with
    its traceback. (Each single-process run forgets accelerate's process-wide state when it ends, so runs
    with different settings follow each other in one process.)"""
    import contextlib
    import io

    from tuneloop.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return subprocess.CompletedProcess(["tuneloop", *args], code, out.getvalue(), err.getvalue())


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """What every user error must look like: exit code 2, one message (one `error:` line, which may run on
    over indented lines), no Python traceback; and each fragment in the message."""
    assert result.returncode == 2, result.stdout[-1500:] + result.stderr[-1500:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr[-3000:])


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
