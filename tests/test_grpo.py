"""Online RL end to end on a tiny LLaMA, in fp32: the plan equals the run (steps, completions, generated tokens),
accumulation equals one batch where TRL's normalisation spans the step, 2 gloo ranks equal one process on the same
completions (group advantages over the whole group wherever its completions live), a SIGKILL mid-save resumes bit
for bit (inside a generation's num_iterations too), and bad input is one line and exit 2."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest
import torch
from conftest import assert_user_error, read_metrics, run_cli, run_in_process, write_config, write_jsonl
from safetensors.torch import load_file

WORDS = ["cat", "dog", "sun", "tree", "red", "blue", "one", "two", "fish", "bird", "moon", "star"]
REWARDS = textwrap.dedent('''
    def short(prompts, completions, **kwargs):
        return [-len(c[0]["content"]) / 10 for c in completions]

    def has_word(prompts, completions, word, trainer_state, **kwargs):
        assert 0 <= trainer_state.global_step < trainer_state.max_steps  # TRL's progress, for a curriculum
        return [1.0 if w in c[0]["content"] else None if w == "one" else 0.0 for c, w in zip(completions, word)]

    def broken(prompts, completions, **kwargs):
        raise KeyError("answer")

    def too_few(prompts, completions, **kwargs):
        return [0.0]

    def wordy(prompts, completions, **kwargs):
        return ["good"] * len(completions)

    def endless(prompts, completions, **kwargs):
        return [float("inf")] * len(completions)

    def not_a_number(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    def unscored(prompts, completions, **kwargs):
        return [None] * len(completions)

    def no_kwargs(prompts, completions, completion_ids, trainer_state):
        return [0.0] * len(completions)

    def as_prompt(cfg):
        def transform(row, tokenizer=None):
            return {"prompt": [{"role": "user", "content": "say " + row["text"]}], "word": row["text"]}
        return transform, {"remove_columns": ["text"]}
''')


@pytest.fixture
def grpo_dir(tmp_path):
    """A run's folder: rewards.py beside the config (found there, as axolotl users keep it), and prompts."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_jsonl(tmp_path / "prompts.jsonl",
                [{"prompt": [{"role": "user", "content": f"say {w}"}], "word": w} for w in WORDS[:8]])
    write_jsonl(tmp_path / "words.jsonl", [{"text": w} for w in WORDS])
    return tmp_path


def grpo_config(run_dir, model_dir, name="run.yml", trl=None, **keys):
    """A GRPO config in `run_dir`, its rewards.py beside it; the prompts are run_dir's unless `datasets` says."""
    if not (run_dir / "rewards.py").is_file():
        (run_dir / "rewards.py").write_text(REWARDS)
    settings = {"num_generations": 4, "max_completion_length": 8, "reward_funcs": ["rewards.short", "rewards.has_word"],
                **(trl or {})}
    values = {"base_model": str(model_dir), "rl": "grpo", "trl": settings,
              "datasets": [{"path": str(run_dir / "prompts.jsonl")}],
              "output_dir": str(run_dir / "out"), "sequence_len": 64, "micro_batch_size": 4,
              "gradient_accumulation_steps": 2, "max_steps": 2, "learning_rate": 1e-2, "optimizer": "adamw_torch",
              "lr_scheduler": "constant", "logging_steps": 1, "save_strategy": "no", "seed": 7, "bf16": False, **keys}
    return write_config(run_dir / name, **values)


def weights(out) -> dict:
    return load_file(out / "model.safetensors")


