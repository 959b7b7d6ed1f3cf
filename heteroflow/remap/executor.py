"""`RemapExecutor`: run one rank's part of a `TransferPlan` over torch.distributed.

`start()` posts every send and receive of the plan at once (batched isend/irecv through a
`Transport`) and returns; the caller computes while the bytes move and calls `handle.wait()` when it
needs the result. `wait()` then finishes the receives, fans the received pieces out to the rank's
replicas and returns the rank's share. The fan-out runs on the destination replica group (the
stage's own backend) as batched point-to-point: every member sends the pieces it received to the
others while receiving theirs, an all-gather in which all members send at once. (One broadcast per
piece would do the same on NCCL, but gloo runs the broadcasts of one group one after another.)

The executor owns its scratch buffers and reuses them on every call; the output tensor is new on each
call (a pipeline keeps several micro-batches' activations alive) unless the caller passes `out=`.
Up to `max_in_flight` calls may be in flight at once (each has its own set of scratch buffers);
messages of consecutive calls are matched in order, as both backends keep per-peer order. Wait for
handles in the order they were started: consecutive calls reuse tags, so the fan-out messages of
`wait()` must be posted in the same order by every member of a replica group.
On CPU, pass `out=` from a pool for large shares: a fresh tensor each call pays page faults.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from heteroflow.remap.layout import box_shape
from heteroflow.remap.plan import TransferPlan

MAX_PIECES = 1 << 20
"""Tags are `tag_base + piece index` (fan-out: `+ FANOUT_TAGS + fan-out index`); tag bases of different
executors differ by multiples of this."""
FANOUT_TAGS = MAX_PIECES // 2


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point message: `tensor` (contiguous) to or from global rank `peer`."""

    peer: int
    tensor: torch.Tensor
    tag: int


class TransportWork(Protocol):
    """What a transport returns for posted messages."""

    def wait(self) -> None:
        """Block until every message is sent or received (and copied into place)."""

    def is_completed(self) -> bool:
        """Whether `wait()` would return at once."""


class Transport(Protocol):
    """Moves messages across one stage boundary (see `heteroflow.backends.transport`)."""

    kind: str
    """`direct` (the vendor backend's own point-to-point) or `bridge` (host-staged over gloo)."""

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> TransportWork:
        """Start every send and receive; returns at once."""

    def together(self) -> contextlib.AbstractContextManager:
        """Posts inside the block go out as one batch (one group call) when it ends."""


class RemapHandle:
    """An in-flight remap on one rank; `wait()` returns the rank's destination share (None if the
    rank is only a source)."""

    def __init__(self, executor: "RemapExecutor", slot: int, work: TransportWork | None, out: torch.Tensor | None):
        self._executor, self._slot, self._work, self._out = executor, slot, work, out
        self._done = False

    def is_completed(self) -> bool:
        """Whether the transfer itself has finished (fan-out still runs inside `wait()`)."""
        return self._done or self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor | None:
        """Finish the transfer and the fan-out; the second call returns the same tensor."""
        if not self._done:
            try:
                if self._work is not None:
                    self._work.wait()
                self._executor._finish(self._out, self._slot)
            finally:
                self._done = True
                self._executor._slots[self._slot] = None
        return self._out


