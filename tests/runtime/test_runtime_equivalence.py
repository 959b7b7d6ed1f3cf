"""A heterogeneous plan reproduces single-process training: same losses and same final weights."""

from __future__ import annotations

import copy

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing import run_ranks

STEPS = 5
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 2},
                     {"name": "dcu-0", "device": "hygon-bw1000", "count": 4}]}
MODEL = {"preset": "micro-llama", "num_layers": 5}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}


def three_stage_plan(schedule: str, recompute: str) -> dict:
    """(tp2, dp1) on NVIDIA, (tp1, dp2) on Ascend, (tp2, dp2) on Hygon: three layouts, three vendors."""
    return {"schedule": schedule, "micro_batch_size": 4, "stages": [
        {"devices": ["gpu-0"], "layers": 2, "tp": 2, "dp": 1, "recompute": recompute},
        {"devices": ["npu-0"], "layers": 1, "tp": 1, "dp": 2, "recompute": recompute},
        {"devices": ["dcu-0"], "layers": 2, "tp": 2, "dp": 2, "sp": True, "recompute": recompute, "zero": 1},
    ]}


def _train_rank(rank: int, world_size: int, args: WorkerArgs):
    import torch.distributed as dist

    groups_before = len(dist.distributed_c10d._world.pg_map)  # private, but the only census of groups
    result = run_worker(args)
    # The harness keeps the world; the run must release its own groups (each holds gloo threads).
    assert len(dist.distributed_c10d._world.pg_map) == groups_before
    return result


def assemble(results) -> dict[str, torch.Tensor]:
    """Full logical parameters from every rank's shards."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, (local, shard) in result.state.items():
            tensor = full.setdefault(name, torch.zeros(shard.full_shape))
            shard.take(tensor).copy_(local)
    return full


_REFERENCES: dict[tuple, tuple] = {}


def reference(tie: bool, global_batch_size: int, data_dir: str):
    """Single-process losses and weights, computed once per model variant and batch."""
    key = (tie, global_batch_size)
    if key not in _REFERENCES:
        train = {**TRAIN, "global_batch_size": global_batch_size}
        job = parse_job({"cluster": CLUSTER, "model": {**MODEL, "tie_embeddings": tie}, "train": train})
        _REFERENCES[key] = train_reference(job, steps=STEPS, data_dir=data_dir)
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


@pytest.mark.slow
# GPipe with 4 micro-batches keeps more sends in flight than a boundary holds at once.
@pytest.mark.parametrize("schedule,recompute,tie,global_batch_size", [
    ("1f1b", "full", False, 8), ("gpipe", "selective", False, 16), ("1f1b", "none", True, 8)])
def test_three_stage_plan_matches_single_process(data_dir, schedule, recompute, tie, global_batch_size):
    ref_losses, ref_weights = reference(tie, global_batch_size, data_dir)
    train = {**TRAIN, "global_batch_size": global_batch_size}
    job = parse_job({"cluster": CLUSTER, "model": {**MODEL, "tie_embeddings": tie}, "train": train,
                     "plan": three_stage_plan(schedule, recompute)})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=STEPS, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=120)
    results = run_ranks(_train_rank, job.plan.num_devices, args, timeout_s=300)
    losses = results[0].losses
    assert len(losses) == STEPS
    assert losses[-1] < losses[0]  # it trains
    for got, want in zip(losses, ref_losses):
        assert got == pytest.approx(want, rel=1e-5)
    weights = assemble(results)
    if tie:  # the last stage's head is a synchronized copy of the embedding
        torch.testing.assert_close(weights.pop("head.weight"), weights["embed.weight"], rtol=0, atol=0)
    assert weights.keys() == ref_weights.keys()
    worst = max(float((weights[n] - w).abs().max()) for n, w in ref_weights.items())
    print(f"max loss rel diff {max(abs(g - w) / w for g, w in zip(losses, ref_losses)):.2e}, max weight diff {worst:.2e}")
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-4, atol=1e-4, msg=name)
