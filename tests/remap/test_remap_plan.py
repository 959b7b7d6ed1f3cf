"""Transfer plans, checked without processes: bytes across the boundary, coverage, load balance, and
bit-for-bit round trips through the in-process executor (`heteroflow.remap.local`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from heteroflow.remap import Axis, TensorLayout, box_contains, box_volume, plan_transfer
from heteroflow.remap.local import apply_plan, reshard, shard, unshard
from heteroflow.testing.grid import GRID_SHAPE, degree_grid, placement

GRID = degree_grid()
PAIRS = list(itertools.product(GRID, GRID))


def layouts(src, dst, world_size=16):
    src_ranks, dst_ranks = placement(src, dst, world_size)
    return (TensorLayout.activation(GRID_SHAPE, ranks=src_ranks, dp=src.dp, tp=src.tp, sp=src.sp),
            TensorLayout.activation(GRID_SHAPE, ranks=dst_ranks, dp=dst.dp, tp=dst.tp, sp=dst.sp))


def test_grid_is_the_issue_grid():
    assert len(GRID) == 12 and len(PAIRS) == 144  # dp 1..4 x (tp1, tp2, tp2+sp)


@pytest.mark.parametrize("source_replicas", ["identical", "partial"])
def test_every_grid_pair_moves_each_element_exactly_once(source_replicas):
    for src_deg, dst_deg in PAIRS:
        src, dst = layouts(src_deg, dst_deg)
        plan = plan_transfer(src, dst, source_replicas=source_replicas)
        assert plan.boundary_bytes(2) == plan.min_boundary_bytes(2) == src.numel * 2, (src_deg, dst_deg)
        assert plan.remote_bytes(4) == plan.boundary_bytes(4)  # disjoint stages: nothing is local
        for piece in plan.pieces:  # a sender holds what it sends; a receiver needs what it gets
            assert box_contains(src.box(piece.src), piece.box) and box_contains(dst.box(piece.dst), piece.box)
        for rank in dst.ranks:  # each destination rank gets its whole box once: piece or fan-out
            got = [p.box for _, p in plan.recvs_of(rank)]
            got += [f.box for f in plan.fanouts_of(rank) if f.root != rank]
            assert sum(box_volume(b) for b in got) == box_volume(dst.box(rank)), (src_deg, dst_deg, rank)
        for fan in plan.fanouts:
            assert fan.ranks == dst.replica_set(fan.root)
        expect_reduces = source_replicas == "partial" and src.num_replicas > 1
        assert bool(plan.pre_reduces) == expect_reduces


def test_all_source_ranks_share_the_sending_and_all_receivers_the_receiving():
    for src_deg, dst_deg in PAIRS:
        src, dst = layouts(src_deg, dst_deg)
        plan = plan_transfer(src, dst)
        for box, holders in src.blocks():
            loads = [plan.send_load()[r] for r in holders]
            assert sum(loads) == box_volume(box)
            # Stripes are cut on whole rows of hidden (3 elements): no sender is off by more than a row
            # of the region it is cut in (at most seq * hidden here).
            assert max(loads) - min(loads) <= GRID_SHAPE[1] * GRID_SHAPE[2], (src_deg, dst_deg, loads)
            assert min(loads) > 0, (src_deg, dst_deg, loads)
        for box, holders in dst.blocks():
            loads = [plan.recv_load()[r] for r in holders]
            assert sum(loads) == box_volume(box) and min(loads) > 0, (src_deg, dst_deg, loads)


def test_aligned_layouts_send_whole_blocks_without_cutting():
    src = TensorLayout.activation((4, 8, 6), ranks=range(4), dp=2, tp=2)
    dst = TensorLayout.activation((4, 8, 6), ranks=range(4, 8), dp=4, tp=1)
    plan = plan_transfer(src, dst)
    # Each tp replica of a half batch sends one of its two quarters: 4 messages, all of one sample.
    assert [(p.src, p.dst, p.box[0]) for p in plan.pieces] == [(0, 4, (0, 1)), (1, 5, (1, 2)), (2, 6, (2, 3)),
                                                               (3, 7, (3, 4))]
    assert plan.fanouts == ()
    back = plan.reversed()
    # On the way back, each quarter lands on one replica and is broadcast to the other in its tp group.
    assert [(f.root, f.ranks) for f in back.fanouts] == [(0, (0, 1)), (1, (0, 1)), (2, (2, 3)), (3, (2, 3))]


def test_replicated_to_replicated_cuts_the_block_so_both_replicas_send():
    src = TensorLayout.activation((2, 4, 3), ranks=(0, 1), tp=2)
    dst = TensorLayout.activation((2, 4, 3), ranks=(2, 3), tp=2)
    plan = plan_transfer(src, dst)
    assert [(p.src, p.dst, p.box) for p in plan.pieces] == [(0, 2, ((0, 1), (0, 4), (0, 3))),
                                                            (1, 3, ((1, 2), (0, 4), (0, 3)))]
    assert plan.summary().endswith("send load 12..12 per source rank")


def test_dp2_to_dp3_with_a_batch_of_six():
    src = TensorLayout.activation((6, 2, 3), ranks=(0, 1), dp=2)
    dst = TensorLayout.activation((6, 2, 3), ranks=(2, 3, 4), dp=3)
    plan = plan_transfer(src, dst)
    assert [(p.src, p.dst, p.box[0]) for p in plan.pieces] == [(0, 2, (0, 2)), (0, 3, (2, 3)), (1, 3, (3, 4)),
                                                               (1, 4, (4, 6))]
    x = torch.randn(6, 2, 3)
    assert torch.equal(unshard(apply_plan(plan, shard(x, src)), dst), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grid_round_trips_bit_for_bit_in_process(dtype):
    x = torch.randn(GRID_SHAPE).to(dtype)
    for src_deg, dst_deg in PAIRS:
        src, dst = layouts(src_deg, dst_deg)
        forward = plan_transfer(src, dst)
        there = apply_plan(forward, shard(x, src))
        assert all(torch.equal(there[r], shard(x, dst)[r]) for r in dst.ranks), (src_deg, dst_deg)
        back = apply_plan(forward.reversed(), there)
        assert all(torch.equal(back[r], shard(x, src)[r]) for r in src.ranks), (src_deg, dst_deg)


def test_partial_gradients_are_summed_before_crossing():
    grad = torch.randint(-50, 50, GRID_SHAPE).float()
    for src_deg, dst_deg in PAIRS:
        src, dst = layouts(src_deg, dst_deg)
        # Backward: the destination stage's replicas hold integer partial sums of the gradient.
        parts = {}
        for box, holders in dst.blocks():
            full = shard(grad, dst)[holders[0]]
            noise = [torch.randint(-9, 9, full.shape).float() for _ in holders[1:]]
            parts[holders[0]] = full - sum(noise, torch.zeros_like(full))
            parts.update(zip(holders[1:], noise))
        got = apply_plan(plan_transfer(dst, src, source_replicas="partial"), parts)
        assert all(torch.equal(got[r], shard(grad, src)[r]) for r in src.ranks), (src_deg, dst_deg)


def test_checkpoint_reshard_between_tp_layouts_of_a_weight():
    weight = torch.randn(8, 6)
    tp4_rows = TensorLayout(shape=(8, 6), axes=(Axis("tp", 4, 0),), ranks=range(4))
    tp2_cols = TensorLayout(shape=(8, 6), axes=(Axis("tp", 2, 1),), ranks=range(2))
    tp2_rows_x2 = TensorLayout(shape=(8, 6), axes=(Axis("dp", 2), Axis("tp", 2, 0)), ranks=range(4))
    shards = shard(weight, tp4_rows)
    for target in (tp2_cols, tp2_rows_x2):
        out = reshard(shards, tp4_rows, target)
        assert torch.equal(unshard(out, target), weight)
    # The same ranks on both sides: pieces a rank keeps are local copies, not network bytes.
    plan = plan_transfer(tp4_rows, tp2_rows_x2)
    assert plan.boundary_bytes(4) == weight.numel() * 4
    assert plan.remote_bytes(4) < plan.boundary_bytes(4)


def test_plans_are_deterministic():
    src, dst = layouts(GRID[5], GRID[2])
    assert plan_transfer(src, dst) == plan_transfer(src, dst)