class RemapExecutor:
    """Runs rank `rank`'s part of `plan`, for tensors of `dtype` on `device`.

    `fanout_group` is the process group of this rank's destination replica set (its stage's backend;
    needed when the plan has fan-outs for this rank); `reduce_group` that of its source replica set
    (needed for `partial` plans). `tag_base` keeps concurrent executors on one group apart.
    `max_in_flight`: how many `start()`s may be waiting for their `wait()` at once.
    """

    def __init__(self, plan: TransferPlan, *, rank: int, transport: Transport, dtype: torch.dtype,
                 device: torch.device | str = "cpu", fanout_group: dist.ProcessGroup | None = None,
                 reduce_group: dist.ProcessGroup | None = None, tag_base: int = 0, max_in_flight: int = 2):
        assert max(len(plan.pieces), len(plan.fanouts)) < FANOUT_TAGS and tag_base % MAX_PIECES == 0, \
            "tag ranges must not overlap"
        self.plan, self.rank, self.transport = plan, rank, transport
        self.dtype, self.device = dtype, torch.device(device)
        self.tag_base = tag_base
        self.is_source, self.is_destination = rank in plan.src.ranks, rank in plan.dst.ranks
        self._sends = plan.sends_of(rank)
        self._recvs = plan.recvs_of(rank)
        self._fanouts = [(i, f) for i, f in enumerate(plan.fanouts) if rank in f.ranks]
        self._reduces = plan.pre_reduces_of(rank)
        if self._fanouts and fanout_group is None:
            raise ValueError(f"rank {rank} takes part in fan-outs of {plan.dst.describe()}; pass the process "
                             "group of its destination replica set as fanout_group")
        if self._reduces and reduce_group is None:
            raise ValueError(f"rank {rank} takes part in pre-reduces of {plan.src.describe()}; pass the process "
                             "group of its source replica set as reduce_group")
        self._fanout_group, self._reduce_group = fanout_group, reduce_group
        # Where each box this rank sends, reduces or receives sits in its local tensor (a share may be
        # several parts under context parallelism's load balancing).
        boxes_out = [piece.box for _, piece in self._sends] + [red.box for red in self._reduces]
        boxes_in = [piece.box for _, piece in self._recvs] + [fan.box for _, fan in self._fanouts]
        self._src_slices = {box: plan.src.local_slices(rank, box) for box in boxes_out} if self.is_source else {}
        self._dst_slices = {box: plan.dst.local_slices(rank, box) for box in boxes_in} if self.is_destination else {}
        self._scratch: dict[tuple[str, object], torch.Tensor] = {}
        self._slots: list[RemapHandle | None] = [None] * max_in_flight
        self.calls = 0
        """Completed and in-flight `start()` calls, for tests and logs."""

    def _buffer(self, key: tuple, shape: tuple[int, ...]) -> torch.Tensor:
        """A scratch buffer kept across calls (allocated on first use); keys include the call's slot."""
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return buf

    def start(self, local: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> RemapHandle:
        """Post this rank's part of the remap and return at once.

        `local`: this rank's source share (required on source ranks; must stay unchanged until the
        handle completes). `out`: where to put the destination share (a new tensor otherwise).
        With a `partial` plan, the pre-reduce inside the source stage runs before this returns.
        """
        slot = next((i for i, h in enumerate(self._slots) if h is None), None)
        if slot is None:
            raise RuntimeError(f"this RemapExecutor already has {len(self._slots)} remaps in flight "
                               "(max_in_flight); wait() for one of them first")
        if self.is_source:
            self._check(local, self.plan.src.local_shape(self.rank), "local")
        elif local is not None:
            raise ValueError(f"rank {self.rank} is not a source of this remap; call start() without a tensor")
        if self.is_destination:
            shape = self.plan.dst.local_shape(self.rank)
            out = torch.empty(shape, dtype=self.dtype, device=self.device) if out is None else out
            self._check(out, shape, "out")
        sends = self._post_reduces(local, slot) if self._reduces else {}
        messages_out: list[Message] = []
        for index, piece in self._sends:
            data = sends.get(index)
            if data is None:
                data = local[self._src_slices[piece.box]]
            if piece.dst == self.rank:  # layouts share this rank: a local copy, no message
                self._landing(out, index, piece.box, slot).copy_(data)
                continue
            if not data.is_contiguous():
                data = self._buffer(("send", slot, index), box_shape(piece.box)).copy_(data)
            messages_out.append(Message(piece.dst, data, self.tag_base + index))
        messages_in = [Message(piece.src, self._landing(out, index, piece.box, slot), self.tag_base + index)
                       for index, piece in self._recvs if piece.src != self.rank]
        work = self.transport.post(messages_out, messages_in) if messages_out or messages_in else None
        self.calls += 1
        handle = self._slots[slot] = RemapHandle(self, slot, work, out if self.is_destination else None)
        return handle

    def __call__(self, local: torch.Tensor | None = None) -> torch.Tensor | None:
        """Blocking remap: `start(local).wait()`."""
        return self.start(local).wait()

    def _check(self, tensor: torch.Tensor | None, shape: tuple[int, ...], name: str) -> None:
        if tensor is None:
            raise ValueError(f"rank {self.rank} holds a share of {self.plan.src.describe()}; pass it to start()")
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(f"{name} on rank {self.rank} must be {list(shape)} {self.dtype} on {self.device}, got "
                             f"{list(tensor.shape)} {tensor.dtype} on {tensor.device}")

    def _landing(self, out: torch.Tensor, index: object, box, slot: int) -> torch.Tensor:
        """Where piece `index` arrives: straight in `out` when that view is contiguous (no copy),
        else in a scratch buffer that `_finish` copies into `out`."""
        view = out[self._dst_slices[box]]
        return view if view.is_contiguous() else self._buffer(("land", slot, index), box_shape(box))

    def _post_reduces(self, local: torch.Tensor, slot: int) -> dict[int, torch.Tensor]:
        """Sum the source replicas' partial pieces onto their senders; {piece index: summed piece}."""
        index_of = {piece.box: index for index, piece in self._sends}
        works, summed = [], {}
        for i, red in enumerate(self._reduces):
            buf = self._buffer(("reduce", slot, i), box_shape(red.box))
            buf.copy_(local[self._src_slices[red.box]])
            works.append(dist.reduce(buf, dst=red.root, op=dist.ReduceOp.SUM, group=self._reduce_group,
                                     async_op=True))
            if red.root == self.rank:
                summed[index_of[red.box]] = buf
        for w in works:
            w.wait()
        return summed

    def _finish(self, out: torch.Tensor | None, slot: int) -> None:
        """After the transfer: exchange pieces with the replicas, then copy scratch landings into `out`."""
        if out is None:
            return
        pieces = self.plan.pieces
        index_of = {piece.box: index for index, piece in self._recvs}
        landings: list[tuple[object, torch.Tensor]] = []
        ops = []
        for i, fan in self._fanouts:
            tag = self.tag_base + FANOUT_TAGS + i
            if fan.root == self.rank:  # send the piece from where it landed to every other replica
                tensor = self._landing(out, index_of[fan.box], fan.box, slot)
                ops += [dist.P2POp(dist.isend, tensor, peer, group=self._fanout_group, tag=tag)
                        for peer in fan.ranks if peer != self.rank]
            else:
                key = ("fan", fan.box)
                tensor = self._landing(out, key, fan.box, slot)
                ops.append(dist.P2POp(dist.irecv, tensor, fan.root, group=self._fanout_group, tag=tag))
                landings.append((key, tensor))
        landings += [(index, self._landing(out, index, piece.box, slot)) for index, piece in self._recvs]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for key, tensor in landings:
            box = pieces[key].box if isinstance(key, int) else key[1]
            view = out[self._dst_slices[box]]
            if view.data_ptr() != tensor.data_ptr():  # landed in scratch, not in place
                view.copy_(tensor)
