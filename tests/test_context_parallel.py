"""Context parallel (`context_parallel_size`, engines/context_parallel.py): each row's positions split over the cp
ranks, DeepSpeed's Ulysses all-to-alls around attention on whole rows. Refusals name the key at `plan --world-size`;
the plan counts one data rank, halves the activations and adds the all-to-alls; 2 real gloo ranks (cp 2), packed
rows on DDP and padded rows on FSDP2, end with one process's weights (fp32); tp 2 × cp 2 on 4 ranks is in
test_device_mesh.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_user_error, base_config, read_metrics, run_in_process, write_config
# (the tensor-parallel test's FSDP2 keys, rows (the `data` fixture), plan call, steps and measure)
from test_tensor_parallel import FSDP, STEPS, data, planned, relative_difference  # noqa: F401  (data: a fixture)

from tuneloop.data.collate import MicroBatch
from tuneloop.engines.context_parallel import WHOLE_POSITIONS, ContextShare, check_context_parallel
from tuneloop.errors import UserError
from tuneloop.run_files import complete_checkpoints
from tuneloop.train.checkpoint import CRASH_DURING_SAVE_ENV

CP = {"context_parallel_size": 2}


# ---- what it cannot run -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world, keys, fragment", [
    (4, {"context_parallel_size": 4}, "`context_parallel_size: 4` does not divide the model's num_key_value_heads (2)"),
    (4, {**FSDP, **CP, "tensor_parallel_size": 2}, "`context_parallel_size: 2` × tensor_parallel_size 2 does not divide"),
    (2, {**CP, "rl": "dpo"}, "with `rl: dpo`: context parallel splits each row over ranks"),
    (2, {**CP, "pad_to_sequence_len": True, "sequence_len": 255}, "does not divide `sequence_len: 255`"),
    (2, {"sequence_parallel_degree": 2, "eager_attention": True}, "context parallel runs attention kernels that take"),
])
def test_what_context_parallel_cannot_run_stops_the_plan(tmp_path, tiny_model_dir, data, world, keys, fragment):
    assert_user_error(planned(tmp_path, tiny_model_dir, data, world, "refused", **keys), fragment)


def test_check_says_context_parallel_needs_deepspeed(tmp_path, tiny_model_dir, data):
    config = write_config(tmp_path / "c.yml", **base_config(tmp_path, tiny_model_dir, data, **CP))
    checked = run_in_process("check", str(config))
    assert checked.returncode == 0 and "the deepspeed package, whose Ulysses attention it runs" in checked.stdout


def test_models_whose_attention_the_exchange_cannot_wrap_are_refused():
    from transformers import Qwen2Config, T5Config

    with pytest.raises(UserError, match="sliding_attention layers"):
        check_context_parallel(Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                           max_window_layers=0, layer_types=["sliding_attention"] * 2,
                                           num_hidden_layers=2), 2, 256)
    with pytest.raises(UserError, match="encoder-decoder"):
        check_context_parallel(T5Config(), 2, 256)


def test_each_rank_takes_its_slice_and_the_kernel_gets_the_whole_positions():
    ids = torch.arange(16).reshape(2, 8)
    packed = MicroBatch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)},
                        ids + 100, n_targets=16, n_real_tokens=16)
    second = ContextShare(2, 1)(packed)
    assert second.inputs["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert second.inputs["position_ids"].tolist() == [[1, 2, 3, 4]] * 2  # the sequence that crosses the split
    assert second.inputs[WHOLE_POSITIONS].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]] * 2
    assert second.targets.tolist() == [[104, 105, 106, 107], [112, 113, 114, 115]]
    assert second.n_targets == 16 and "attention_mask" not in second.inputs  # counts: the whole micro-batch's
    padded = MicroBatch({"input_ids": ids, "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3])}, ids,
                        n_targets=13, n_real_tokens=13)
    assert ContextShare(2, 0)(padded).inputs["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    left_padded = MicroBatch({"input_ids": ids, "attention_mask": torch.tensor([[0] * 3 + [1] * 5] * 2)}, ids, 10, 10)
    with pytest.raises(RuntimeError, match="right-padded"):
        ContextShare(2, 0)(left_padded)


def test_packed_rows_get_their_block_diagonal_mask_and_single_sequences_none():
    from tuneloop.engines.context_parallel import packed_mask

    mask = packed_mask(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]))
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                         [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    assert packed_mask(torch.arange(6).expand(2, 6)) is None  # one sequence a row: causal alone is exact


def test_the_plan_counts_one_data_rank_halves_activations_and_adds_the_all_to_alls(tmp_path, tiny_model_dir, data):
    cp, one = (planned(tmp_path, tiny_model_dir, data, world, name, **keys)
               for world, name, keys in ((2, "cp", {**FSDP, **CP}), (1, "one", FSDP)))
    for result in (cp, one):
        assert result.returncode == 0, result.stderr[-2000:]
    cp, one = json.loads(cp.stdout), json.loads(one.stdout)
    assert cp["mesh"] == "mesh dp_replicate 1 × dp_shard 1 × tp 1 × cp 2"
    assert cp["data_ranks"] == 1 and cp["context_ranks"] == 2 and cp["total_steps"] == one["total_steps"]
    # (each rank holds its slice of every row; the loss chunk and head gradient it keeps are whole: not quite half)
    assert 0.4 < cp["memory"]["activations_gb"] / one["memory"]["activations_gb"] < 0.6
    # FSDP2 shards over dp_shard × cp: each rank holds half the weights
    assert cp["memory"]["per_rank_bytes"]["weights"] == pytest.approx(one["memory"]["per_rank_bytes"]["weights"] / 2,
                                                                      rel=0.01)
    exchanged = [t for t in cp["communication"]["transfers"] if t["what"].startswith("context-parallel all-to-alls")]
    assert len(exchanged) == 1 and exchanged[0]["bytes"] > 0
    assert "split over 2 context-parallel ranks" in cp["engine"] and "Ulysses all-to-alls" in cp["attention"]


# ---- 2 gloo ranks, cp 2, against one process (the tensor-parallel test's steps and measure) ------------------------
LAYOUTS = {"packed rows on DDP": {"sample_packing": True, "attn_implementation": "sdpa"},
           "padded rows on FSDP2": {**FSDP, "val_set_size": 0.1, "eval_steps": 2}}
# packed rows under `attn_implementation: sdpa`: the kernel behind the exchange needs the rows' block-diagonal mask
# (SDPA per sequence, the CPU's default, splits them itself: test_device_mesh.py's tp × cp test runs it)
SAVES = {"packed rows on DDP": {}, "padded rows on FSDP2": {"save_strategy": "steps", "save_steps": 2}}


def layout_config(folder, model_dir, data, layout: str, **extra):
    folder.mkdir(exist_ok=True)
    return write_config(folder / "run.yml", **base_config(folder, model_dir, data, **STEPS, **LAYOUTS[layout], **extra))


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, tiny_model_dir, data) -> tuple:
    """Every cp-2 run of this module in two launches (conftest's run_in_one_launch): both layouts, then the FSDP2
    layout killed (-9) half-way through step 3's save (a checkpoint a step), which ends the launch; the second
    resumes it. The killed folder is copied as the kill left it."""
    import shutil

    from conftest import run_in_one_launch

    root = tmp_path_factory.mktemp("cp_runs")
    configs = {layout: layout_config(root / f"cp_{index}", tiny_model_dir, data, layout, **CP, **SAVES[layout])
               for index, layout in enumerate(LAYOUTS)}
    crashed = layout_config(root / "crashed", tiny_model_dir, data, "padded rows on FSDP2", **CP,
                            save_strategy="steps", save_steps=1, auto_resume_from_checkpoints=True)
    results = dict(zip([*LAYOUTS, "crash"], run_in_one_launch(
        *(["train", config] for config in configs.values()), (["train", crashed], {CRASH_DURING_SAVE_ENV: "3"}))))
    shutil.copytree(root / "crashed" / "out", root / "as_killed" / "out")
    results["resumed"], = run_in_one_launch(["train", crashed])
    return root, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_context_parallel_ranks_end_with_one_process_weights(tmp_path, cp_runs, tiny_model_dir, data, layout):
    """Both cp ranks read the same rows (one data rank) and each runs half of every row's positions; packed
    sequences cross the split. The weights, the weight change after 4 clipped AdamW steps, the logged losses (and
    eval losses) and the counts are one process's; the plan's steps are the run's. On FSDP2 a run killed (-9) half-way
    through step 3's save resumes from its step-2 checkpoint (DCP shards over dp_shard × cp) on 2 cp ranks and ends
    with the uninterrupted run's weights bit for bit; one process is refused that checkpoint, naming both layouts.
    The saved folder is a plain model (no trace of the exchange in its config)."""
    from safetensors.torch import load_file

    root, results = cp_runs
    packed = layout.startswith("packed")
    one_config = layout_config(tmp_path / "one", tiny_model_dir, data, layout)
    one_result = run_in_process("train", str(one_config))
    assert one_result.returncode == 0, one_result.stdout[-3000:] + one_result.stderr[-5000:]
    runs, losses = {}, {}
    for name, out in (("one", tmp_path / "one" / "out"), ("cp", root / f"cp_{list(LAYOUTS).index(layout)}" / "out")):
        if name == "cp":
            assert results[layout].returncode == 0, results[layout].stdout[-3000:] + results[layout].stderr[-5000:]
        runs[name] = (json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text()),
                      load_file(out / "model.safetensors"))
        losses[name] = [line.get("loss", line.get("eval_loss")) for line in read_metrics(out)]
    (_, one_summary, one), (plan, summary, cp) = runs["one"], runs["cp"]
    assert losses["cp"] == pytest.approx(losses["one"], rel=1e-5)
    assert len(losses["cp"]) == STEPS["max_steps"] + (0 if packed else 2)  # (evals at steps 2 and 4)
    for key in ("real_tokens", "targets_collated"):
        assert summary[key] == one_summary[key], key
    assert summary["steps"] == plan["total_steps"] == STEPS["max_steps"]
    assert summary["mesh"] == plan["mesh"] == "mesh dp_replicate 1 × dp_shard 1 × tp 1 × cp 2"
    start = load_file(tiny_model_dir / "model.safetensors")
    difference = relative_difference(cp, one)
    change = relative_difference({k: cp[k] - start[k] for k in start if k in cp},
                                 {k: one[k] - start[k] for k in start if k in one})
    print(f"\ncp 2 ({layout}) vs one process: weights {difference:.3g}, weight change {change:.3g}")
    assert difference < 1e-5 and change < 1e-4
    if packed:
        return
    assert "tuneloop_ulysses" not in (root / "cp_1" / "out" / "config.json").read_text()
    # kill -9 in the middle of step 3's save (a checkpoint a step: 1 and 2 are whole), then auto-resume
    assert results["crash"].returncode != 0
    as_killed = root / "as_killed"
    assert [p.name for p in complete_checkpoints(as_killed / "out")] == ["checkpoint-1", "checkpoint-2"]
    one_rank = write_config(as_killed / "one.yml", **base_config(as_killed, tiny_model_dir, data, **STEPS,
                                                                 **LAYOUTS[layout], auto_resume_from_checkpoints=True))
    assert_user_error(run_in_process("train", str(one_rank)),  # another layout: both named (--force-resume reshards)
                      "mesh (mesh dp_replicate 1 × dp_shard 1 × tp 1 × cp 2 → None)", "context_parallel_size (2 → None)")
    resumed = results["resumed"]
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    again = load_file(root / "crashed" / "out" / "model.safetensors")
    assert again.keys() == cp.keys() and all(torch.equal(again[k], cp[k]) for k in cp)
