"""axolotl's N-D parallel keys (`dp_replicate_size`, `dp_shard_size`, `tensor_parallel_size`,
`context_parallel_size`) resolved into one device mesh as axolotl resolves them, refused with the numbers where
they cannot make the world size, and HSDP (FSDP2 replicated across groups, sharded within) over 4 real gloo ranks
ending with one process's weights (fp32)."""

from __future__ import annotations

import json

import pytest
from conftest import (assert_user_error, base_config, run_in_process, tiny_rows, write_config,
                      write_jsonl)

from test_tensor_parallel import FSDP as TP_FSDP
from test_tensor_parallel import STEPS as TP_STEPS

from tuneloop.engines.keys import read_engine, read_mesh_keys
from tuneloop.engines.mesh import Mesh, MeshKeys, resolve_mesh
from tuneloop.errors import UserError

FSDP = {"fsdp_version": 2, "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                           "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}}
HSDP = {**FSDP, "dp_replicate_size": 2, "dp_shard_size": 2}


def mesh_of(world: int, engine: str = "fsdp2", **sizes) -> Mesh:
    fsdp = (None, 2, {}, None) if engine == "fsdp2" else (None, None, None, "zero2" if engine == "zero2" else None)
    return read_engine(*fsdp, mesh=read_mesh_keys(**sizes)).mesh(world)


# ---- resolution, as axolotl's _get_parallel_config_kwargs: no processes ------------------------------------------
@pytest.mark.parametrize("world, engine, sizes, expected", [
    (4, "fsdp2", {"tensor_parallel_size": 2}, (1, 2)),  # tensor parallel takes its ranks first
    (8, "fsdp2", {"tensor_parallel_size": 2, "dp_replicate_size": 2}, (2, 2)),
    (4, "fsdp2", {"dp_replicate_size": 2, "dp_shard_size": 2}, (2, 2)),
    (8, "fsdp2", {"dp_shard_size": 2}, (4, 2)),  # the rest are replicas (axolotl fills dp_replicate)
    (8, "fsdp2", {"dp_replicate_size": 2}, (2, 4)),  # the rest are shards
    (8, "fsdp2", {}, (1, 8)),  # FSDP2 alone shards over every rank, as before the keys existed
    (4, "ddp", {}, (4, 1)),  # DDP replicates over every rank
    (4, "ddp", {"dp_replicate_size": 4}, (4, 1)),
    # sizes of 1 are axolotl's defaults and mean "no such axis": the engine's own axis takes the ranks
    (8, "fsdp2", {"dp_shard_size": 1, "dp_replicate_size": 1, "tensor_parallel_size": 1,
                  "context_parallel_size": 1}, (1, 8)),
    (4, "fsdp2", {"dp_replicate_size": 2, "dp_shard_size": 1}, (2, 2)),
    (4, "ddp", {"dp_shard_size": 1, "sequence_parallel_degree": 1}, (4, 1)),
    (2, "zero2", {"dp_shard_size": 1, "tensor_parallel_size": 1}, (1, 2)),  # ZeRO partitions over every rank
    (1, "fsdp2", {"dp_shard_size": 1}, (1, 1)),
    (8, "fsdp2", {"context_parallel_size": 2}, (1, 4)),  # context parallel takes its ranks first too
    (8, "fsdp2", {"sequence_parallel_degree": 2, "dp_shard_size": 2}, (2, 2)),
    (4, "ddp", {"context_parallel_size": 2}, (2, 1)),
])
def test_sizes_resolve_against_the_world_size_as_axolotl_does(world, engine, sizes, expected):
    mesh = mesh_of(world, engine, **sizes)
    tp = sizes.get("tensor_parallel_size", 1)
    cp = max(sizes.get("context_parallel_size", 1), sizes.get("sequence_parallel_degree", 1))
    assert (mesh.dp_replicate, mesh.dp_shard) == expected and (mesh.tp, mesh.cp) == (tp, cp)
    assert mesh.dp_replicate * mesh.dp_shard * tp * cp == world and mesh.data_ranks == world // (tp * cp)


def test_the_mesh_is_shown_in_the_plans_words():
    assert str(Mesh(dp_replicate=2, dp_shard=2)) == "mesh dp_replicate 2 × dp_shard 2 × tp 1 × cp 1"
    assert Mesh(dp_replicate=2, dp_shard=2).hybrid and not Mesh(dp_replicate=1, dp_shard=4).hybrid


