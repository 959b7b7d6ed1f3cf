"""Boundary transports: how a remap's messages cross from one stage to the next.

- `DirectTransport`: both stages on one vendor; batched isend/irecv on a group of that vendor's
  backend (NCCL, HCCL) spanning both stages, device memory to device memory.
- `HostBridge`: different vendors (or a CPU stage); every message is staged through host memory and
  sent over gloo, which every build of torch has. Messages are cut into chunks (also those sent or
  received in place, so a staging side and a side that does not stage agree): the device-to-host
  copy of chunk i+1 runs while gloo sends chunk i, and on the receiver the host-to-device copy of
  chunk i runs while chunk i+1 arrives. Host buffers (pinned for accelerators) come from a pool of
  banks reused across calls; consecutive calls alternate banks (double buffering) so a new remap can
  stage while the previous one is still on the wire.

Tensors already in host memory (CPU tensors, as in emulation) are sent as they are unless
`stage_host_tensors=True`, which tests and benchmarks use to exercise the staging path on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from heteroflow.backends.vendor import BRIDGE, DIRECT
from heteroflow.remap.executor import Message


@dataclass(slots=True)
class TransportStats:
    """Counters since the transport was built, for tests, logs and benchmarks."""

    posts: int = 0
    messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_staged: int = 0
    """Bytes copied through host staging buffers (both directions)."""
    chunks: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Works:
    """A list of torch.distributed works seen as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class DirectTransport:
    """Point-to-point on the vendor backend's group that spans both stages."""

    kind = DIRECT

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.stats = TransportStats()
        self._batch: list | None = None
        """P2P ops collected inside `together()`, with the `_Works` each post returned."""

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> _Works:
        """Batched isend/irecv (one NCCL group call on CUDA) for every message; inside `together()` the batch
        is posted when the block ends."""
        ops = [dist.P2POp(dist.isend, m.tensor, m.peer, group=self.group, tag=m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.tensor, m.peer, group=self.group, tag=m.tag) for m in recvs]
        self.stats.posts += 1
        self.stats.messages += len(ops)
        self.stats.bytes_sent += sum(_nbytes(m.tensor) for m in sends)
        self.stats.bytes_received += sum(_nbytes(m.tensor) for m in recvs)
        if self._batch is not None:
            works = _Works([])
            self._batch.append((ops, works))
            return works
        return _Works(dist.batch_isend_irecv(ops) if ops else [])

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Post every message of the posts inside the block as one batch (one NCCL group call), as Megatron's
        `send_forward_recv_backward` does: on a communicator that runs its operations in posting order and
        whose sends wait for their receives, a send posted alone ahead of a receive can wait on a peer that
        waits on that receive. Each post's handle completes with the whole batch."""
        assert self._batch is None, "together() does not nest"
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            ops = [op for posted, _ in batch for op in posted]
            works = dist.batch_isend_irecv(ops) if ops else []
            for _, handle in batch:
                handle.works = works


@dataclass(slots=True)
class _Bank:
    """One host staging buffer and the work that last used it."""

    data: torch.Tensor
    work: "_BridgeWork | None" = None

    def free(self) -> bool:
        return self.work is None or self.work.is_completed()


@dataclass(slots=True)
class _BridgeWork:
    """Posted bridge messages: sends in flight, and receives still to be copied to the device."""

    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    """`(work, host chunk or None, device chunk or None)` in arrival order (None, None: received in place)."""
    devices: set = field(default_factory=set)
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        for work, host, target in self.recvs:
            work.wait()
            if target is not None:  # the copy of this chunk overlaps the arrival of the next
                target.copy_(host, non_blocking=True)
        for w in self.sends:
            w.wait()
        for device in self.devices:  # non_blocking copies must land before the caller reads them
            torch.get_device_module(device).synchronize(device)
        self.done = True

    def is_completed(self) -> bool:
        # Receives are complete only once copied to the device, which happens in wait().
        return self.done or (not self.recvs and all(w.is_completed() for w in self.sends))


