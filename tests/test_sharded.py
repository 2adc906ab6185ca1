"""Beyond one device's memory, exactly: FSDP2 and DeepSpeed ZeRO over real gloo ranks (torchrun) end with the same
weights as one process on the same global batch, resume exactly after a SIGKILL, and leave a folder that loads with
`from_pretrained` alone. Equality is asserted in fp32 (`bf16: false`)."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import base_config, read_metrics, run_in_process, tiny_rows, write_config, write_jsonl
from safetensors.torch import load_file

STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-2, "max_grad_norm": 1.0, "max_steps": 3,
         "lr_scheduler": "cosine", "warmup_steps": 1, "num_epochs": 1}
FSDP = {"fsdp": ["full_shard", "auto_wrap"],
        "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                        "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}


def config_of(run_dir, model_dir, data, ranks: int = 2, **keys):
    """A run of STEPS in run_dir: one process (micro-batch 2 × 4 accumulated) or 2 ranks (2 × 2 each)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_config(run_dir / "run.yml", **base_config(run_dir, model_dir, data, **STEPS, micro_batch_size=2,
                                                           gradient_accumulation_steps=4 // ranks, **keys))


def checked_weights(run_dir, result, ranks: int, weights: str = "model.safetensors") -> dict:
    """The weights a finished run saved. The plan and the summary are checked on the way: the plan's memory per rank
    against what each rank held."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    plan = json.loads((run_dir / "out" / "plan.json").read_text())
    summary = json.loads((run_dir / "out" / "summary.json").read_text())
    assert summary["steps"] == plan["total_steps"] == STEPS["max_steps"]
    held, planned = summary["held_bytes_per_rank"], plan["memory"]["per_rank_bytes"]
    assert len(held) == ranks
    for rank in held:  # the plan's bytes per rank are the engine's own, within the padding of uneven shards
        for part in ("weights", "optimizer"):
            assert rank[part] == pytest.approx(planned[part], rel=0.03), (part, held, planned)
    return load_file(run_dir / "out" / weights)


def trained_in_one_process(tmp_path, model_dir, data, name, **keys) -> dict:
    """The weights after STEPS in this process (config_of), checked (checked_weights)."""
    config = config_of(tmp_path / name, model_dir, data, ranks=1, **keys)
    return checked_weights(tmp_path / name, run_in_process("train", str(config)), ranks=1)


def relative_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", tiny_rows(64, seed=3))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, data) -> dict:
    return {packed: trained_in_one_process(tmp_path_factory.mktemp("one"), tiny_model_dir, data, "one",
                                           sample_packing=packed) for packed in (False, True)}


LORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "down_proj"])


def dpo_pairs(folder):
    import random

    from conftest import CORPUS

    words = " ".join(CORPUS).split()
    rng = random.Random(4)
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 10)))}],
             "chosen": " ".join(rng.choices(words, k=rng.randint(2, 14))),
             "rejected": " ".join(rng.choices(words, k=rng.randint(2, 14)))} for _ in range(32)]
    return write_jsonl(folder / "pairs.jsonl", rows)


def dpo_keys(pairs) -> dict:
    return dict(rl="dpo", rl_beta=0.1, datasets=[{"path": str(pairs), "type": "chat_template"}])


def deepspeed_keys(stage: int) -> dict:
    return {"deepspeed": f"zero{stage}"}  # a config shipped with tuneloop, by name


RESUMABLE = dict(micro_batch_size=2, max_steps=8, save_strategy=None, save_steps=3, learning_rate=1e-2,
                 warmup_steps=2, val_set_size=0.15, eval_steps=8, auto_resume_from_checkpoints=True,
                 optimizer="adamw_torch")
# (ZeRO-3's own paths, the partitioned weights gathered for the final folder, are in the equivalence test above;
# its checkpoints are DeepSpeed's save_checkpoint, as ZeRO-2's)
ENGINE_KEYS = {"fsdp2": FSDP, "zero2": deepspeed_keys(2)}


def resumable_config(run_dir, model_dir, data, engine: str) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    return str(write_config(run_dir / "run.yml",
                            **base_config(run_dir, model_dir, data, **RESUMABLE, **ENGINE_KEYS[engine])))


def efficient_loading_config(run_dir, model_dir, data, efficient: bool) -> str:
    run_dir.mkdir(parents=True)
    fsdp = {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_version": 2,
                                                                 "fsdp_cpu_ram_efficient_loading": efficient}}
    return str(write_config(run_dir / "run.yml", **base_config(
        run_dir, model_dir, data, optimizer="adamw_torch", learning_rate=1e-3, max_steps=1, micro_batch_size=2,
        **fsdp)))


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_model_dir, tiny_tokenizer_dir, data):
    """Every two-rank run of this module, in three torchrun launches (a launch costs two fresh interpreters; the
    runs follow each other in them, tests/launch_runs.py). Launch 1 holds the equalities and ends with rank 0
    SIGKILLed inside FSDP2's save of checkpoint-6; launch 2 resumes it and ends with the same kill under ZeRO-2;
    launch 3 resumes that. Each killed folder is copied as the kill left it, for the checks a test makes there.
    The two runs that compare a rank's peak host memory each open a launch: the peak is the process's."""
    import shutil

    from conftest import run_in_one_launch, save_llama

    from tuneloop.train.checkpoint import CRASH_DURING_SAVE_ENV

    root = tmp_path_factory.mktemp("sharded")
    big_model = save_llama(root / "llama-26m", tiny_tokenizer_dir, hidden_size=1024, intermediate_size=2816,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8)
    pairs = dpo_pairs(root)
    equalities = {
        "fsdp_padded": config_of(root / "fsdp_padded", tiny_model_dir, data, sample_packing=False, **FSDP),
        "fsdp_packed": config_of(root / "fsdp_packed", tiny_model_dir, data, sample_packing=True, **FSDP),
        **{f"zero{stage}": config_of(root / f"zero{stage}", tiny_model_dir, data, sample_packing=False,
                                     **deepspeed_keys(stage)) for stage in (1, 2, 3)},
        "lora_fsdp": config_of(root / "lora_fsdp", tiny_model_dir, data, **LORA, **FSDP),
        "dpo_fsdp": config_of(root / "dpo_fsdp", tiny_model_dir, pairs, **dpo_keys(pairs), **FSDP),
        **{f"{engine}_straight": resumable_config(root / f"{engine}_straight", tiny_model_dir, data, engine)
           for engine in ENGINE_KEYS},
    }
    crashed = {engine: resumable_config(root / f"{engine}_crashed", tiny_model_dir, data, engine)
               for engine in ENGINE_KEYS}
    rank_0 = efficient_loading_config(root / "rank_0", big_model, data, efficient=True)
    every_rank = efficient_loading_config(root / "every_rank", big_model, data, efficient=False)

    def kept_as_killed(engine: str) -> None:
        shutil.copytree(root / f"{engine}_crashed" / "out", root / f"{engine}_as_killed" / "out")

    results = dict(zip(["rank_0", *equalities, "fsdp2_crash"], run_in_one_launch(
        ["train", rank_0], *(["train", str(config)] for config in equalities.values()),
        (["train", crashed["fsdp2"]], {CRASH_DURING_SAVE_ENV: "6"}))))
    kept_as_killed("fsdp2")
    results.update(zip(["fsdp2_resumed", "zero2_crash"], run_in_one_launch(
        ["train", crashed["fsdp2"]], (["train", crashed["zero2"]], {CRASH_DURING_SAVE_ENV: "6"}))))
    kept_as_killed("zero2")
    results.update(zip(["every_rank", "zero2_resumed"], run_in_one_launch(
        ["train", every_rank], ["train", crashed["zero2"]])))
    return root, results


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_two_fsdp2_ranks_equal_one_process(launched, one_process, packed):
    root, results = launched
    name = "fsdp_packed" if packed else "fsdp_padded"
    two = checked_weights(root / name, results[name], 2)
    plan = json.loads((root / name / "out" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["global_batch_size"] == 8
    assert relative_difference(two, one_process[packed]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_deepspeed_zero_ranks_equal_one_process(launched, one_process, stage):
    root, results = launched
    two = checked_weights(root / f"zero{stage}", results[f"zero{stage}"], 2)
    assert relative_difference(two, one_process[False]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINE_KEYS)
def test_a_sharded_run_killed_mid_save_resumes_bit_identical_and_leaves_a_plain_hf_folder(
        launched, tiny_model_dir, data, engine):
    """Rank 0 is SIGKILLed while writing checkpoint-6 (its shards already in); the resume from checkpoint-3 ends
    with the weights of the uninterrupted run, bit for bit. Beside it, on the folder as the kill left it: resuming on
    one process is refused naming both world sizes; with --force-resume FSDP2 redistributes its shards over the new
    ranks, while DeepSpeed's ZeRO partitions cannot be and the refusal says so. The final folder loads with
    from_pretrained alone and gives the eval loss the sharded model gave at the last step."""
    from conftest import assert_user_error

    from tuneloop.engines.base import SHARDS
    from tuneloop.run_files import complete_checkpoints

    root, results = launched
    assert results[f"{engine}_straight"].returncode == 0, results[f"{engine}_straight"].stderr[-3000:]
    assert results[f"{engine}_crash"].returncode != 0
    as_killed = root / f"{engine}_as_killed"
    assert [p.name for p in complete_checkpoints(as_killed / "out")] == ["checkpoint-3"]
    assert (as_killed / "out" / "checkpoint-3" / SHARDS).is_dir()  # each rank's piece of the weights and optimizer

    config = resumable_config(as_killed, tiny_model_dir, data, engine)
    assert_user_error(run_in_process("train", config), "world_size (2 → 1)", "--force-resume")
    forced = run_in_process("train", config, "--force-resume")
    if engine == "fsdp2":
        assert forced.returncode == 0 and "resuming from" in forced.stdout, forced.stderr[-3000:]
        summary = json.loads((as_killed / "out" / "summary.json").read_text())
        assert summary["steps"] == json.loads((as_killed / "out" / "plan.json").read_text())["total_steps"]
    else:
        assert_user_error(forced, "was written by 2 ranks and this run has 1")

    resumed = results[f"{engine}_resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    out = root / f"{engine}_crashed" / "out"
    expected = load_file(root / f"{engine}_straight" / "out" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    # the gathered folder is a plain Hugging Face model: `tuneloop eval` loads it with from_pretrained alone
    last_eval = [m for m in read_metrics(out) if "eval_loss" in m][-1]
    assert last_eval["step"] == RESUMABLE["max_steps"]
    evaluated = run_in_process("eval", str(root / f"{engine}_crashed" / "run.yml"))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(
        last_eval["eval_loss"], rel=1e-6)


@pytest.mark.slow
def test_lora_under_fsdp2_two_ranks_equal_one_process(tmp_path, launched, tiny_model_dir, data):
    """The seed's recipe without the 4-bit part: the base frozen and sharded, the adapters sharded and trained."""
    root, results = launched
    one_config = config_of(tmp_path / "one", tiny_model_dir, data, ranks=1, **LORA)
    result = run_in_process("train", str(one_config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    one = load_file(tmp_path / "one" / "out" / "adapter_model.safetensors")
    two = checked_weights(root / "lora_fsdp", results["lora_fsdp"], 2, "adapter_model.safetensors")
    assert one.keys() == two.keys()
    # lora_B starts at zero, so it is the training alone (lora_A's random start would hide a wrong update)
    trained_b = [key for key in one if "lora_B" in key]
    assert trained_b and all(float(one[key].abs().max()) > 0 for key in trained_b)
    assert relative_difference({k: two[k] for k in trained_b}, {k: one[k] for k in trained_b}) < 1e-5
    assert not (root / "lora_fsdp" / "out" / "model.safetensors").exists()  # the adapter alone, as without FSDP


# ---- the keys as users write them: accepted, warned about, or refused naming the key and the fix -----------------
def check_config(tmp_path, tiny_model_dir, data, **keys) -> subprocess.CompletedProcess:
    config = write_config(tmp_path / "check.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    return run_in_process("check", str(config))


@pytest.mark.parametrize("keys, fragments", [
    ({"deepspeed": "zero2", **FSDP}, ["`deepspeed` and `fsdp`/`fsdp_config` ask for two engines at once"]),
    ({"fsdp": ["hybrid_shard", "auto_wrap"], "fsdp_config": {"fsdp_version": 2}}, ["hybrid sharding", "full_shard"]),
    ({"fsdp": ["full_shard"], "fsdp_config": {"fsdp_version": 2, "reshard_after_foward": True}},
     ["`fsdp_config.reshard_after_foward`", "did you mean `reshard_after_forward`?"]),
    ({"fsdp": ["full_shard"], "fsdp_config": {"auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_version": 2}},
     ["size-based wrapping"]),
    ({"deepspeed": "zero4.json"}, ["`deepspeed: zero4.json`: no such file", "zero1, zero1_torch_compile, zero2"]),
    ({"deepspeed": {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}},
     ["has a `optimizer` block", "`optimizer:`"]),
    ({"adapter": "lora", "load_in_8bit": True, "lora_target_linear": True, **FSDP},
     ["`load_in_8bit` with `fsdp` asks for 8-bit weights under FSDP2", "`adapter: qlora`"]),
    ({"adapter": "qlora", "lora_target_linear": True, "bf16": True, **FSDP,
      "bnb_config_kwargs": {"bnb_4bit_quant_storage": "float32"}},
     ["`bnb_config_kwargs.bnb_4bit_quant_storage: float32` under fsdp2", "in bfloat16 (`bf16`)",
      "set bnb_4bit_quant_storage to bfloat16"]),
    ({"adapter": "qlora", "lora_target_linear": True, "bf16": True, "deepspeed": "zero2",
      "bnb_config_kwargs": {"bnb_4bit_quant_storage": "float16"}},
     ["`bnb_config_kwargs.bnb_4bit_quant_storage: float16` under deepspeed", "to bfloat16 (its bf16 block)"]),
    ({"fsdp": ["full_shard"], "fsdp_config": {"fsdp_version": 2, "sharding_strategy": 4}}, ["hybrid sharding"]),
])
def test_sharding_keys_that_cannot_run_are_refused_naming_the_key(tmp_path, tiny_model_dir, data, keys, fragments):
    from conftest import assert_user_error

    assert_user_error(check_config(tmp_path, tiny_model_dir, data, **keys), *fragments)


BITSANDBYTES_OPTIMIZERS = ["adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"]


@pytest.mark.parametrize("optimizer", BITSANDBYTES_OPTIMIZERS)
def test_a_bitsandbytes_optimizer_under_fsdp2_is_refused_by_check_and_train_alike(tmp_path, tiny_model_dir, data,
                                                                                   optimizer):
    """It used to pass `check` and stop at the first optimizer step with a traceback on every rank (the test below
    says why); DDP ranks and DeepSpeed step plain tensors, and keep it."""
    from conftest import assert_user_error

    from tuneloop.config import config_from_dict

    keys = base_config(tmp_path, tiny_model_dir, data, **{**STEPS, **FSDP, "optimizer": optimizer})
    config = write_config(tmp_path / "run.yml", **keys)
    fragments = (f"`optimizer: {optimizer}` with `fsdp` asks for a bitsandbytes optimizer under FSDP2",
                 "`optimizer: adamw_torch_fused`", "DDP ranks or DeepSpeed")
    assert_user_error(run_in_process("check", str(config)), *fragments)
    assert_user_error(run_in_process("train", str(config)), *fragments)
    assert not (tmp_path / "out").exists()
    for engine in ({}, {"deepspeed": "zero2"}):
        others = {key: value for key, value in keys.items() if key not in FSDP}
        assert config_from_dict({**others, **engine}).optimizer == optimizer


@pytest.mark.parametrize("optimizer", BITSANDBYTES_OPTIMIZERS)
@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
def test_bitsandbytes_optimizers_cannot_step_fsdp2_shards(optimizer):
    """Why the rule above is there: FSDP2 hands the optimizer DTensor shards, which bitsandbytes' kernels refuse
    (on this CPU as on a GPU). The day they step them, this fails, and the refusal can go."""
    from torch.distributed.fsdp import fully_shard

    from tuneloop.engines.base import join_process_group, leave_the_group
    from tuneloop.engines.fsdp2 import read_fsdp_keys
    from tuneloop.optim import OPTIMIZERS

    join_process_group(read_fsdp_keys(None, 2, {}))
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)))
        # (a weight of 128 × 128 is above bitsandbytes' min_8bit_size: the 8-bit kernels, not a 32-bit fallback)
        step = OPTIMIZERS[optimizer].build(list(model.parameters()), SimpleNamespace(
            learning_rate=1e-3, adamw_betas=(0.9, 0.999), adam_epsilon=1e-8))
        model(torch.randn(4, 128)).sum().backward()
        with pytest.raises((RuntimeError, NotImplementedError), match="DTensor|sharding strategy"):
            step.step()
    finally:
        leave_the_group()


def test_a_deepspeed_file_that_disagrees_with_the_yaml_is_refused_by_the_plan(tmp_path, tiny_model_dir, data):
    from conftest import assert_user_error

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                  "gradient_accumulation_steps": 4}))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, deepspeed="ds.json",
                                                              gradient_accumulation_steps=2))
    result = run_in_process("plan", str(config))  # ds.json is found beside the config, whatever the cwd
    assert_user_error(result, "sets gradient_accumulation_steps to 4, but the plan has 2",
                      "from gradient_accumulation_steps", "\"auto\"")