@pytest.mark.parametrize("world, sizes, fragments", [
    (4, {"dp_replicate_size": 2, "dp_shard_size": 3}, ["dp_replicate_size 2 × dp_shard_size 3 = 6",
                                                       "world size 4"]),
    (8, {"dp_replicate_size": 2, "dp_shard_size": 2}, ["= 4 does not make the world size 8"]),
    (6, {"dp_shard_size": 4}, ["dp_shard_size 4 does not divide the world size 6"]),
    (4, {"dp_replicate_size": 3}, ["dp_replicate_size 3 does not divide the world size 4"]),
    (1, {"dp_replicate_size": 2, "dp_shard_size": 2}, ["= 4 does not make the world size 1", "--world-size"]),
])
def test_sizes_that_cannot_make_the_world_size_are_one_line_naming_the_numbers(world, sizes, fragments):
    with pytest.raises(UserError) as refused:
        mesh_of(world, **sizes)
    message = str(refused.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_ddp_replicas_must_be_every_rank():
    with pytest.raises(UserError, match="dp_replicate_size 2 = 2 does not make the world size 4"):
        mesh_of(4, "ddp", dp_replicate_size=2)


@pytest.mark.parametrize("engine, sizes, fragments", [
    ("ddp", {"tensor_parallel_size": 2}, ["`tensor_parallel_size: 2` splits the layers over ranks on FSDP2",
                                          "fsdp_version: 2"]),
    ("zero2", {"tensor_parallel_size": 2}, ["`tensor_parallel_size: 2` splits", "asks for deepspeed"]),
    ("zero2", {"context_parallel_size": 2}, ["`context_parallel_size: 2` with `deepspeed`", "DDP ranks or FSDP2"]),
    ("fsdp2", {"context_parallel_size": 1, "sequence_parallel_degree": 2}, ["disagree"]),
    ("fsdp2", {"dp_shard_size": 0}, ["`dp_shard_size: 0`", "1 or more"]),
    ("ddp", {"dp_shard_size": 2}, ["`dp_shard_size: 2` shards the model", "fsdp_version: 2"]),
    ("zero2", {"dp_replicate_size": 2}, ["`dp_replicate_size: 2` with `deepspeed`", "FSDP2"]),
])
def test_what_the_engine_cannot_run_is_refused_naming_the_key(engine, sizes, fragments):
    with pytest.raises(ValueError) as refused:
        mesh_of(2, engine, **sizes)
    assert all(fragment in str(refused.value) for fragment in fragments), str(refused.value)


def test_unset_sizes_leave_no_mesh_to_show():
    assert not read_mesh_keys().written and read_mesh_keys(tensor_parallel_size=1).written
    assert resolve_mesh(MeshKeys(), 4, fills_shard=True) == Mesh(dp_replicate=1, dp_shard=4)


# ---- the plan: the mesh, per-rank memory over dp_shard, bad products at `plan --world-size` ------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", tiny_rows(64, seed=3))


def planned(tmp_path, tiny_model_dir, data, world: int, name: str = "plan", **keys):
    config = write_config(tmp_path / f"{name}.yml", **base_config(tmp_path, tiny_model_dir, data, **keys))
    return run_in_process("plan", str(config), "--json", "--world-size", str(world))


def test_the_plan_shows_the_mesh_and_divides_over_dp_shard_only(tmp_path, tiny_model_dir, data):
    hsdp = planned(tmp_path, tiny_model_dir, data, 4, "hsdp", **HSDP)
    fsdp_two, fsdp_four = (planned(tmp_path, tiny_model_dir, data, world, **FSDP) for world in (2, 4))
    for result in (hsdp, fsdp_two, fsdp_four):
        assert result.returncode == 0, result.stderr[-2000:]
    hsdp, fsdp_two, fsdp_four = (json.loads(result.stdout) for result in (hsdp, fsdp_two, fsdp_four))
    assert hsdp["mesh"] == "mesh dp_replicate 2 × dp_shard 2 × tp 1 × cp 1" and fsdp_two["mesh"] is None
    assert "HSDP" in hsdp["engine"] and hsdp["global_batch_size"] == fsdp_four["global_batch_size"]
    # each of the 2 replicas holds the whole model over its 2 ranks: what 2 FSDP2 ranks hold, not what 4 do
    assert hsdp["memory"]["per_rank_bytes"] == fsdp_two["memory"]["per_rank_bytes"]
    assert hsdp["memory"]["per_rank_bytes"]["weights"] > 1.5 * fsdp_four["memory"]["per_rank_bytes"]["weights"]
    text = run_in_process("plan", str(tmp_path / "hsdp.yml"), "--world-size", "4").stdout
    assert "device mesh          mesh dp_replicate 2 × dp_shard 2 × tp 1 × cp 1" in text
    assert "device mesh" not in run_in_process("plan", str(tmp_path / "plan.yml"), "--world-size", "4").stdout


def test_a_product_that_is_not_the_world_size_stops_the_plan(tmp_path, tiny_model_dir, data):
    assert_user_error(planned(tmp_path, tiny_model_dir, data, 8, **HSDP),
                      "dp_replicate_size 2 × dp_shard_size 2 = 4 does not make the world size 8")
    assert_user_error(planned(tmp_path, tiny_model_dir, data, 6, context_parallel_size=4, **FSDP),
                      "tensor_parallel_size 1 × context_parallel_size 4 = 4 does not divide the world size 6")


def test_sizes_of_one_are_accepted_and_shown(tmp_path, tiny_model_dir, data):
    ones = dict(dp_shard_size=1, dp_replicate_size=1, tensor_parallel_size=1, context_parallel_size=1)
    result = run_in_process("check", str(write_config(tmp_path / "ones.yml",
                                                      **base_config(tmp_path, tiny_model_dir, data, **ones, **FSDP))))
    assert result.returncode == 0, result.stderr[-2000:]
    text = run_in_process("plan", str(tmp_path / "ones.yml"), "--world-size", "2")
    assert "device mesh          mesh dp_replicate 1 × dp_shard 2 × tp 1 × cp 1" in text.stdout, text.stderr[-2000:]


# ---- HSDP over 4 gloo ranks against one process -----------------------------------------------------------------
STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-2, "max_grad_norm": 1.0, "max_steps": 4,
         "lr_scheduler": "cosine", "warmup_steps": 1, "num_epochs": 1, "micro_batch_size": 2}


