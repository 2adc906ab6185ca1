"""The plan's communication per rank per step (plan/comm.py) against the bytes 2 real gloo ranks put on the wire.

The measurement is the kernel's, not a re-derivation: each rank reads TCP_INFO (tcpi_bytes_sent,
tcpi_bytes_received) of every TCP socket it holds after each optimizer step, and the test counts the connections
whose other end is the other rank's (gloo's; the launcher's store and anything else are left out), through the run's own hooks (`phase("zero_grad")` ends a step), and the
bytes of steps 2 and 3 are compared with what the plan promised per step. gloo's own framing and the loss's and
the norm's scalar reductions ride along: a percent or so on this tiny model.

Run as a script under torchrun, this file is the probe each rank runs (`python -m torch.distributed.run ...
tests/test_comm_volume.py a.yml a-counts/ b.yml b-counts/ ...`: the runs one after another in one launch)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
from pathlib import Path

TCP_INFO_BYTES_RECEIVED, TCP_INFO_BYTES_SENT = 128, 200  # offsets in Linux's struct tcp_info (4.19 and later)


def tcp_bytes(skip_port: int | None) -> list[list[int]]:
    """[local port, peer port, sent, received] of each of this process's TCP connections, as the kernel counts them
    (payload, no headers). The test keeps the connections whose other end is the other rank's (gloo's)."""
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with probe:
            try:
                if probe.type != socket.SOCK_STREAM or probe.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                local, peer = probe.getsockname()[1], probe.getpeername()[1]
                ports = {local, peer}
                info = probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            except OSError:  # a listening socket, or one being closed
                continue
        if skip_port in ports or len(info) < TCP_INFO_BYTES_SENT + 8:
            continue
        sockets.append([local, peer, struct.unpack_from("Q", info, TCP_INFO_BYTES_SENT)[0],
                        struct.unpack_from("Q", info, TCP_INFO_BYTES_RECEIVED)[0]])
    return sockets


def between_ranks(mine: list[list[int]], theirs: list[list[int]]) -> tuple[int, int]:
    """(sent, received) over the connections whose other end is among the other rank's."""
    ends = {(local, peer) for local, peer, *_ in theirs}
    kept = [(sent, received) for local, peer, sent, received in mine if (peer, local) in ends]
    return sum(sent for sent, _ in kept), sum(received for _, received in kept)


def probe_main(*configs_and_outs: str) -> int:
    """One rank: each run (CONFIG OUT, one after another in this launch), with the TCP counters read after every
    optimizer step. (A run's own group opens its own connections; the counts are differences between steps.)"""
    from tuneloop.config import load_run_config
    from tuneloop.run import TrainingSession
    from tuneloop.train.hooks import RunHooks

    store_port = int(os.environ["MASTER_PORT"])

    class AfterEachStep(RunHooks):
        def __init__(self):
            self.counts: list[list[list[int]]] = []

        def phase(self, name: str):
            return self._counted() if name == "zero_grad" else contextlib.nullcontext()

        @contextlib.contextmanager
        def _counted(self):
            yield
            self.counts.append(tcp_bytes(store_port))

    for config, out in zip(configs_and_outs[::2], configs_and_outs[1::2]):
        hooks = AfterEachStep()
        with TrainingSession(load_run_config(config), hooks) as session:
            result = session.run()
        assert result.error is None, result.error
        Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(hooks.counts))
    return 0


if __name__ == "__main__":
    sys.exit(probe_main(*sys.argv[1:]))


# ---- the tests -----------------------------------------------------------------------------------------------
import subprocess  # noqa: E402

import pytest  # noqa: E402
from conftest import base_config, free_port, tiny_rows, write_config, write_jsonl  # noqa: E402

from tuneloop.engines.base import WholeBytes  # noqa: E402
from tuneloop.engines.fsdp2 import FSDP2Spec  # noqa: E402
from tuneloop.engines.ddp import DDPSpec  # noqa: E402
from tuneloop.engines.deepspeed import DeepSpeedSpec  # noqa: E402
from tuneloop.engines.mesh import MeshKeys  # noqa: E402
from tuneloop.plan.comm import communication_per_step  # noqa: E402