def test_fsdp1_configs_and_speed_only_knobs_run_as_fsdp2_with_a_warning(tmp_path, tiny_model_dir, data):
    keys = {"fsdp": ["full_shard", "auto_wrap"],  # an FSDP1 config as axolotl's examples write them
            "fsdp_config": {"fsdp_limit_all_gathers": True, "fsdp_sync_module_states": True,
                            "fsdp_offload_params": False, "fsdp_use_orig_params": False,
                            "fsdp_cpu_ram_efficient_loading": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                            "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_sharding_strategy": "FULL_SHARD"}}
    result = check_config(tmp_path, tiny_model_dir, data, **keys)
    assert result.returncode == 0, result.stderr
    for said in ("tuneloop runs the same sharding with FSDP2", "`fsdp_config.limit_all_gathers` only changes speed",
                 "`fsdp_config.sync_module_states`", "`fsdp_config.use_orig_params`"):
        assert said in result.stdout + result.stderr, said
    assert "cpu_ram_efficient_loading" not in result.stderr  # implemented: rank 0 loads (the test below)


@pytest.mark.slow
def test_cpu_ram_efficient_loading_reads_the_weights_on_rank_0_alone_and_trains_the_same(launched):
    """`fsdp_cpu_ram_efficient_loading`: rank 1 builds the model on the meta device and gets its shards (and the
    buffers a state dict leaves out, such as the rotary inv_freq) from rank 0. A 26M-parameter LLaMA (105 MB in
    fp32, so that a whole copy shows in a process's resident memory): the weights after an AdamW step are the
    ones of the run where every rank loads, bit for bit; rank 1's peak host memory once the model is sharded is
    lower by more than half a whole copy, and below rank 0's. (Measured with 4 layers, 208 MB: 799 → 505 MB on
    rank 1; rank 0 827 MB.) Each run is the first of its launch: a peak is the process's."""
    root, results = launched
    whole_copy = sum(path.stat().st_size for path in (root / "llama-26m").glob("*.safetensors"))
    runs = {}
    for name in ("every_rank", "rank_0"):
        assert results[name].returncode == 0, results[name].stdout[-2000:] + results[name].stderr[-4000:]
        summary = json.loads((root / name / "out" / "summary.json").read_text())
        runs[name] = (load_file(root / name / "out" / "model.safetensors"),
                      [rank["peak_host_rss_at_start"] for rank in summary["held_bytes_per_rank"]])
    (expected, every_rank), (got, rank_0) = runs["every_rank"], runs["rank_0"]
    assert expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected)
    assert "rank 0 alone" in json.loads((root / "rank_0" / "out" / "plan.json").read_text())["engine"]
    assert rank_0[1] < every_rank[1] - whole_copy / 2 and rank_0[1] < rank_0[0]


