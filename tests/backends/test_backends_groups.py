"""Process groups built from a plan over gloo, and activations/gradients across real stage boundaries.

One 8-rank launch: two NVIDIA stages (a direct boundary) then an Ascend stage (a bridged boundary),
each stage with its own layout; a second, 4-rank launch on a CPU cluster without emulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from heteroflow.backends import BRIDGE, DIRECT, RankMap, StageBoundary, build_process_groups, init_world
from heteroflow.config import parse_job
from heteroflow.remap.local import shard
from heteroflow.testing import run_ranks

SHAPE = (4, 16, 8)  # [micro-batch, seq, hidden] at every boundary


def mixed_job():
    return parse_job({
        "cluster": {"nodes": [{"name": "gpu-a", "device": "nvidia-a100-80g", "count": 2},
                              {"name": "gpu-b", "device": "nvidia-h100-sxm", "count": 2},
                              {"name": "npu", "device": "ascend-910b2", "count": 4}]},
        "model": {"preset": "tiny-llama"},
        "train": {"global_batch_size": 16, "micro_batch_size": 4, "precision": "fp32", "steps": 1},
        "plan": {"micro_batch_size": 4, "stages": [
            {"devices": ["gpu-a"], "layers": 3, "tp": 2, "dp": 1},
            {"devices": ["gpu-b"], "layers": 2, "tp": 1, "dp": 2},
            {"devices": ["npu"], "layers": 3, "tp": 2, "dp": 2}]},
    })


def cpu_job():
    return parse_job({
        "cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 4}]},
        "model": {"preset": "tiny-llama"},
        "train": {"global_batch_size": 16, "micro_batch_size": 4, "precision": "fp32", "steps": 1},
        "plan": {"micro_batch_size": 4, "stages": [
            {"devices": ["host:0-1"], "layers": 4, "tp": 2, "sp": True},
            {"devices": ["host:2-3"], "layers": 4, "dp": 2}]},
    })


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _exchange(groups, k: int, grad_replicas: str, seed: int) -> None:
    """Two micro-batches forward across boundary k (both in flight), then their gradients back."""
    ranks, rank = groups.rank_map, groups.rank
    gen = torch.Generator().manual_seed(seed)
    acts = [torch.randint(-99, 99, SHAPE, generator=gen).float() for _ in range(2)]
    grads = [torch.randint(-99, 99, SHAPE, generator=gen).float() for _ in range(2)]
    src, dst = ranks.activation_layout(k, SHAPE), ranks.activation_layout(k + 1, SHAPE)
    boundary = StageBoundary(groups, k, shape=SHAPE, dtype=torch.float32, grad_replicas=grad_replicas)
    if boundary.is_sender:
        sends = [boundary.send_activation(shard(a, src)[rank]) for a in acts]
        for handle in sends:
            assert handle.wait() is None
        got = [boundary.recv_grad() for _ in grads]
        for handle, g in zip(got, grads):
            assert torch.equal(handle.wait(), shard(g, src)[rank]), f"grad at rank {rank}"
    else:
        got = [boundary.recv_activation() for _ in acts]
        for handle, a in zip(got, acts):
            assert torch.equal(handle.wait(), shard(a, dst)[rank]), f"activation at rank {rank}"
        for g in grads:
            mine = shard(g, dst)[rank]
            replicas = dst.replica_set(rank)
            if grad_replicas == "partial" and len(replicas) > 1:  # partial sums that add up to the gradient
                offset = torch.full_like(mine, 7.0)
                mine = mine - (len(replicas) - 1) * offset if rank == replicas[0] else offset
            boundary.send_grad(mine).wait()


def mixed_worker(rank: int, world_size: int) -> dict:
    config = mixed_job()
    ranks = RankMap.from_plan(config.plan, config.cluster)
    groups = build_process_groups(ranks, emulate=True, stage_host_tensors=True, bridge_chunk_bytes=256)
    stage = ranks.info(rank).stage
    for k in (stage - 1, stage):
        if 0 <= k < ranks.num_stages - 1:
            _exchange(groups, k, "identical", seed=k)
            _exchange(groups, k, "partial", seed=10 + k)
    links = {name: None if link is None else {"kind": link.kind, "backend": link.backend, "ranks": link.ranks,
                                              "transport": link.transport.kind, "stats": link.transport.stats,
                                              "banks": getattr(link.transport, "num_banks", 0)}
             for name, link in (("prev", groups.prev), ("next", groups.next))}
    return {"stage": stage, "tp": _ranks(groups.tp), "dp": _ranks(groups.dp), "cp": _ranks(groups.cp),
            "replicas": _ranks(groups.replicas),
            "stage_ranks": _ranks(groups.stage), "fanout": _ranks(groups.fanout), "links": links,
            "created": groups.created, "backend": groups.backend}


def test_groups_and_boundaries_of_a_mixed_vendor_plan():
    results = run_ranks(mixed_worker, 8, timeout_s=180)
    assert all(r["created"] == results[0]["created"] for r in results)  # one order on every rank
    created = results[0]["created"]
    assert [name for name, _, _ in created][:4] == ["stage0.stage", "stage0.tp", "stage0.cp", "stage0.cp"]
    assert created[-2:] == (("boundary0.direct", (0, 1, 2, 3), "gloo"),
                            ("boundary1.bridge", (2, 3, 4, 5, 6, 7), "gloo"))
    assert not any(name.endswith("fanout") for name, _, _ in created)  # fan-out reuses the tp groups
    assert not any(name.endswith("replicas") for name, _, _ in created)  # cp 1 everywhere: the dp groups
    assert all(r["replicas"] == r["dp"] for r in results)
    assert {backend for _, _, backend in created} == {"gloo"}  # emulation
    expected = {0: ([0, 1], [0], [0, 1]), 2: ([2], [2, 3], None), 5: ([4, 5], [5, 7], [4, 5]),
                6: ([6, 7], [4, 6], [6, 7])}
    for rank, (tp, dp, fanout) in expected.items():
        assert (results[rank]["tp"], results[rank]["dp"], results[rank]["fanout"]) == (tp, dp, fanout)
        assert results[rank]["backend"] == "gloo"
    assert results[3]["stage_ranks"] == [2, 3] and results[3]["cp"] == [3]
    # The vendor labels chose the paths: NVIDIA -> NVIDIA direct, NVIDIA -> Ascend through the bridge.
    assert results[0]["links"]["prev"] is None and results[7]["links"]["next"] is None
    assert results[1]["links"]["next"]["transport"] == DIRECT
    assert results[2]["links"]["prev"]["transport"] == DIRECT
    assert results[2]["links"]["next"]["transport"] == BRIDGE
    assert results[6]["links"]["prev"]["kind"] == BRIDGE
    assert all(results[r]["links"]["next"]["stats"].bytes_staged == 0 for r in (0, 1))
    # Two micro-batches in flight each way: the bridge double-buffers with two host banks, no more.
    assert [results[r]["links"]["next"]["banks"] for r in (2, 3)] == [2, 2]
    assert all(results[r]["links"]["prev"]["banks"] == 2 for r in range(4, 8))
    staged = sum(results[r]["links"]["prev"]["stats"].bytes_staged for r in range(4, 8))
    assert staged > 0 and sum(results[r]["links"]["prev"]["stats"].chunks for r in range(4, 8)) >= staged // 256


def cpu_worker(rank: int, world_size: int) -> dict:
    config = cpu_job()
    ranks = RankMap.from_plan(config.plan, config.cluster)
    assert init_world(ranks) == rank  # joined already (by the harness): only checked
    mixed = mixed_job()
    try:
        init_world(RankMap.from_plan(mixed.plan, mixed.cluster))
    except ValueError as error:
        assert "the plan has 8 ranks but 4 processes were launched" in str(error)
    else:
        raise AssertionError("a world of the wrong size was accepted")
    groups = build_process_groups(ranks)  # not emulated: a CPU cluster really runs on gloo
    k = 0
    _exchange(groups, k, "identical", seed=3)
    link = groups.next or groups.prev
    return {"created": groups.created, "kind": link.kind, "staged": link.transport.stats.bytes_staged,
            "sent": link.transport.stats.bytes_sent, "received": link.transport.stats.bytes_received}


def test_a_cpu_cluster_uses_gloo_and_the_bridge_without_staging():
    results = run_ranks(cpu_worker, 4, timeout_s=120)
    assert {backend for _, _, backend in results[0]["created"]} == {"gloo"}
    assert {r["kind"] for r in results} == {BRIDGE}
    assert all(r["staged"] == 0 for r in results)  # host memory already: sent in place
    # Two activations and two gradients of 4*16*8 fp32 elements cross, each exactly once.
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results) == 4 * (4 * 16 * 8 * 4)