def relative_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


@pytest.fixture(scope="module")
def eight_head_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """8 heads of 8 and 4 key/value heads: tp 2 × cp 2 leaves each rank 2 heads and 1 key/value head."""
    from conftest import save_llama

    return save_llama(tmp_path_factory.mktemp("eight_heads"), tiny_tokenizer_dir, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)


# tp 2 × cp 2: the tensor-parallel test's steps (accumulation 2, one data rank) and rows, packed, FSDP2 over dp × cp
TP_CP = {**TP_STEPS, "sample_packing": True, **TP_FSDP, "context_parallel_size": 2}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, tiny_model_dir, eight_head_model_dir, data) -> tuple:
    """This module's four-rank runs (HSDP 2 × 2, tp 2 × cp 2) in one torchrun launch (conftest's run_in_one_launch)."""
    from conftest import run_in_one_launch

    root = tmp_path_factory.mktemp("four_ranks")
    (root / "hsdp").mkdir()
    (root / "tp_cp").mkdir()
    hsdp = write_config(root / "hsdp" / "run.yml", **base_config(
        root / "hsdp", tiny_model_dir, data, **STEPS, gradient_accumulation_steps=1, **HSDP, save_strategy="steps",
        save_steps=2))
    tp_rows = write_jsonl(root / "tp_rows.jsonl", tiny_rows(64, seed=5))  # (test_tensor_parallel.py's)
    tp_cp = write_config(root / "tp_cp" / "run.yml", **base_config(root / "tp_cp", eight_head_model_dir, tp_rows,
                                                                   **TP_CP, tensor_parallel_size=2))
    results = run_in_one_launch(["train", hsdp], ["train", tp_cp], ranks=4)
    return root, {"hsdp": results[0], "tp_cp": results[1], "tp_rows": tp_rows}


