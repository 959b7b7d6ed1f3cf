"""Expert parallelism's token movement: all-to-all dispatch inside an ep group, and the row collectives around it.

An ep group's ranks hold different tokens and each holds `layout.shards.local_experts` of every MoE layer. Per
layer and micro-batch, `AllToAllDispatcher`:
  1. groups this rank's (token, slot) assignments by expert (`moe.sort_by_expert`: capacity drops happen here,
     at the source, on this rank's tokens), so the rows for each ep rank are one contiguous block;
  2. exchanges the per-expert row counts (a small all-to-all of integers on the device), then the rows themselves
     (one all-to-all with variable split sizes; a rank's own block stays in place and is not sent). The split
     sizes must be on the host: the layer syncs twice (the counts of `sort_by_expert`, the received counts);
  3. runs each local expert on the rows it received from every rank, and sends the outputs back the same way;
  4. weights each returned row by its routing weight and adds it to its token.
Autograd: the backward of an all-to-all is the all-to-all with the splits swapped (`_AllToAll`), so gradients
take the reverse path and the routing weights get theirs at home. Every (token, expert) assignment travels
once each way, and only when its expert lives on another rank; `DispatchCounts` records what was sent.

The row collectives (`split_rows`, `gather_rows`) change which rows of a tp group's replicated tokens a rank
dispatches when experts are not split over tp (etp 1): each tp rank sends its share of the rows, so no token
goes to an expert twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from heteroflow.layout.shards import local_experts
from heteroflow.models.moe import Experts, combine, sort_by_expert
from heteroflow.models.shard import even_split
from heteroflow.models.tp_ops import _ALL_GATHER, _timed


@dataclass(slots=True)
class DispatchCounts:
    """What one rank's dispatcher did since the last `reset` (forward passes; backward mirrors them)."""

    routed: int = 0
    """(token, expert) assignments this rank dispatched (after capacity drops)."""
    sent_rows: int = 0
    """Rows sent to other ranks of the ep group (assignments whose expert lives elsewhere)."""
    received_rows: int = 0
    """Rows received from other ranks for the experts held here."""
    sent_bytes: int = 0
    """Bytes of `sent_rows` (token activations forward; the outputs returning are as many)."""
    received_bytes: int = 0
    forwards: int = 0
    """Dispatches (one per MoE layer and forward, recompute included)."""

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.__slots__:
            setattr(self, name, 0)