STEPS = {"optimizer": "adamw_torch", "learning_rate": 1e-3, "max_grad_norm": 1.0, "max_steps": 3,
         "lr_scheduler": "constant", "num_epochs": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
FSDP = {"fsdp_version": 2, "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                           "reshard_after_forward": True}}


def launch(*configs_and_outs: Path) -> subprocess.Popen:
    """The probe on 2 ranks over every (config, counts folder) given, in one launch."""
    for out in configs_and_outs[1::2]:
        out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), __file__, *map(str, configs_and_outs)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_the_plans_bytes_per_step_are_what_gloo_sends(tmp_path, tiny_model_dir):
    """DDP, FSDP2 (reshard_after_forward), tensor parallel (tp 2: its layers' activation all-reduces, no data
    ranks to reduce over) and context parallel on DDP (cp 2: Ulysses' all-to-alls, and the gradients averaged
    over the cp ranks), the last two with rows padded to sequence_len, since the plan counts the largest
    micro-batch; 2 ranks, 2 micro-batches a step, fp32: the four runs one after another in one launch."""
    data = write_jsonl(tmp_path / "train.jsonl", tiny_rows(64, seed=3))
    runs, probed = {}, []
    for name, keys in (("ddp", {}), ("fsdp2", FSDP),
                       ("tp", {**FSDP, "tensor_parallel_size": 2, "pad_to_sequence_len": True}),
                       ("cp", {"context_parallel_size": 2, "pad_to_sequence_len": True})):
        run_dir = tmp_path / name
        config = write_config(tmp_path / f"{name}.yml", **base_config(run_dir, tiny_model_dir, data, **STEPS, **keys))
        runs[name] = run_dir
        probed += [config, tmp_path / f"{name}-counts"]
    process = launch(*probed)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, out[-2000:] + err[-4000:]
    measured = {}
    for name, run_dir in runs.items():
        plan = json.loads((run_dir / "out" / "plan.json").read_text())
        promised = plan["communication"]["bytes_per_rank_per_step"]
        counts = [json.loads((tmp_path / f"{name}-counts" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        for rank in (0, 1):
            assert len(counts[rank]) == STEPS["max_steps"]
            after_step = [between_ranks(counts[rank][step], counts[1 - rank][step]) for step in (0, 2)]
            sent, received = ((after_step[1][i] - after_step[0][i]) / 2 for i in (0, 1))  # steps 2 and 3
            measured[name, rank] = sent
            print(f"\n{name} rank {rank}: sent {sent:.0f} B, received {received:.0f} B per step; plan {promised} "
                  f"({plan['communication']['words']})")
            assert sent == pytest.approx(promised, rel=0.03) and received == pytest.approx(promised, rel=0.03)
    # FSDP2's 2 micro-batches each gather the weights twice (4 × half of them) and reduce once: 3 × DDP's bytes;
    # a reduce in every micro-batch would make it 4 ×, the root kept gathered from forward to backward about 2.6 ×
    assert measured["fsdp2", 0] == pytest.approx(3 * measured["ddp", 0], rel=0.03)


# ---- the formulas on a model of known sizes: no processes ------------------------------------------------------
WHOLE = WholeBytes(weights=4e9, gradients=4e9, optimizer=8e9, parameters=10 ** 9, trainable=10 ** 9, weight_bytes=4,
                   layer_parameters=45 * 10 ** 6, layers=20)  # a root of 100M parameters, 900M in the layers


def test_ddp_all_reduces_the_gradients_once_per_step():
    sent = communication_per_step(DDPSpec(), WHOLE, 8, accumulation=4, precision="fp32")
    assert sent.total == pytest.approx(2 * 7 / 8 * 4e9)
    assert communication_per_step(DDPSpec(), WHOLE, 1, 4, "fp32").total == 0


def test_fsdp2_gathers_each_micro_batch_and_reduces_once_in_fp32():
    spec = FSDP2Spec(shards_weights=True, shards_gradients=True, shards_optimizer=True)
    sent = communication_per_step(spec, WHOLE, 4, accumulation=2, precision="bf16")
    gathered = 3 / 4 * 2 * 2e9  # bf16 weights, in the forward and again in the backward
    assert sent.total == pytest.approx(2 * gathered + 3 / 4 * 4e9)
    on_gloo = communication_per_step(spec, WHOLE, 4, accumulation=2, precision="bf16", backend="gloo")
    assert on_gloo.total == pytest.approx(2 * gathered + 2 * 3 / 4 * 4e9)  # (its reduce-scatter is an all-reduce)
    kept = FSDP2Spec(shards_weights=True, shards_gradients=True, shards_optimizer=True, reshard_after_forward=False)
    assert communication_per_step(kept, WHOLE, 4, 1, "bf16").total == pytest.approx(3 / 4 * 2e9 + 3 / 4 * 4e9)


def test_hsdp_adds_the_shards_all_reduce_across_replicas():
    spec = FSDP2Spec(shards_weights=True, shards_gradients=True, shards_optimizer=True,
                     mesh_keys=MeshKeys(dp_replicate=2, dp_shard=4, written=True))
    sent = communication_per_step(spec, WHOLE, 8, accumulation=1, precision="fp32")
    within = 3 / 4 * 4 * 2e9 + 3 / 4 * 4e9
    assert sent.total == pytest.approx(within + 2 * 1 / 2 * 4e9 / 4)
    assert "across 2 replicas" in sent.words()


@pytest.mark.parametrize("stage, expected", [
    (1, 2 * 7 / 8 * 2e9 + 7 / 8 * 2e9),  # bf16 gradients all-reduced once, bf16 weights all-gathered
    (2, 4 * 2 * 7 / 8 * 2e9 + 7 / 8 * 2e9),  # ... the reduction in each of the 4 micro-batches
    (3, 4 * (2 * 7 / 8 * 2e9 + 7 / 8 * 2e9)),  # weights gathered twice and gradients reduce-scattered per micro
])
def test_zero_stages_as_deepspeed_moves_them(stage, expected):
    spec = DeepSpeedSpec(shards_weights=stage >= 3, shards_gradients=stage >= 2, shards_optimizer=True, stage=stage,
                         config={"bf16": {"enabled": "auto"}})
    assert communication_per_step(spec, WHOLE, 8, accumulation=4, precision="bf16").total == pytest.approx(expected)


def test_tensor_parallel_reduces_once_per_split_projection_and_fsdp2_moves_one_tp_ranks_share():
    """Under tp 2, each layer's 2 row-wise and 5 column-wise projections all-reduce a micro-batch's hidden states
    once each (forward and backward); FSDP2 over the data ranks gathers and reduces what one tp rank holds: the
    root whole, the layers halved."""
    from dataclasses import replace

    whole = replace(WHOLE, micro_batch_tokens=4096, hidden_size=1024, rowwise_projections=2, colwise_projections=5)
    spec = FSDP2Spec(shards_weights=True, shards_gradients=True, shards_optimizer=True,
                     mesh_keys=MeshKeys(dp_shard=4, tp=2, written=True))
    sent = communication_per_step(spec, whole, 8, accumulation=2, precision="bf16")
    held = 100e6 + 900e6 / 2  # parameters one tp rank holds
    gathers = 2 * 3 / 4 * 2 * held * 2  # bf16, forward and backward, 2 micro-batches
    reduce = 3 / 4 * 4 * held
    activations = 7 * 20 * 2 * (2 * 1 / 2 * 4096 * 1024 * 2)
    assert sent.total == pytest.approx(gathers + reduce + activations)
    assert "7 a layer" in sent.words()


def test_context_parallel_adds_its_all_to_alls_and_averages_over_its_ranks():
    """Ulysses: per layer and micro-batch, q, k, v and the output exchanged in the forward and again in the
    backward, each all-to-all sending (cp - 1) / cp of this rank's slice; the gradients reduced over dp × cp."""
    from dataclasses import replace

    from tuneloop.engines.mesh import Mesh, MeshKeys
    from tuneloop.plan.comm import model_parallel_transfers

    assert model_parallel_transfers(WHOLE, Mesh(dp_shard=8), 1, "bf16") == []
    whole = replace(WHOLE, micro_batch_tokens=4096, attention_width=2048, kv_width=512)
    [exchange] = model_parallel_transfers(whole, Mesh(dp_shard=4, cp=2), 3, "bf16")
    per_micro_batch_layer = 2 * (4096 / 2) * (2 * 2048 + 2 * 512) * 2 * (1 / 2)
    assert exchange.bytes == pytest.approx(3 * whole.layers * per_micro_batch_layer)
    ddp = DDPSpec(mesh_keys=MeshKeys(cp=2))
    plain = communication_per_step(DDPSpec(), whole, 4, accumulation=1, precision="bf16").transfers[0].bytes
    assert communication_per_step(ddp, whole, 8, accumulation=1, precision="bf16").transfers[0].bytes == \
        pytest.approx(plain * (7 / 8) / (3 / 4))  # an all-reduce over 8 ranks, not 4