@pytest.mark.slow
def test_hsdp_two_by_two_over_four_ranks_equals_one_process(tmp_path, tiny_model_dir, data, four_ranks):
    """Global batch 8 both ways: one process 2 × 4 accumulated, 4 ranks 2 × 1 each. The plan's mesh is the one
    the run built, and the plan's bytes per rank are what each rank held: half the model (dp_shard 2), not a
    quarter (which sharding over all 4 would hold). Its checkpoint at step 2 (DCP shards of the 2-D mesh) resumes
    on one FSDP2 process (--force-resume: resharded) and ends with one process's weights too."""
    import shutil

    from safetensors.torch import load_file

    root, results = four_ranks
    (tmp_path / "one").mkdir()
    config = write_config(tmp_path / "one" / "run.yml", **base_config(
        tmp_path / "one", tiny_model_dir, data, **STEPS, gradient_accumulation_steps=4))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert results["hsdp"].returncode == 0, results["hsdp"].stdout[-3000:] + results["hsdp"].stderr[-5000:]
    runs = {}
    for name, out in (("one", tmp_path / "one" / "out"), ("hsdp", root / "hsdp" / "out")):
        runs[name] = (json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text()),
                      load_file(out / "model.safetensors"))
    (one_plan, one_summary, one), (plan, summary, hsdp) = runs["one"], runs["hsdp"]
    assert plan["world_size"] == 4 and plan["global_batch_size"] == one_plan["global_batch_size"] == 8
    assert summary["steps"] == plan["total_steps"] == STEPS["max_steps"]
    assert summary["mesh"] == plan["mesh"] == "mesh dp_replicate 2 × dp_shard 2 × tp 1 × cp 1"
    held, per_rank = summary["held_bytes_per_rank"], plan["memory"]["per_rank_bytes"]
    assert len(held) == 4
    for rank in held:
        for part in ("weights", "optimizer"):
            assert rank[part] == pytest.approx(per_rank[part], rel=0.03), (part, held, per_rank)
        whole = one_summary["held_bytes_per_rank"][0]["weights"]
        assert rank["weights"] == pytest.approx(whole / 2, rel=0.03)
    difference = relative_difference(hsdp, one)
    start = load_file(tiny_model_dir / "model.safetensors")
    change = relative_difference({k: hsdp[k] - start[k] for k in start}, {k: one[k] - start[k] for k in start})
    print(f"\nHSDP 2 x 2 over 4 gloo ranks vs one process: weights {difference:.3g}, weight change {change:.3g}")
    assert difference < 1e-5 and change < 1e-4

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(root / "hsdp" / "out" / "checkpoint-2", resumed_dir / "out" / "checkpoint-2")
    config = write_config(resumed_dir / "run.yml", **base_config(
        resumed_dir, tiny_model_dir, data, **STEPS, gradient_accumulation_steps=4, auto_resume_from_checkpoints=True,
        **FSDP))
    resumed = run_in_process("train", str(config), "--force-resume")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    resumed_difference = relative_difference(load_file(resumed_dir / "out" / "model.safetensors"), one)
    print(f"HSDP checkpoint-2 resumed on one FSDP2 process vs one process: {resumed_difference:.3g}")
    assert resumed_difference < 1e-5


@pytest.mark.slow
def test_tensor_and_context_parallel_together_over_four_ranks_end_with_one_process_weights(
        tmp_path, eight_head_model_dir, four_ranks):
    """axolotl's qwen3-8b-fsdp-tp-cp.yaml layout: tp 2 × cp 2 on 4 ranks, one data rank. Each layer's heads are
    split over the tp ranks, each row's positions over the cp ranks; FSDP2 shards over dp_shard × cp. Packed rows."""
    from safetensors.torch import load_file

    from conftest import read_metrics

    root, results = four_ranks
    (tmp_path / "one").mkdir()
    keys = {key: value for key, value in TP_CP.items() if key != "context_parallel_size"}
    config = write_config(tmp_path / "one" / "run.yml", **base_config(tmp_path / "one", eight_head_model_dir,
                                                                      results["tp_rows"], **keys))
    result = run_in_process("train", str(config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert results["tp_cp"].returncode == 0, results["tp_cp"].stdout[-3000:] + results["tp_cp"].stderr[-5000:]
    runs = {}
    for name, out in (("one", tmp_path / "one" / "out"), ("tp_cp", root / "tp_cp" / "out")):
        runs[name] = (json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text()),
                      load_file(out / "model.safetensors"), read_metrics(out))
    (_, one_summary, one, one_lines), (plan, summary, both, lines) = runs["one"], runs["tp_cp"]
    assert summary["mesh"] == plan["mesh"] == "mesh dp_replicate 1 × dp_shard 1 × tp 2 × cp 2"
    assert summary["steps"] == plan["total_steps"] == TP_STEPS["max_steps"] and plan["data_ranks"] == 1
    assert [line["loss"] for line in lines if "loss" in line] == pytest.approx(
        [line["loss"] for line in one_lines if "loss" in line], rel=1e-5)
    for key in ("real_tokens", "targets_collated"):
        assert summary[key] == one_summary[key], key
    start = load_file(eight_head_model_dir / "model.safetensors")
    difference = relative_difference(both, one)
    change = relative_difference({k: both[k] - start[k] for k in start}, {k: one[k] - start[k] for k in start})
    print(f"\ntp 2 × cp 2 vs one process: weights {difference:.3g}, weight change {change:.3g}")
    assert difference < 1e-4 and change < 1e-4