class HostBridge:
    """Host-staged point-to-point over a gloo group that spans both stages (see the module doc)."""

    kind = BRIDGE

    def __init__(self, group: dist.ProcessGroup, *, chunk_bytes: int = 4 << 20, stage_host_tensors: bool = False):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.group = group
        self.chunk_bytes = chunk_bytes
        self.stage_host_tensors = stage_host_tensors
        self.stats = TransportStats()
        self._banks: list[_Bank] = []
        self._next_bank = 0

    @property
    def num_banks(self) -> int:
        """Host staging banks allocated so far (two in steady state with two calls in flight)."""
        return len(self._banks)

    def _staged(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or self.stage_host_tensors

    def _bank(self, nbytes: int, pin: bool) -> _Bank:
        """A free bank of at least `nbytes`, preferring the one after the last used (alternation)."""
        n = len(self._banks)
        for k in range(n):
            bank = self._banks[(self._next_bank + k) % n]
            if bank.free() and bank.data.numel() >= nbytes and (bank.data.is_pinned() or not pin):
                self._next_bank = (self._next_bank + k + 1) % n
                return bank
        bank = _Bank(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
        self._banks.append(bank)
        self._next_bank = 0
        return bank

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> _BridgeWork:
        """Stage and send every outgoing message chunk by chunk; post receives into host chunks."""
        work = _BridgeWork()
        staged = [m for m in (*sends, *recvs) if self._staged(m.tensor)]
        devices = {m.tensor.device for m in staged if m.tensor.device.type != "cpu"}
        work.devices = devices
        bank = None
        if staged:
            bank = self._bank(sum(_nbytes(m.tensor) for m in staged), pin=bool(devices))
            bank.work = work
        offset = 0
        # Every message crosses in `chunk_bytes` pieces, staged or not: the two sides decide on staging each for
        # itself (an accelerator stage stages, a CPU stage need not), so the piece layout must not depend on it.
        for m in recvs:  # post receives first so the peers' sends find them
            target = m.tensor.reshape(-1).view(torch.uint8)
            in_place = not self._staged(m.tensor)
            for a, b in self._chunks(target.numel()):
                if in_place:
                    work.recvs.append((dist.irecv(target[a:b], m.peer, group=self.group, tag=m.tag), None, None))
                    continue
                host = bank.data[offset + a:offset + b]
                work.recvs.append((dist.irecv(host, m.peer, group=self.group, tag=m.tag), host, target[a:b]))
            offset += 0 if in_place else target.numel()
        for m in sends:
            source = m.tensor.reshape(-1).view(torch.uint8)
            if not self._staged(m.tensor):
                work.sends += [dist.isend(source[a:b], m.peer, group=self.group, tag=m.tag)
                               for a, b in self._chunks(source.numel())]
                continue
            for a, b in self._chunks(source.numel()):
                host = bank.data[offset + a:offset + b]
                host.copy_(source[a:b], non_blocking=True)
                if source.device.type != "cpu":  # the bytes must be in host memory before gloo reads them
                    torch.get_device_module(source.device).synchronize(source.device)
                work.sends.append(dist.isend(host, m.peer, group=self.group, tag=m.tag))
            offset += source.numel()
        self._count(sends, recvs, staged)
        return work

    def together(self) -> contextlib.AbstractContextManager:
        """Nothing to batch: gloo runs every send and receive on its own (`DirectTransport.together`)."""
        return contextlib.nullcontext()

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk_bytes, nbytes)) for a in range(0, nbytes, self.chunk_bytes)]

    def _count(self, sends: Sequence[Message], recvs: Sequence[Message], staged: list[Message]) -> None:
        s = self.stats
        s.posts += 1
        s.messages += len(sends) + len(recvs)
        s.bytes_sent += sum(_nbytes(m.tensor) for m in sends)
        s.bytes_received += sum(_nbytes(m.tensor) for m in recvs)
        s.bytes_staged += sum(_nbytes(m.tensor) for m in staged)
        s.chunks += sum(len(self._chunks(_nbytes(m.tensor))) for m in staged)
