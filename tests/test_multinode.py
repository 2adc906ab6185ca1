"""Two "nodes" on this machine: two separate `torchrun --nnodes 2 --nproc-per-node 1` process trees (two elastic
agents, as two hosts of a Slurm job start them), meeting at a c10d rendezvous. Each node is one replica of FSDP2
under `dp_replicate_size: 2` (HSDP 2 × 1: dp_shard 1 within a node, replicated across the nodes). LOCAL_RANK is 0
on both: only the global rank 0 writes the run's files.

The second node reads its prepared data from a folder of its own (`dataset_prepared_path` on a node-local disk,
as /tmp on a cluster's nodes): it builds its own copy of the cache, the first node's is never seen by it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import base_config, free_port, run_in_process, tiny_rows, write_config, write_jsonl

STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-2, "max_grad_norm": 1.0, "max_steps": 4,
         "lr_scheduler": "cosine", "warmup_steps": 1, "num_epochs": 1, "micro_batch_size": 2}
HSDP_ACROSS_NODES = {"fsdp_version": 2, "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                                        "reshard_after_forward": True},
                     "dp_replicate_size": 2}


def relative_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


def node_command(node_rank: int, port: int, run_id: str, *args: str) -> list[str]:
    """One node's launcher: torchrun with an elastic c10d rendezvous at the first node's address (here
    localhost), the same line examples/slurm/train.sbatch runs on each host."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", run_id, "-m", "tuneloop", *args]


def run_two_nodes(configs: list, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """`tuneloop train` on 2 nodes of 1 rank, each node its own torchrun (and its own config file: node-local
    paths may differ); both waited for."""
    port, env = free_port(), dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(node_command(rank, port, "tuneloop-test", "train", str(config)), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, config in enumerate(configs)]
    results = []
    for node in nodes:
        try:
            out, err = node.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return results


@pytest.mark.slow
def test_hsdp_across_two_nodes_equals_one_process(tmp_path, tiny_model_dir):
    """Global batch 4 both ways: one process 2 × 2 accumulated, 2 nodes 2 × 1 each, 4 AdamW steps (fp32)."""
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(64, seed=3))

    one_dir = tmp_path / "one"
    one_config = write_config(tmp_path / "one.yml", **base_config(one_dir, tiny_model_dir, data, **STEPS,
                                                                  gradient_accumulation_steps=2))
    one = run_in_process("train", str(one_config))
    assert one.returncode == 0, one.stderr[-3000:]

    nodes_dir = tmp_path / "nodes"
    keys = base_config(nodes_dir, tiny_model_dir, data, **STEPS, gradient_accumulation_steps=1, **HSDP_ACROSS_NODES)
    configs = [write_config(tmp_path / "node0.yml", **keys),
               write_config(tmp_path / "node1.yml", **{**keys, "dataset_prepared_path": str(tmp_path / "node1-local")})]
    results = run_two_nodes(configs)
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    out = nodes_dir / "out"
    plan, summary = json.loads((out / "plan.json").read_text()), json.loads((out / "summary.json").read_text())
    one_plan = json.loads((one_dir / "out" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["global_batch_size"] == one_plan["global_batch_size"] == 4
    assert summary["steps"] == plan["total_steps"] == one_plan["total_steps"] == STEPS["max_steps"]
    assert summary["mesh"] == plan["mesh"] == "mesh dp_replicate 2 × dp_shard 1 × tp 1 × cp 1"
    assert "HSDP" not in plan["engine"] or "1 within each of 2 replicas" in plan["engine"]
    assert len(summary["held_bytes_per_rank"]) == 2
    # each node prepared the data in its own folder (whichever became rank 0, the other read none of its files)
    assert any((nodes_dir / "prepared").iterdir()) and any((tmp_path / "node1-local").iterdir())

    trained, reference = load_file(out / "model.safetensors"), load_file(one_dir / "out" / "model.safetensors")
    assert relative_difference(trained, load_file(tiny_model_dir / "model.safetensors")) > 1e-3  # it trained
    # (2 ranks' all-reduced sum a + b is the one process's accumulated a + b, bit for bit: expect 0 here)
    difference = relative_difference(trained, reference)
    start = load_file(tiny_model_dir / "model.safetensors")
    change = relative_difference({k: trained[k] - start[k] for k in start},
                                 {k: reference[k] - start[k] for k in start})
    print(f"\nHSDP 2 x 1 across 2 torchrun nodes vs one process: weights {difference:.3g}, weight change {change:.3g}")
    assert difference < 1e-5 and change < 1e-4



# ---- examples/slurm/train.sbatch, run with a fake srun and scontrol: its launch line trains on 2 local nodes ----
SBATCH = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "train.sbatch"
FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: the job's two nodes, both this machine
[ "$1 $2" = "show hostnames" ] && [ "$3" = "$SLURM_JOB_NODELIST" ] && printf 'localhost\\nlocalhost\\n'
"""
FAKE_SRUN = """#!/bin/bash
# srun OPTIONS COMMAND...: COMMAND once per node, as Slurm starts one task on each, with the node's variables
printf '%s\\n' "$@" > "$SRUN_ARGV"
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $(( SLURM_JOB_NUM_NODES - 1 ))); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SRUN_LOGS/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_the_slurm_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_the_slurm_scripts_launch_line_trains_on_two_nodes(tmp_path, tiny_model_dir):
    """The sbatch script as Slurm runs it on the first node (srun and scontrol faked: srun starts its command once
    per node, here both on this machine): the torchrun line it builds meets at the first node's rendezvous and
    runs 1 step of HSDP across the 2 nodes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(32, seed=3))
    config = write_config(tmp_path / "run.yml", **base_config(tmp_path, tiny_model_dir, data,
                                                              **{**STEPS, **HSDP_ACROSS_NODES, "max_steps": 1}))
    port = free_port()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID=f"test{port}",
               SLURM_CPUS_PER_TASK="1", GPUS_PER_NODE="1", RDZV_PORT=str(port), OMP_NUM_THREADS="1",
               SRUN_ARGV=str(tmp_path / "srun_argv"), SRUN_LOGS=str(tmp_path))
    result = subprocess.run(["bash", str(SBATCH), str(config)], env=env, capture_output=True, text=True, timeout=300)
    logs = "".join((tmp_path / f"node{node}.log").read_text()[-3000:] for node in (0, 1))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    argv = (tmp_path / "srun_argv").read_text().split("\n")
    launched = argv[argv.index("torchrun"):-1]
    assert launched == ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", f"test{port}",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "-m", "tuneloop", "train",
                        str(config)]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert plan["world_size"] == 2 and summary["steps"] == plan["total_steps"] == 1
    assert summary["mesh"] == "mesh dp_replicate 2 × dp_shard 1 × tp 1 × cp 1"


def test_ray_keys_are_refused_naming_ray_and_what_to_launch_with_instead(tmp_path, tiny_model_dir):
    from conftest import assert_user_error

    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(8))
    config = write_config(tmp_path / "ray.yml", **base_config(tmp_path, tiny_model_dir, data, use_ray=True,
                                                              ray_num_workers=4))
    assert_user_error(run_in_process("check", str(config)), "`use_ray: True` asks for launching on a Ray cluster",
                      "`ray_num_workers: 4`", "torchrun --nnodes N", "examples/slurm/train.sbatch")
