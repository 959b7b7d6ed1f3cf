"""The distributed executor over gloo: every grid pair, forward and backward, bit for bit, in one launch.

Eight ranks; each pair places its source stage at the front of the world and its destination stage
at the back (disjoint whenever 8 ranks suffice, sharing ranks otherwise). Pairs rotate through the
direct transport, the host bridge with staging forced (many small chunks) and the plain bridge.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from heteroflow.backends.transport import DirectTransport, HostBridge
from heteroflow.remap import TensorLayout, plan_transfer
from heteroflow.remap.executor import RemapExecutor
from heteroflow.remap.local import shard
from heteroflow.testing import run_ranks
from heteroflow.testing.grid import GRID_SHAPE, degree_grid, placement

WORLD = 8
PAIRS = list(itertools.product(degree_grid(), degree_grid()))


class _Groups:
    """Process groups by rank set, created on first need; every rank asks in the same order."""

    def __init__(self):
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def of(self, layout: TensorLayout, rank: int) -> dist.ProcessGroup | None:
        mine = None
        for _, holders in layout.blocks():
            if len(holders) > 1:
                if holders not in self.groups:
                    self.groups[holders] = dist.new_group(list(holders))
                if rank in holders:
                    mine = self.groups[holders]
        return mine


def _partials(grad: torch.Tensor, layout: TensorLayout, seed: int) -> dict[int, torch.Tensor]:
    """Integer partial sums over each replica set that add up to `grad`'s shares exactly."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for _, holders in layout.blocks():
        full = shard(grad, layout)[holders[0]]
        noise = [torch.randint(-9, 9, full.shape, generator=gen).to(grad.dtype) for _ in holders[1:]]
        out[holders[0]] = full - sum(noise, torch.zeros_like(full))
        out.update(zip(holders[1:], noise))
    return out


def grid_worker(rank: int, world_size: int, pairs: list, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-100, 100, GRID_SHAPE, generator=gen).to(dtype)  # the same on every rank
    groups = _Groups()
    transports = [DirectTransport(dist.group.WORLD), HostBridge(dist.group.WORLD, chunk_bytes=40,
                                                                 stage_host_tensors=True),
                  HostBridge(dist.group.WORLD)]
    checked = 0
    for index, (s, d) in enumerate(pairs):
        src_ranks, dst_ranks = placement(s, d, world_size)
        src = TensorLayout.activation(GRID_SHAPE, ranks=src_ranks, dp=s.dp, tp=s.tp, sp=s.sp)
        dst = TensorLayout.activation(GRID_SHAPE, ranks=dst_ranks, dp=d.dp, tp=d.tp, sp=d.sp)
        src_group, dst_group = groups.of(src, rank), groups.of(dst, rank)
        transport = transports[index % 3]
        where = f"pair {index} {s} -> {d} via {transport.kind} on rank {rank}"
        forward = RemapExecutor(plan_transfer(src, dst), rank=rank, transport=transport, dtype=dtype,
                                fanout_group=dst_group)
        mode = "partial" if index % 2 else "identical"
        backward = RemapExecutor(plan_transfer(dst, src, source_replicas=mode), rank=rank, transport=transport,
                                 dtype=dtype, fanout_group=src_group, reduce_group=dst_group, tag_base=1 << 20)
        local = shard(x, src).get(rank)
        if index % 4 == 0:  # two micro-batches in flight at once, waited in order
            first = forward.start(local)
            second = forward.start(None if local is None else local * 2)
            got = [first.wait(), second.wait()]
            if rank in dst.ranks:
                expected = shard(x, dst)[rank]
                assert torch.equal(got[0], expected) and torch.equal(got[1], expected * 2), where
        there = forward.start(local).wait()
        if rank in dst.ranks:
            assert torch.equal(there, shard(x, dst)[rank]), where
        grad = there if mode == "identical" else _partials(x, dst, seed=index).get(rank)
        back = backward.start(grad).wait()
        if rank in src.ranks:
            assert torch.equal(back, local), f"{where} ({mode} gradients)"
        checked += 1
    return {"checked": checked, "kinds": sorted({t.kind for t in transports}),
            "staged": transports[1].stats.bytes_staged, "chunks": transports[1].stats.chunks}


@pytest.mark.slow
def test_every_grid_pair_round_trips_bit_for_bit_over_gloo():
    results = run_ranks(grid_worker, WORLD, PAIRS, torch.float32, timeout_s=300)
    assert [r["checked"] for r in results] == [len(PAIRS)] * WORLD
    assert results[0]["kinds"] == ["bridge", "direct"]
    assert sum(r["staged"] for r in results) > 0
    assert sum(r["chunks"] for r in results) > sum(r["staged"] for r in results) // 40 - 1


def bf16_pairs() -> list:
    """Pairs that fit 4 ranks and cross replicated, split and uneven layouts."""
    return [(s, d) for s, d in PAIRS if s.num_ranks <= 4 and d.num_ranks <= 4 and s.tp == 2 and d.dp in (1, 3)]


def test_bf16_remaps_round_trip_bit_for_bit():
    pairs = bf16_pairs()
    assert len(pairs) >= 4
    results = run_ranks(grid_worker, 4, pairs, torch.bfloat16, timeout_s=120)
    assert [r["checked"] for r in results] == [len(pairs)] * 4
