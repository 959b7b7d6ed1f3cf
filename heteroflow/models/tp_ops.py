"""Autograd-aware collectives over an explicit tp process group (Megatron-LM's mappings).

Each pair is the adjoint of the other: the forward of one is the backward of its partner, which is
what keeps activations *and* their gradients in the layout a stage promises (see parallelize.py).
Sequence is dim 1 of [batch, seq, hidden] activations.

Timing: inside `with timing_collectives(group, timer):` every collective of this module on `group` is timed
as the part `collective` of `timer` (a `devices.timing.PartTimer`). The runtime installs its stage's timer
around each step's pipeline; outside such a block nothing is timed and nothing is installed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


COLLECTIVE = "collective"
"""The `PartTimer` part the collectives are timed as."""

_TIMERS: dict[int, tuple[ProcessGroup, Any]] = {}
"""The timers installed by `timing_collectives`, by process group (id); empty outside such blocks."""


@contextlib.contextmanager
def timing_collectives(group: ProcessGroup | None, timer: Any) -> Iterator[None]:
    """Time the collectives on `group` (None: a stage without tp, nothing to time) with `timer` inside the
    block; the timer is removed on exit, also when the block fails."""
    if group is None:
        yield
        return
    key = id(group)
    if key in _TIMERS:
        raise RuntimeError("the collectives of this process group are already being timed")
    _TIMERS[key] = (group, timer)  # the group is held so that its id cannot be reused meanwhile
    try:
        yield
    finally:
        del _TIMERS[key]


def _timed(group: ProcessGroup, part: str = COLLECTIVE) -> contextlib.AbstractContextManager:
    """Time a collective on `group` as `part` of the timer installed for it (nothing when none is)."""
    entry = _TIMERS.get(id(group))
    return entry[1].part(part) if entry is not None else contextlib.nullcontext()


def _all_reduce(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()
    with _timed(group):
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with _timed(group):
        _ALL_GATHER(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    assert x.shape[dim] % world == 0, f"dim {dim} of {tuple(x.shape)} does not split over {world} ranks"
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with _timed(group):
        _REDUCE_SCATTER(out, x, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    assert x.shape[dim] % world == 0, f"dim {dim} of {tuple(x.shape)} does not split over {world} ranks"
    return x.chunk(world, dim=dim)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce: enter a tp region with replicated activations."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce, backward identity: leave a tp region back to replicated activations."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """Forward all-gather over the sequence, backward reduce-scatter: enter a tp region under sp."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, 1), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Forward reduce-scatter over the sequence, backward all-gather: leave a tp region under sp."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, 1), None


class _SplitSeq(torch.autograd.Function):
    """Forward keep this rank's sequence chunk, backward all-gather (replicated -> sequence shards)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, 1), None


class _GatherLastDim(torch.autograd.Function):
    """Forward all-gather of uneven last-dim shards (padded to equal size), backward keep own part."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.rank, ctx.sizes = dist.get_rank(group), sizes
        pad = max(sizes) - x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, pad))
        gathered = _all_gather(padded, group, padded.dim() - 1).split(max(sizes), dim=-1)
        return torch.cat([part[..., :n] for part, n in zip(gathered, sizes)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[:ctx.rank])
        return grad[..., start:start + ctx.sizes[ctx.rank]].contiguous(), None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity; the backward sums the gradient over `group`."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over `group`; the gradient passes through."""
    return _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather sequence shards; the backward reduce-scatters."""
    return _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over `group` and keep this rank's sequence shard; the backward all-gathers."""
    return _ReduceScatterSeq.apply(x, group)


def split_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's sequence shard of a replicated tensor; the backward all-gathers."""
    return _SplitSeq.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's last-dim shard (rank r holds `sizes[r]` entries)."""
    return _GatherLastDim.apply(x, group, sizes)


def all_gather_dim(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (no gradient)."""
    return _all_gather(x, group, dim)


def reduce_scatter_dim(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Sum over `group` and keep this rank's block of `dim` (no gradient)."""
    return _reduce_scatter(x, group, dim)


def all_reduce_max(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Elementwise max over `group` (no gradient)."""
    return _all_reduce(x, group, op=dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Elementwise sum over `group` (no gradient)."""
    return _all_reduce(x, group)
