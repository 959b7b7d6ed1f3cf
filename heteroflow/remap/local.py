"""Apply a layout change in one process: shard, gather and reshard tensors held as a dict per rank.

For checkpoints (load the shards a tp=4 run saved, write the shards a tp=2 run needs) and as the
reference the distributed executor is tested against. Uses the same `TransferPlan` as the executor,
so a plan that is wrong here is wrong there too.
"""

from __future__ import annotations

from typing import Mapping

import torch

from heteroflow.remap.layout import TensorLayout, LayoutError, box_slices
from heteroflow.remap.plan import SourceReplicas, TransferPlan, plan_transfer


def shard(full: torch.Tensor, layout: TensorLayout) -> dict[int, torch.Tensor]:
    """Each rank's share of the logical tensor `full` (contiguous copies)."""
    if tuple(full.shape) != layout.shape:
        raise LayoutError(f"tensor of shape {list(full.shape)} does not match layout {layout.describe()}")
    return {rank: _gather_parts(full, layout, rank) for rank in layout.ranks}


def _gather_parts(full: torch.Tensor, layout: TensorLayout, rank: int) -> torch.Tensor:
    """A rank's share of `full`: its parts laid end to end (one part without balanced axes)."""
    out = torch.empty(layout.local_shape(rank), dtype=full.dtype, device=full.device)
    for part in layout.parts(rank):
        out[layout.local_slices(rank, part)] = full[box_slices(part)]
    return out


def unshard(shards: Mapping[int, torch.Tensor], layout: TensorLayout) -> torch.Tensor:
    """The logical tensor from one share per distinct block (replicas are checked to agree)."""
    first = shards[layout.ranks[0]]
    full = torch.empty(layout.shape, dtype=first.dtype, device=first.device)
    for parts, holders in layout.shares():
        for part in parts:
            full[box_slices(part)] = shards[holders[0]][layout.local_slices(holders[0], part)]
        for other in holders[1:]:
            if other in shards and not torch.equal(shards[other], shards[holders[0]]):
                raise ValueError(f"replicas {holders[0]} and {other} of share {parts} differ")
    return full


def apply_plan(plan: TransferPlan, shards: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Run `plan` on in-memory shards (`{source rank: its share}`): `{destination rank: its share}`.

    Follows the plan step by step (pre-reduce, pieces, fan-out) so tests of this function test the plan.
    """
    src, dst = plan.src, plan.dst
    first = shards[src.ranks[0]]
    outgoing = {rank: t.clone() for rank, t in shards.items()}
    for red in plan.pre_reduces:  # partial sums onto the sender of each piece
        view = src.local_slices(red.root, red.box)
        total = sum(shards[r][src.local_slices(r, red.box)] for r in red.ranks)
        outgoing[red.root][view] = total
    out = {rank: torch.empty(dst.local_shape(rank), dtype=first.dtype, device=first.device) for rank in dst.ranks}
    for piece in plan.pieces:
        out[piece.dst][dst.local_slices(piece.dst, piece.box)] = \
            outgoing[piece.src][src.local_slices(piece.src, piece.box)]
    for fan in plan.fanouts:
        value = out[fan.root][dst.local_slices(fan.root, fan.box)]
        for rank in fan.ranks:
            if rank != fan.root:
                out[rank][dst.local_slices(rank, fan.box)] = value
    return out


def reshard(shards: Mapping[int, torch.Tensor], src: TensorLayout, dst: TensorLayout, *,
            source_replicas: SourceReplicas = "identical") -> dict[int, torch.Tensor]:
    """Shares held as `src` turned into shares held as `dst` (e.g. tp=4 checkpoint shards to tp=2)."""
    return apply_plan(plan_transfer(src, dst, source_replicas=source_replicas), shards)