class _AllToAll(torch.autograd.Function):
    """Rows `in_splits[r]` to rank r, `out_splits[r]` from it; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, in_splits, out_splits):
        ctx.group, ctx.in_splits, ctx.out_splits = group, in_splits, out_splits
        return _all_to_all(x, group, in_splits, out_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.out_splits, ctx.in_splits), None, None, None


ALLTOALL = "alltoall"
"""The `PartTimer` part the token all-to-alls are timed as (the planner's `alltoall_s`)."""


def _all_to_all(x: torch.Tensor, group: ProcessGroup, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with _timed(group, ALLTOALL):
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, group: ProcessGroup, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
    """Send `in_splits[r]` consecutive rows of `x` to rank r of `group`, receive `out_splits[r]` from it."""
    return _AllToAll.apply(x, group, in_splits, out_splits)


class AllToAllDispatcher:
    """Experts spread over an ep group: tokens go to their experts by all-to-all and come back (module docstring).
    Plug into `Experts.dispatcher`; the group may be None (ep 1: everything stays here, still counted)."""

    def __init__(self, group: ProcessGroup | None, *, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        self.num_experts = num_experts
        self.counts = DispatchCounts()

    def __call__(self, experts: Experts, x_TH: torch.Tensor, weights_TK: torch.Tensor,
                 indices_TK: torch.Tensor) -> torch.Tensor:
        ep, per_rank = self.ep, self.num_experts // self.ep
        assert experts.held() == list(local_experts(self.num_experts, ep, self.ep_rank)), "held experts vs ep rank"
        token, slot, counts = sort_by_expert(indices_TK, self.num_experts, experts.capacity(x_TH.shape[0]))
        rows = x_TH[token]
        # counts_out[r, e]: rows for rank r's e-th local expert; counts_in[r, e]: rows from rank r for ours. They
        # cross on the device (NCCL and HCCL take no host tensors); the uneven all-to-alls need their split sizes
        # on the host: `counts` already is (sort_by_expert's one sync), `counts_in` comes back in one copy.
        send = [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]
        if self.group is None:
            self._count(len(token), send, send, rows.shape[1] * rows.element_size())
            y = experts.run(rows, counts)
        else:
            counts_out = torch.tensor(counts, dtype=torch.int64, device=x_TH.device).view(ep, per_rank)
            counts_in = self._exchange_counts(counts_out).cpu()
            recv = counts_in.sum(1).tolist()
            self._count(len(token), send, recv, rows.shape[1] * rows.element_size())
            received = all_to_all_rows(rows, self.group, send, recv)
            # Received rows come by source rank, then expert: regroup them by expert to run each expert once.
            by_expert = _block_order(counts_in).to(x_TH.device)
            y_by_expert = experts.run(received[by_expert], counts_in.sum(0).tolist())
            y = all_to_all_rows(y_by_expert[torch.argsort(by_expert)], self.group, recv, send)
        return combine(x_TH, token, y * weights_TK[token, slot, None])

    def _exchange_counts(self, counts_out: torch.Tensor) -> torch.Tensor:
        counts_in = torch.empty_like(counts_out)
        with _timed(self.group):
            dist.all_to_all_single(counts_in, counts_out, group=self.group)
        return counts_in

    def _count(self, routed: int, send: list[int], recv: list[int], row_bytes: int) -> None:
        c, me = self.counts, self.ep_rank
        sent, received = sum(send) - send[me], sum(recv) - recv[me]  # a rank's own block is not sent
        c.routed += routed
        c.sent_rows += sent
        c.received_rows += received
        c.sent_bytes += sent * row_bytes
        c.received_bytes += received * row_bytes
        c.forwards += 1


def _block_order(counts_SE: torch.Tensor) -> torch.Tensor:
    """Row indices that turn rows laid out by source then expert (`counts_SE[s, e]` rows each) into rows laid out
    by expert then source."""
    sources, num_experts = counts_SE.shape
    starts = (torch.cumsum(counts_SE.flatten(), 0) - counts_SE.flatten()).view(sources, num_experts)
    blocks = [torch.arange(int(starts[s, e]), int(starts[s, e] + counts_SE[s, e]))
              for e in range(num_experts) for s in range(sources)]
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)


def _padded_gather(x: torch.Tensor, group: ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows (rank r holds `sizes[r]`), concatenated in rank order."""
    most = max(sizes)
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, most - x.shape[0])).contiguous()
    out = padded.new_empty((len(sizes) * most, *x.shape[1:]))
    with _timed(group):
        _ALL_GATHER(out, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(out.split(most), sizes)])


def row_share(num_rows: int, group: ProcessGroup) -> tuple[int, int, list[int]]:
    """`(start, length, sizes)`: the rows of `num_rows` this rank of `group` takes (nearly even shares)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [even_split(num_rows, world, r)[1] for r in range(world)]
    return even_split(num_rows, world, rank)[0], sizes[rank], sizes


class _SplitRows(torch.autograd.Function):
    """Forward: this rank's share of replicated rows; backward: every rank's share gathered (a full gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        start, length, ctx.sizes = row_share(x.shape[0], group)
        ctx.group = group
        return x[start:start + length]

    @staticmethod
    def backward(ctx, grad):
        return _padded_gather(grad, ctx.group, ctx.sizes), None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows gathered (replicated); backward: this rank's share of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.start = sum(sizes[:dist.get_rank(group)])
        ctx.length = x.shape[0]
        return _padded_gather(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.length], None, None


def split_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's share of the rows of `x` (replicated over `group`); the backward gathers the gradient."""
    return _SplitRows.apply(x, group)


def gather_rows(x: torch.Tensor, group: ProcessGroup, num_rows: int) -> torch.Tensor:
    """The `num_rows` rows whose shares the ranks of `group` hold (`split_rows`), on every rank; the backward keeps
    this rank's share of the (replicated) gradient."""
    return _GatherRows.apply(x, group, row_share(num_rows, group)[2])