def test_plan_equals_run_and_rewards_reach_the_step_lines(grpo_dir, tiny_model_dir):
    """Completions of exactly max_completion_length (min_new_tokens keeps eos away): the run generates the plan's
    upper bound of tokens, in the plan's steps, and its lines carry each reward function's mean."""
    config = grpo_config(grpo_dir, tiny_model_dir, max_steps=3,
                         trl={"generation_kwargs": {"min_new_tokens": 8}, "log_completions": True})
    planned = run_in_process("plan", str(config))
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "8 completions per optimizer step = 2 prompts × 4 generations" in planned.stdout
    assert "a step no function scores stops the run (trl.unscored_steps_allowed: 0)" in planned.stdout
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    out = grpo_dir / "out"
    plan = json.loads((out / "plan.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == plan["total_steps"] == 3
    assert plan["rollout"]["completions_per_step"] == 8 and plan["rollout"]["prompts_per_step"] == 2
    assert summary["tokens"] == plan["rollout"]["generated_tokens_at_most"] == 3 * 8 * 8
    lines = read_metrics(out)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["completion_length"] == 8 and line["truncated_ratio"] == 1 for line in lines)
    assert all(isinstance(line["rewards/short"], float) and "rewards/has_word" in line for line in lines)
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 3 * 8 and {record["step"] for record in logged} == {1, 2, 3}
    assert all(set(record["rewards"]) == {"short", "has_word"} for record in logged)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_accumulation_equals_one_batch(grpo_dir, tiny_model_dir, loss_type):
    """8 completions as one micro-batch or as 4 × 2 accumulated: each rank generates its 8 in one batch under
    the same seed either way, so the completions are the same, and the normalisation spans the step. SGD: Adam
    would turn the float-rounding difference of a near-zero gradient into a full-size step of either sign."""
    results = {}
    for name, micro, accumulation in (("one", 8, 1), ("accumulated", 4, 2)):
        run_dir = grpo_dir / name
        run_dir.mkdir()
        config = grpo_config(run_dir, tiny_model_dir, trl={"loss_type": loss_type, "beta": 0.05},
                             micro_batch_size=micro, gradient_accumulation_steps=accumulation, optimizer="sgd",
                             learning_rate=0.1, datasets=[{"path": str(grpo_dir / "prompts.jsonl")}])
        result = run_in_process("train", str(config))
        assert result.returncode == 0, result.stderr[-3000:]
        results[name] = (weights(run_dir / "out"), read_metrics(run_dir / "out"))
    (one, one_lines), (accumulated, accumulated_lines) = results["one"], results["accumulated"]
    assert [line["reward"] for line in one_lines] == [line["reward"] for line in accumulated_lines]
    start = weights_of_base(tiny_model_dir)
    for key in one:
        torch.testing.assert_close(accumulated[key], one[key], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(one[key], start[key]) for key in one)  # (it trained)


def weights_of_base(model_dir) -> dict:
    return load_file(model_dir / "model.safetensors")


def fixed_completions(path, tokenizer_dir, prompts: int) -> str:
    """Four completions per prompt, of different lengths (two end in eos), the same for every run that reads it."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    generator = torch.Generator().manual_seed(11)
    table = {}
    for prompt in range(prompts):
        table[str(prompt)] = [torch.randint(10, 300, (length,), generator=generator).tolist() + ([eos] if end else [])
                              for length, end in ((3, True), (8, False), (5, True), (8, False))]
    path.write_text(json.dumps(table))
    return str(path)


@pytest.mark.slow
def test_killed_mid_save_resumes_bit_identical_inside_a_generation(grpo_dir, tiny_model_dir):
    """num_iterations 2 with a LoRA adapter and a KL term: checkpoint-3 falls inside generation 2 (steps 3 and 4),
    so its rollout is kept with it. A SIGKILL while writing checkpoint-6, then a resume from checkpoint-3, ends
    with the uninterrupted run's adapter, bit for bit, and the same completions log."""
    from tuneloop.run_files import complete_checkpoints
    from tuneloop.train.checkpoint import CRASH_DURING_SAVE_ENV

    keys = {"max_steps": 8, "save_steps": 3, "save_strategy": "steps", "auto_resume_from_checkpoints": True,
            "adapter": "lora", "lora_r": 4,
            "lora_target_linear": True, "trl": {"num_iterations": 2, "beta": 0.1, "log_completions": True},
            "datasets": [{"path": str(grpo_dir / "prompts.jsonl")}]}
    configs = {}
    for name in ("straight", "crashed"):
        (grpo_dir / name).mkdir()
        configs[name] = str(grpo_config(grpo_dir / name, tiny_model_dir, **keys))
    straight = run_in_process("train", configs["straight"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = run_cli("train", configs["crashed"], env={CRASH_DURING_SAVE_ENV: "6"})
    assert crashed.returncode != 0
    out = grpo_dir / "crashed" / "out"
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-3"]
    resumed = run_in_process("train", configs["crashed"])
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    expected = load_file(grpo_dir / "straight" / "out" / "adapter_model.safetensors")
    got = load_file(out / "adapter_model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert (out / "completions.jsonl").read_text() == (grpo_dir / "straight" / "out" / "completions.jsonl").read_text()
    assert [line.get("kl") is not None for line in read_metrics(out)] == [True] * 8


def test_gdpo_with_a_transform_and_reward_functions_beside_the_config(grpo_dir, tiny_model_dir, monkeypatch):
    """`rl: gdpo` on rows made by a `type: rewards.as_prompt` transform; the reward module is found in the config's
    folder although the run starts elsewhere."""
    monkeypatch.chdir(tiny_model_dir)
    monkeypatch.delitem(sys.modules, "rewards", raising=False)  # (an earlier in-process run's, from another folder)
    config = grpo_config(grpo_dir, tiny_model_dir, rl="gdpo", datasets=[{"path": str(grpo_dir / "words.jsonl"),
                                                                        "type": "rewards.as_prompt"}])
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((grpo_dir / "out" / "plan.json").read_text())
    assert plan["rollout"]["aggregation"] == "normalize_then_sum" and plan["train_rows"] == len(WORDS)


@pytest.mark.parametrize("change,fragments", [
    ({"trl": {"reward_funcs": None}}, ["`rl: grpo` scores its completions with `trl.reward_funcs`"]),
    ({"trl": {"reward_funcs": ["nowhere.correct"]}}, ["does not import", "No module named 'nowhere'", "searched"]),
    ({"trl": {"reward_funcs": ["rewards.missing"]}}, ["has no `missing`"]),
    ({"trl": {"reward_funcs": ["rewards.shrot"]}}, ["has no `shrot`", "did you mean `rewards.short`",
                                                    "has_word, broken, too_few"]),
    ({"trl": {"num_generations": 1}}, ["num_generations", "a group of one completion"]),
    ({"micro_batch_size": 3}, ["global batch is 6 completions", "num_generations 4"]),
    ({"trl": {"max_completion_length": 64}}, ["leaves no room for a prompt", "sequence_len: 64"]),
    ({"trl": {"vllm_server_port": 8000}}, ["trl.vllm_server_port", "use_vllm"]),
    ({"trl": {"loss_type": "ppo"}}, ["TRL's GRPO losses are grpo, bnpo"]),
    ({"trl": {"sync_ref_model": True}}, ["trl.sync_ref_model", "follows the policy"]),
    ({"rl": "ebft"}, ["prompts.jsonl:1", "`rl: ebft` compares each completion", "`ground_truth` text"]),
    ({"rl_beta": 0.1}, ["`rl_beta`", "trl.beta"]),
    ({"val_set_size": 0.1}, ["has no eval set"]),
    ({"trl": {"generation_kwargs": {"presence_penalty": 0.5}}}, ["trl.generation_kwargs.presence_penalty",
                                                                 "not a setting of transformers' generate"]),
    ({"trl": {"generation_kwargs": {"max_tokens": 20}}}, ["trl.generation_kwargs.max_tokens",
                                                          "trl.max_completion_length"]),
    ({"trl": {"vllm_structured_outputs_regex": "[0-9]+"}}, ["trl.vllm_structured_outputs_regex", "use_vllm"]),
    ({"trl": {"use_vllm": True, "vllm_mode": "colocate"}}, ["vllm_mode: colocate", "transformers < 5.21",
                                                            "vllm_mode: server"]),
    ({"trl": {"use_vllm": True, "vllm_gpu_memory_utilization": 0.3}}, ["trl.vllm_gpu_memory_utilization",
                                                                       "colocated", "`vllm:` block"]),
    ({"trl": {"use_vllm": True, "async_prefetch": True, "prefetch_depth": 2}}, ["trl.prefetch_depth",
                                                                                "one step"]),
    ({"trl": {"use_vllm": True, "vllm_importance_sampling_mode": "sequence"}}, ["vllm_importance_sampling_mode",
                                                                                "sequence_mask"]),
    ({"trl": {"use_vllm": True, "generation_kwargs": {"no_repeat_ngram_size": 2}}},
     ["trl.generation_kwargs.no_repeat_ngram_size", "not a vLLM sampling parameter"]),
    ({"trl": {"use_vllm": True}, "vllm": {"data_parallel_size": 2}}, ["vllm.data_parallel_size", "one"]),
])
def test_bad_input_is_one_line_and_exit_2(grpo_dir, tiny_model_dir, change, fragments):
    trl = change.pop("trl", {})
    if trl.get("reward_funcs", "") is None:
        trl = {"reward_funcs": []}
    config = grpo_config(grpo_dir, tiny_model_dir, trl=trl, **change)
    assert_user_error(run_in_process("plan", str(config)), *fragments)


@pytest.mark.parametrize("reward,fragments", [
    ("rewards.broken", ["reward `broken` raised KeyError: 'answer'", "prompts.jsonl:"]),
    ("rewards.too_few", ["reward `too_few` returned 1 values for 8 completions"]),
    ("rewards.wordy", ["reward `wordy` returned 'good'", "prompts.jsonl:"]),
    ("rewards.endless", ["reward `endless` returned inf", "a finite number"]),
    # (NaN is no reward either: the steps trained nothing, grad_norm 0, and the run said "done")
    ("rewards.not_a_number", ["reward `not_a_number` returned nan", "a finite number"]),
    # (Python's own TypeError said "unexpected keyword argument 'word'" and nothing of why it was passed)
    ("rewards.no_kwargs", ["reward `no_kwargs` does not take the dataset column `word`", "**kwargs",
                           "TRL passes every column by name"]),
])
def test_a_failing_reward_stops_the_run_with_exit_2_and_no_changed_weights(grpo_dir, tiny_model_dir, reward,
                                                                          fragments):
    config = grpo_config(grpo_dir, tiny_model_dir, trl={"reward_funcs": [reward]})
    result = run_in_process("train", str(config))
    assert_user_error(result, *fragments, "no weight of this step changed")
    assert not (grpo_dir / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("allowed,stopped_at", [(None, 1), (1, 2)])
def test_a_step_no_reward_scores_stops_the_run_after_the_grace(grpo_dir, tiny_model_dir, allowed, stopped_at):
    """A function that returns None for every completion leaves every advantage 0: the step would train nothing and
    say so nowhere. The run stops at the first such step beyond `trl.unscored_steps_allowed` (0 unless set), naming
    the function and the columns it was given; the steps allowed before it trained and were logged."""
    trl = {"reward_funcs": ["rewards.unscored"], **({"unscored_steps_allowed": allowed} if allowed else {})}
    config = grpo_config(grpo_dir, tiny_model_dir, trl=trl, max_steps=3)
    result = run_in_process("train", str(config))
    assert_user_error(result, f"step {stopped_at}: no reward function scored any of the step's 8 completions",
                      "rewards.unscored returned None for every one", "columns: word",
                      f"trl.unscored_steps_allowed: {stopped_at}", "no weight of this step changed")
    logged = read_metrics(grpo_dir / "out") if (grpo_dir / "out" / "metrics.jsonl").exists() else []
    assert [line["step"] for line in logged] == list(range(1, stopped_at))


def test_two_rewards_of_one_name_are_logged_apart(grpo_dir, tiny_model_dir):
    """`rewards.short` and `other.short`: each on the train line, in completions.jsonl and to the trackers under the
    name the config gives it (a name both share would log one and hide the other)."""
    (grpo_dir / "other.py").write_text("def short(prompts, completions, **kwargs):\n"
                                       "    return [float(len(c[0]['content'])) for c in completions]\n")
    config = grpo_config(grpo_dir, tiny_model_dir, max_steps=1,
                         trl={"reward_funcs": ["rewards.short", "other.short", "rewards.has_word"],
                              "log_completions": True})
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    line = read_metrics(grpo_dir / "out")[0]
    assert {"rewards/rewards.short", "rewards/other.short", "rewards/has_word"} <= set(line), line
    assert line["rewards/rewards.short"] != line["rewards/other.short"]
    logged = json.loads((grpo_dir / "out" / "completions.jsonl").read_text().splitlines()[0])
    assert set(logged["rewards"]) == {"rewards.short", "other.short", "has_word"}


def test_a_vllm_server_that_does_not_answer_is_exit_2_before_the_data_is_read(grpo_dir, tiny_model_dir):
    """trl.use_vllm with nothing listening at the port: one line naming the URL and `tuneloop vllm-serve`, and the
    prompts never read (their file is missing: reading it would be another error)."""
    from conftest import free_port

    port = free_port()
    config = grpo_config(grpo_dir, tiny_model_dir, datasets=[{"path": str(grpo_dir / "missing.jsonl")}],
                         trl={"use_vllm": True, "vllm_server_port": port, "vllm_server_timeout": 0})
    assert_user_error(run_in_process("train", str(config)), f"http://127.0.0.1:{port}",
                      "tuneloop vllm-serve CONFIG")


def test_dataset_shards_take_every_nth_prompt(grpo_dir, tiny_model_dir):
    """axolotl's dataset_shard_num/idx keep every N-th row for online RL's prompts too (as prepare.py does for SFT)."""
    write_jsonl(grpo_dir / "many.jsonl", [{"prompt": f"say {w} {i}", "word": w} for i in range(6) for w in WORDS])
    config = grpo_config(grpo_dir, tiny_model_dir, datasets=[{"path": str(grpo_dir / "many.jsonl")}],
                         dataset_shard_num=3, dataset_shard_idx=1)
    planned = run_in_process("plan", str(config), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert json.loads(planned.stdout)["train_rows"] == 6 * len(WORDS) // 3


def test_a_step_whose_completions_are_all_masked_trains_nothing(grpo_dir, tiny_model_dir):
    """mask_truncated_completions with every completion cut at the limit: no completion token is trained, the
    step's loss is 0 over no units (not a division by zero), and the weights stay as they were."""
    config = grpo_config(grpo_dir, tiny_model_dir, optimizer="sgd",
                         trl={"mask_truncated_completions": True, "generation_kwargs": {"min_new_tokens": 8}})
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = read_metrics(grpo_dir / "out")
    assert all(line["loss"] == 0 and line["truncated_ratio"] == 1 for line in lines)
    start, end = weights_of_base(tiny_model_dir), weights(grpo_dir / "out")
    assert all(torch.equal(start[key], end[key]) for key in start)


def test_check_and_preprocess_describe_an_online_rl_config(grpo_dir, tiny_model_dir):
    config = grpo_config(grpo_dir, tiny_model_dir)
    checked = run_in_process("check", str(config))
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert "data                 prompts (" in checked.stdout
    assert "rl: grpo, 4 generations per prompt of at most 8 tokens, loss_type dapo" in checked.stdout
    shown = run_in_process("preprocess", str(config), "--show", "1")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "read 8 prompts" in shown.stdout and "columns for the rewards: word='cat'" in shown.stdout
    assert "<|im_start|>assistant" in shown.stdout  # the prompt ends with the assistant's turn opened


def test_a_reward_model_folder_scores_the_completions(grpo_dir, tiny_model_dir, tiny_tokenizer_dir):
    """`reward_funcs` may name a folder with a sequence-classification model (num_labels 1): its score of prompt +
    completion is the reward, on the step lines under the folder's name."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    scorer = grpo_dir / "scorer"
    torch.manual_seed(1)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)).save_pretrained(scorer)
    tokenizer.save_pretrained(scorer)
    config = grpo_config(grpo_dir, tiny_model_dir, trl={"reward_funcs": [str(scorer), "rewards.short"]})
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = read_metrics(grpo_dir / "out")
    assert all(isinstance(line["rewards/scorer"], float) and line["rewards/scorer"] != 0 for line in lines)


def test_a_language_model_folder_is_no_reward_model(grpo_dir, tiny_model_dir):
    """A chat model's folder loads as a sequence classifier with a newly initialised (random) score head, and the
    run would train on random rewards: refused when the config is checked, naming the folder and what it is."""
    config = grpo_config(grpo_dir, tiny_model_dir, trl={"reward_funcs": [str(tiny_model_dir), "rewards.short"]},
                         datasets=[{"path": str(grpo_dir / "missing.jsonl")}])  # (refused before the data is read)
    assert_user_error(run_in_process("check", str(config)), f"trl.reward_funcs[0]: {tiny_model_dir}",
                      "LlamaForCausalLM", "not a sequence classifier with one label")


def test_a_reward_model_whose_score_head_is_not_in_its_weights_is_refused(tmp_path, tiny_model_dir):
    """A config.json that says sequence classifier over a language model's weights: transformers' load report
    names the score head as newly initialised, and that is refused as well (its scores would be random)."""
    import shutil

    from tuneloop.errors import UserError
    from tuneloop.online_rl.rewards import RewardModel

    folder = shutil.copytree(tiny_model_dir, tmp_path / "relabelled")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"relabelled: its weights hold no score\.weight"):
        RewardModel(folder, None)


def test_log_completions_reaches_every_tracker(grpo_dir, tiny_model_dir):
    """With `trl.log_completions`, each generation's completions are a TensorBoard text table, a wandb Table and an
    MLflow JSON artifact, at the step that trains on them, besides completions.jsonl."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trackers import wandb_records

    store = grpo_dir / "mlruns"
    config = grpo_config(grpo_dir, tiny_model_dir, trl={"log_completions": True}, use_tensorboard=True,
                         wandb_project="tuneloop-tests", wandb_mode="offline", mlflow_tracking_uri=f"file:{store}",
                         mlflow_experiment_name="grpo")
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    out = grpo_dir / "out"
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    texts = events.Tensors("completions/text_summary")
    assert [event.step for event in texts] == [1, 2]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert first.count("\n") == 1 + 8 and logged[0]["completion"].replace("|", "\\|").split("\n")[0] in first
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    for _ in range(60):  # wandb's own service process writes the file; on a busy machine it may finish after us
        try:
            tables = [{item.nested_key[1]: json.loads(item.value_json) for item in record.history.item
                       if list(item.nested_key[:1]) == ["completions"]}
                      for record in wandb_records(run_file) if record.WhichOneof("record_type") == "history"]
        except Exception:  # a record it is still writing
            tables = []
        if len(tables) == 2:
            break
        time.sleep(0.5)
    assert [(table["_type"], table["nrows"], table["ncols"]) for table in tables] == [("table-file", 8, 4)] * 2
    client = MlflowClient(f"file:{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    artifacts = sorted(item.path for item in client.list_artifacts(run.info.run_id, "completions"))
    assert artifacts == ["completions/step_000001.json", "completions/step_000002.json"]


def test_vllm_serve_starts_the_server_the_run_checks_for(grpo_dir, tiny_model_dir):
    """`tuneloop vllm-serve CONFIG --print`: vLLM's own OpenAI server (never the `vllm` console script) on the
    config's model under the name the run checks, at the training's precision (fp32 here), holding sequence_len,
    with the sampled distribution's log-probs, LoRA at run time for vllm_lora_sync, and a bounded CPU KV cache."""
    config = grpo_config(grpo_dir, tiny_model_dir, adapter="lora", lora_r=12, lora_alpha=16, lora_target_linear=True,
                         trl={"use_vllm": True, "vllm_lora_sync": True, "vllm_server_port": 8123},
                         vllm={"python": sys.executable})
    result = run_in_process("vllm-serve", str(config), "--print")
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout
    for fragment in [f"{sys.executable} ", "vllm_launcher.py", f"--model {tiny_model_dir}",
                     f"--served-model-name {tiny_model_dir}", "--port 8123", "--dtype float32", "--max-model-len 64",
                     "--logprobs-mode processed_logprobs", "--enable-lora --max-lora-rank 16",
                     "VLLM_SERVER_DEV_MODE=1", "VLLM_CPU_KVCACHE_SPACE="]:
        assert fragment in said, (fragment, said)
    plan = run_in_process("plan", str(config))
    assert f"vLLM server at http://127.0.0.1:8123 serving {tiny_model_dir}" in plan.stdout, plan.stdout
    assert "max |Δ| ≤ 0.001 or the run stops" in plan.stdout and "sequence_mask, ratios in [None, 3.0]" in plan.stdout


def test_trls_own_vllm_server_is_refused_naming_why(grpo_dir, tiny_model_dir):
    """A server that answers as TRL's `trl vllm-serve` does (its /get_world_size/ route, no OpenAI routes): refused
    before the data is read, naming NCCL. (TRL's server needs TRL and vLLM in one environment, and `make vllm`'s has
    no TRL: a stand-in answers its route.)"""
    import http.server
    import threading

    class TRLRoutes(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/get_world_size/"
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(b'{"world_size": 1}' if found else b'{"detail": "Not Found"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), TRLRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = grpo_config(grpo_dir, tiny_model_dir, datasets=[{"path": str(grpo_dir / "missing.jsonl")}],
                             trl={"use_vllm": True, "vllm_server_port": server.server_port, "vllm_server_timeout": 0})
        assert_user_error(run_in_process("train", str(config)), "TRL's `trl vllm-serve`", "NCCL",
                          "tuneloop vllm-serve CONFIG")
    finally:
        server.shutdown()