def test_cpu_ram_efficient_loading_is_left_off_where_every_rank_needs_the_weights_before_sharding(tmp_path,
                                                                                                  tiny_model_dir):
    """4/8-bit weights (bitsandbytes' quantization state is not in a state dict) and a preference run (its reference
    is made from the policy before the engine starts): warned about, and the plan's engine loads on every rank."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"messages": [{"role": "user", "content": "hi"}],
                                                    "chosen": "hello", "rejected": "go away"}] * 8)
    efficient = {"fsdp": ["full_shard"], "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True}}
    rows = write_jsonl(tmp_path / "rows.jsonl", tiny_rows(8, seed=1))
    for keys, said in (({"adapter": "qlora", "lora_target_linear": True}, "with 4/8-bit weights"),
                       ({"rl": "dpo", "datasets": [{"path": str(pairs), "type": "chat_template"}]}, "with `rl: dpo`")):
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, rows, **efficient,
                                                                  **keys))
        planned = run_in_process("plan", str(config), "--json")
        assert planned.returncode == 0, planned.stderr[-2000:]
        assert f"`fsdp_config.cpu_ram_efficient_loading` {said}" in planned.stderr
        assert "left off" in planned.stderr and "rank 0 alone" not in json.loads(planned.stdout)["engine"]


def test_a_layer_class_the_model_does_not_have_stops_the_run_naming_the_classes_it_has(tmp_path, tiny_model_dir,
                                                                                        data):
    from conftest import assert_user_error

    keys = {"fsdp": ["full_shard"], "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": "GPT2Block"}}
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, max_steps=1, **keys))
    assert_user_error(run_in_process("train", str(config)),
                      "transformer_layer_cls_to_wrap: no module of class GPT2Block", "LlamaDecoderLayer")


def test_the_plan_shows_memory_per_rank_for_a_launch_it_has_not_made(tmp_path, tiny_model_dir, data):
    """`tuneloop plan --world-size 8 --device-memory 80` with each engine: the parts divided as the engine divides
    them, and a warning when a rank's share is above the device's memory."""
    def plan(world: int, device_gb: float, **keys) -> dict:
        config = write_config(tmp_path / "plan.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
        result = run_in_process("plan", str(config), "--json", "--world-size", str(world), "--device-memory",
                                str(device_gb))
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    one = plan(1, 80)["memory"]
    assert one["device_gb"] == 80
    for keys, divided, whole in [(FSDP, ("weights", "optimizer"), ()),
                                 (deepspeed_keys(1), ("optimizer",), ("weights",)),
                                 (deepspeed_keys(3), ("weights", "optimizer"), ())]:
        eight = plan(8, 80, **keys)["memory"]
        assert eight["world_size"] == 8
        for part in divided:
            assert eight["per_rank_bytes"][part] < plan(1, 80, **keys)["memory"]["per_rank_bytes"][part] / 7
        for part in whole:
            assert eight["per_rank_bytes"][part] == one["per_rank_bytes"][part]
    tight = plan(8, 0.01, **FSDP, micro_batch_size=8)  # (a tiny model: its micro-batch's activations fill 10 MB)
    assert any("per rank over 8 ranks" in warning and "fsdp" in warning for warning in tight["warnings"])
    text = run_in_process("plan", str(tmp_path / "plan.yml"), "--world-size", "8", "--device-memory", "80")
    assert "engine               FSDP2 over 8 rank(s)" in text.stdout and "GB per rank of 80 GB" in text.stdout


def test_deepspeed_bf16_weights_or_fp32_weights_with_autocast_as_the_file_says(tmp_path, tiny_model_dir, data):
    """`bf16: true` with a DeepSpeed file at bf16 "auto" gives DeepSpeed's own bf16 (16-bit weights, fp32 masters in
    the optimizer); `"bf16": {"enabled": false}` keeps fp32 weights, which tuneloop's autocast runs in bf16 (the
    numerics of DDP and FSDP2). The plan counts each as the engine holds it."""
    (tmp_path / "fp32_weights.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                            "bf16": {"enabled": False}}))

    def per_rank(deepspeed: str) -> dict:
        config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data, bf16=True,
                                                                  deepspeed=deepspeed, optimizer="adamw_torch"))
        result = run_in_process("plan", str(config), "--json", "--world-size", "2")
        assert result.returncode == 0, result.stderr[-2000:]
        plan = json.loads(result.stdout)
        return {**plan["memory"]["per_rank_bytes"], "parameters": plan["memory"]["parameters"]}

    sixteen, thirty_two = per_rank("zero2"), per_rank("fp32_weights.json")
    parameters = sixteen["parameters"]
    assert sixteen["weights"] == 2 * parameters and thirty_two["weights"] == 4 * parameters
    assert sixteen["optimizer"] == thirty_two["optimizer"] == 12 * parameters // 2  # fp32 masters + Adam, halved


@pytest.mark.slow
def test_dpo_with_its_reference_under_fsdp2_two_ranks_equal_one_process(tmp_path, launched, tiny_model_dir):
    """A preference objective sharded: the policy under FSDP2, its frozen reference a whole copy on each rank;
    the step's loss is a mean over the pairs of all ranks, as in one process."""
    root, results = launched
    pairs = root / "pairs.jsonl"
    config = config_of(tmp_path / "one", tiny_model_dir, pairs, ranks=1, **dpo_keys(pairs))
    one = run_in_process("train", str(config))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]
    assert results["dpo_fsdp"].returncode == 0, results["dpo_fsdp"].stdout[-3000:] + results["dpo_fsdp"].stderr[-5000:]
    runs = {"one": load_file(tmp_path / "one" / "out" / "model.safetensors"),
            "fsdp": load_file(root / "dpo_fsdp" / "out" / "model.safetensors")}
    before = load_file(tiny_model_dir / "model.safetensors")
    delta = {name: {k: weights[k] - before[k] for k in before} for name, weights in runs.items()}
    assert relative_difference(delta["fsdp"], delta["one"]) < 1e-5


@pytest.mark.slow
def test_a_checkpoint_resumed_by_another_engine_is_refused_naming_both(tmp_path, tiny_model_dir, data, monkeypatch):
    """The DeepSpeed file's path is the same but its stage changed (2 → 3): the shards are laid out for ZeRO-2,
    so the resume is refused with one line, not a traceback from inside DeepSpeed."""
    from conftest import assert_user_error

    from tuneloop.train.guards import SIGNAL_AT_STEP_ENV

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    config = write_config(tmp_path / "run.yml", **base_config(
        tmp_path, tiny_model_dir, data, deepspeed="ds.json", micro_batch_size=2, max_steps=6, save_strategy=None,
        save_steps=2, auto_resume_from_checkpoints=True, optimizer="adamw_torch"))
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, "0:2")  # one process, a group of one: stopped after checkpoint-2
    stopped = run_in_process("train", str(config))
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    assert stopped.returncode == 75 and (tmp_path / "out" / "checkpoint-2" / "shards").is_dir(), stopped.stderr[-2000:]
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert_user_error(run_in_process("train", str(config)), "was written by DeepSpeed ZeRO-2 and this run uses "
                      "DeepSpeed ZeRO-3")


AXOLOTL_DEEPSPEED_FILES = {  # every JSON in axolotl's deepspeed_configs/ (commit 067b021): stage, offloads
    "zero1.json": (1, False, False), "zero1_torch_compile.json": (1, False, False), "zero2.json": (2, False, False),
    "zero2_torch_compile.json": (2, False, False), "zero3.json": (3, False, False),
    "zero3_bf16.json": (3, False, False), "zero3_bf16_cpuoffload_all.json": (3, True, True),
    "zero3_bf16_cpuoffload_params.json": (3, True, False)}


@pytest.mark.parametrize("name", sorted(AXOLOTL_DEEPSPEED_FILES))
def test_every_deepspeed_file_axolotl_ships_is_read_by_its_axolotl_path(name):
    from tuneloop.engines.deepspeed import filled_config, read_deepspeed_keys

    spec = read_deepspeed_keys(f"deepspeed_configs/{name}")  # as axolotl's configs write it, no such file here
    assert (spec.stage, spec.offload_weights, spec.offload_optimizer) == AXOLOTL_DEEPSPEED_FILES[name]
    if "torch_compile" in name:  # compiling under DeepSpeed changes only speed: said, and not passed on
        with pytest.warns(UserWarning, match="asks DeepSpeed to torch.compile the model.*runs uncompiled"):
            config = filled_config(spec, 2, 1, 2, 1.0, "bf16", 64)
        assert "compile" not in config


def test_a_deepspeed_file_that_turns_on_deepcompile_is_refused_naming_the_feature():
    from tuneloop.engines.deepspeed import read_deepspeed_keys

    with pytest.raises(ValueError, match="asks for DeepSpeed's deepcompile, which tuneloop does not do yet"):
        read_deepspeed_keys({"zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}})
