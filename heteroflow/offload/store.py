"""`TieredStore`: named flat chunks whose home is the device, pinned CPU memory or an SSD swap file.

A chunk is a list of same-dtype tensors flattened into one buffer (its layout remembers the shapes).
Its *home* tier holds the authoritative copy; callers borrow a working copy:

- `prefetch(name, to=...)` starts bringing a chunk closer (SSD read into a staging buffer; CPU -> device
  copy when it is wanted on the device);
- `get(name)` returns the flat device copy, `host(name)` the flat host copy (for CPU-side updates);
- `release(name)` drops the borrowed copy; `write_back(name)` first stores it back to the home tier;
- `write_slice(name, offset, src)` overwrites part of the home copy (the optimizer's updated params).

SSD traffic goes through a bounded pool of `max_in_flight` aligned, page-locked staging buffers: at
most that many reads and writes are outstanding, and a new transfer first waits for the oldest write.
Every SSD write records the CRC of each block it writes and every SSD read is checked against them
(`SwapChecksums`): a swap file damaged on disk raises `StateCorrupted` naming the file and block.
Device copies are charged to the `DeviceBudget` before they are allocated. On a CPU device (a `cpu`
node, or an emulated rank) the device computes on host memory, so its "copy" of a chunk is the host
copy itself (the cpu-tier home, or the staging buffer an SSD read landed in, kept until `release`):
still charged to the budget, but never allocated and copied again. The store is driven from
one thread at a time (the training thread, or autograd's thread during backward).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from heteroflow.devices import Device
from heteroflow.errors import UserError
from heteroflow.offload.aio import IOEngine, IORequest, open_engine, round_up
from heteroflow.offload.budget import DeviceBudget
from heteroflow.offload.swap import SwapChecksums, SwapDir

TIERS = ("device", "cpu", "ssd")


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How a chunk's tensors sit in its flat buffer (densely, in order)."""

    name: str
    tier: str
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    stored_bytes: int
    """Bytes in the home tier: `numel * itemsize` rounded up to the I/O alignment on SSD."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors themselves."""
        return self.numel * self.dtype.itemsize

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors as views into `flat`."""
        views, start = [], 0
        for shape in self.shapes:
            n = _numel(shape)
            views.append(flat[start:start + n].view(shape))
            start += n
        return views


@dataclass(slots=True)
class StoreStats:
    """Counters for tests and benchmarks."""

    bytes_read: int = 0
    bytes_written: int = 0
    max_buffers: int = 0
    """Most staging buffers allocated at once (never above `max_in_flight`)."""
    max_in_flight: int = 0
    """Most SSD transfers outstanding at once (never above `max_in_flight`)."""


@dataclass(slots=True)
class _Buffer:
    data: torch.Tensor  # aligned uint8 host memory
    owner: str | None = None  # chunk staged here (read, or waiting for write_back)
    request: IORequest | None = None  # read or write under way
    event: Any = None  # device copy from this buffer under way
    seq: int = 0  # submission order of `request`, to wait for the oldest write first
    target: str | None = None  # chunk whose file a pending write goes to
    span: tuple[int, int] = (0, 0)  # its byte range in that file
    verify: str | None = None  # chunk whose read, once complete, is checked against its checksums
    pending: Any = None  # checksums of a pending write, still being computed (SwapChecksums.settle)


@dataclass(slots=True)
class _DeviceCopy:
    tensor: torch.Tensor
    event: Any  # copy finished (None on CPU: copies there are synchronous)
    kind: str


class TieredStore:
    """Chunks on device / cpu / ssd with bounded asynchronous staging; see the module docstring.

    `device_copies`: whether a chunk borrowed on the device is a separate allocation (None: yes, except on
    a CPU device). `checksums`: check SSD reads against CRCs of what was written (off only to measure
    what they cost).
    """

    def __init__(self, *, device: Device, budget: DeviceBudget | None = None, swap: SwapDir | None = None,
                 engine: IOEngine | None = None, max_in_flight: int = 2, buffer_bytes: int = 0,
                 device_copies: bool | None = None, checksums: bool = True) -> None:
        assert max_in_flight >= 1
        self.device = device
        self.budget = budget if budget is not None else DeviceBudget(None)
        self.swap = swap
        self.max_in_flight = max_in_flight
        self.buffer_bytes = buffer_bytes
        self.stats = StoreStats()
        self._pin = device.kind != "cpu"
        # Device copies are the host copies themselves on a CPU device (module docstring); tests may force
        # separate copies there to exercise the accelerator path.
        self._alias = device.kind == "cpu" if device_copies is None else not device_copies
        self._engine = engine
        self._own_engine = engine is None
        self._layouts: dict[str, ChunkLayout] = {}
        self._kinds: dict[str, str] = {}
        self._homes: dict[str, torch.Tensor] = {}  # device and cpu tiers
        self._files: dict[str, str] = {}  # ssd tier
        self._buffers: list[_Buffer] = []
        self._staged: dict[str, _Buffer] = {}
        self._dev: dict[str, _DeviceCopy] = {}
        self._seq = itertools.count()
        self._copy_stream = device.new_stream() if self._pin else None
        self._sums = SwapChecksums() if checksums else None

    @property
    def engine(self) -> IOEngine:
        """The SSD engine (opened on first use, in the swap directory)."""
        if self._engine is None:
            if self.swap is None:
                raise UserError("an ssd offload tier needs a swap directory; set one for this stage")
            self._engine = open_engine(str(self.swap.path), pin_memory=self._pin, max_in_flight=self.max_in_flight)
        return self._engine

    def layout(self, name: str) -> ChunkLayout:
        """The layout of chunk `name`."""
        return self._layouts[name]

    def __contains__(self, name: object) -> bool:
        return name in self._layouts

    def names(self) -> list[str]:
        """Chunk names in the order they were added."""
        return list(self._layouts)

    # ---- adding chunks -------------------------------------------------------------------------

    def add(self, name: str, tensors: torch.Tensor | Sequence[torch.Tensor], tier: str, *,
            dtype: torch.dtype | None = None, kind: str = "params") -> ChunkLayout:
        """Store a copy of `tensors` (cast to `dtype`) as chunk `name` with home `tier`.

        `kind` labels the device bytes in the budget when the chunk lives on or visits the device.
        """
        assert tier in TIERS, tier
        assert name not in self._layouts, f"chunk {name!r} already exists"
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        dtype = dtype or tensors[0].dtype
        numel = sum(t.numel() for t in tensors)
        stored = round_up(numel * dtype.itemsize, self.engine.alignment) if tier == "ssd" else numel * dtype.itemsize
        layout = ChunkLayout(name=name, tier=tier, dtype=dtype, shapes=tuple(tuple(t.shape) for t in tensors),
                             numel=numel, stored_bytes=stored)
        self._layouts[name], self._kinds[name] = layout, kind
        if tier == "device":
            self.budget.charge(layout.nbytes, kind)
            self._homes[name] = torch.empty(numel, dtype=dtype, device=self.device.torch_device)
            _fill(self._homes[name], tensors)
        elif tier == "cpu":
            self._homes[name] = self.device.pinned_empty((numel,), dtype)
            _fill(self._homes[name], tensors)
        else:
            self._files[name] = self._create_file(name, stored)
            buf = self._acquire(stored)
            _fill(_typed(buf.data, layout), tensors)
            self._submit_write(buf, name)
        return layout

    def add_empty(self, name: str, numel: int, dtype: torch.dtype, tier: str, *, kind: str = "params",
                  fill: float = 0.0) -> ChunkLayout:
        """A chunk of one flat tensor filled with `fill` (optimizer moments start at zero)."""
        return self.add(name, [torch.full((numel,), fill, dtype=dtype)], tier, kind=kind)

    # ---- borrowing copies ----------------------------------------------------------------------

    def prefetch(self, name: str, *, to: str = "device") -> None:
        """Start moving chunk `name` towards `to` (`device`, or `host` for `host()`) without waiting."""
        assert to in ("device", "host"), to
        layout = self._layouts[name]
        if layout.tier == "device" or name in self._dev:
            return
        if layout.tier == "ssd":
            self._stage(name)
        elif to == "device" and not self._alias:
            self._to_device(name, self._homes[name])

    def get(self, name: str) -> torch.Tensor:
        """The chunk's flat tensor on the device, ready for use on the current stream."""
        layout = self._layouts[name]
        if layout.tier == "device":
            return self._homes[name]
        if name not in self._dev:
            if layout.tier == "ssd":
                buf = self._stage(name)
                self._finish(buf)
                if self._alias:  # the buffer stays staged (borrowed) until release
                    self._borrow(name, _typed(buf.data, layout))
                else:
                    self._to_device(name, _typed(buf.data, layout), staging=buf)
            elif self._alias:
                self._borrow(name, self._homes[name])
            else:
                self._to_device(name, self._homes[name])
        copy = self._dev[name]
        if copy.event is not None:
            copy.event.wait()  # the current stream waits for the copy stream
        return copy.tensor

    def host(self, name: str) -> torch.Tensor:
        """The chunk's flat tensor in host memory, for in-place CPU work (`write_back` stores it)."""
        layout = self._layouts[name]
        assert layout.tier != "device", f"chunk {name!r} lives on the device; use get()"
        if layout.tier == "cpu":
            return self._homes[name]
        buf = self._stage(name)
        self._finish(buf)
        return _typed(buf.data, layout)

    def release(self, name: str) -> None:
        """Drop the borrowed device copy and staging buffer of `name` without storing anything."""
        copy = self._dev.pop(name, None)
        if copy is not None:
            if copy.event is not None:
                copy.event.synchronize()  # never free memory a copy may still write
            self.budget.release(copy.tensor.numel() * copy.tensor.element_size(), copy.kind)
        buf = self._staged.pop(name, None)
        if buf is not None:
            self._finish(buf)  # a read may still be filling it
            buf.owner = None

    def write_back(self, name: str) -> None:
        """Store the borrowed copy (the device copy if there is one, else the host copy) in the home tier.

        The device copy stays borrowed; an SSD write is asynchronous and frees its buffer when done.
        """
        layout = self._layouts[name]
        if layout.tier == "device":
            return
        copy = self._dev.get(name)
        if layout.tier == "cpu":
            if copy is not None and copy.tensor is not self._homes[name]:
                self._homes[name].copy_(copy.tensor)
            return
        buf = self._staged.pop(name, None)
        if copy is not None and self._alias and buf is not None:
            self._staged[name] = buf  # it is the borrowed device copy: write from another buffer
            buf = None
        if copy is not None:
            if buf is None:
                buf = self._acquire(layout.stored_bytes)
            self._finish(buf)
            _typed(buf.data, layout).copy_(copy.tensor)
        assert buf is not None, f"chunk {name!r} has no borrowed copy to write back"
        self._submit_write(buf, name)

    def write_slice(self, name: str, offset: int, src: torch.Tensor) -> None:
        """Overwrite elements `[offset, offset + src.numel())` of the home copy of `name` with `src`.

        On SSD, `offset` must fall on an I/O-aligned byte and the slice must end aligned or at the
        chunk's end. The chunk must not be borrowed (its copy would go stale).
        """
        layout = self._layouts[name]
        assert name not in self._dev and name not in self._staged, f"chunk {name!r} is borrowed"
        assert 0 <= offset and offset + src.numel() <= layout.numel, (offset, src.numel(), layout.numel)
        src = src.reshape(-1)
        if layout.tier != "ssd":
            self._homes[name][offset:offset + src.numel()].copy_(src)
            return
        start = offset * layout.dtype.itemsize
        end = (offset + src.numel()) * layout.dtype.itemsize
        align = self.engine.alignment
        assert start % align == 0 and (end % align == 0 or offset + src.numel() == layout.numel), (start, end)
        size = round_up(end - start, align)
        buf = self._acquire(size)
        buf.data[:end - start].view(layout.dtype).copy_(src)
        self._submit_write(buf, name, offset=start, size=size)

    def unflatten(self, name: str, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` (a copy of chunk `name`) with the original shapes."""
        return self._layouts[name].split(flat)

    # ---- lifetime ------------------------------------------------------------------------------

    def wait_all(self) -> None:
        """Wait for every outstanding read, write and copy."""
        for buf in self._buffers:
            self._finish(buf)
        for copy in self._dev.values():
            if copy.event is not None:
                copy.event.synchronize()

    def close(self) -> None:
        """Wait for everything, free device memory and delete this store's swap files."""
        try:
            self.wait_all()
        finally:
            for name in list(self._dev):
                self.release(name)
            for name, home in self._homes.items():
                if self._layouts[name].tier == "device":
                    self.budget.release(home.numel() * home.element_size(), self._kinds[name])
            self._homes.clear()
            for path in self._files.values():
                if os.path.exists(path):
                    os.unlink(path)
                if self._sums is not None:
                    self._sums.forget(path)
            self._files.clear()
            self._buffers.clear()
            if self._sums is not None:
                self._sums.close()
            if self._own_engine and self._engine is not None:
                self._engine.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------

    def _create_file(self, name: str, nbytes: int) -> str:
        assert self.swap is not None
        path = self.swap.file(name)
        self.swap.reserve(nbytes)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # claim the blocks now: a full disk fails here, not mid-step
        except OSError as exc:
            raise UserError(f"cannot allocate {nbytes} bytes for swap file {path}: {exc}") from exc
        finally:
            os.close(fd)
        if self._sums is not None:
            self._sums.track(path, nbytes)
        return path

    def _stage(self, name: str) -> _Buffer:
        """The staging buffer holding (or reading) chunk `name`; starts the read if needed."""
        buf = self._staged.get(name)
        if buf is None:
            layout = self._layouts[name]
            self._wait_writes(name, 0, layout.stored_bytes)  # never read what is still being written
            buf = self._acquire(layout.stored_bytes)
            buf.owner = name
            self._staged[name] = buf
            self._count_in_flight()
            with self._swap_io():
                buf.request = self.engine.read(buf.data[:layout.stored_bytes], self._files[name])
            buf.seq = next(self._seq)
            buf.verify = name if self._sums is not None else None
            self.stats.bytes_read += layout.stored_bytes
        return buf

    def _submit_write(self, buf: _Buffer, name: str, *, offset: int = 0, size: int | None = None) -> None:
        size = self._layouts[name].stored_bytes if size is None else size
        path = self._files[name]
        if self._sums is None:
            self._wait_writes(name, offset, offset + size)  # overlapping writes could land in either order
        else:  # the whole blocks: a block written in part is re-read to update its checksum
            self._wait_writes(name, *self._sums.span(path, offset, offset + size))
            buf.pending = self._sums.record(path, offset, buf.data[:size].numpy(), label=name)
        buf.owner, buf.target, buf.span = None, name, (offset, offset + size)
        self._count_in_flight()
        with self._swap_io():
            buf.request = self.engine.write(buf.data[:size], path, offset)
        buf.seq = next(self._seq)
        self.stats.bytes_written += size

    def _wait_writes(self, name: str, start: int, end: int) -> None:
        """Finish pending writes to bytes `[start, end)` of chunk `name`'s file."""
        for buf in self._buffers:
            if buf.request is not None and buf.target == name and buf.span[0] < end and start < buf.span[1]:
                self._finish(buf)

    def _count_in_flight(self) -> None:
        busy = 1 + sum(1 for b in self._buffers if b.request is not None and not b.request.done())
        assert busy <= self.max_in_flight, f"{busy} transfers in flight, at most {self.max_in_flight} allowed"
        self.stats.max_in_flight = max(self.stats.max_in_flight, busy)

    def _finish(self, buf: _Buffer) -> None:
        """Wait for the buffer's transfer and copy (re-raises an I/O error); check what a read brought."""
        if buf.request is not None:
            request, buf.request, buf.target = buf.request, None, None
            name, buf.verify = buf.verify, None
            with self._swap_io():
                request.wait()
            if name is not None:
                stored = self._layouts[name].stored_bytes
                self._sums.verify(self._files[name], 0, buf.data[:stored].numpy(), label=name)
        if buf.pending is not None:
            pending, buf.pending = buf.pending, None
            self._sums.settle(pending)
        if buf.event is not None:
            event, buf.event = buf.event, None
            event.synchronize()

    @contextlib.contextmanager
    def _swap_io(self) -> Iterator[None]:
        """A swap file that is gone (its directory removed under the running job) is one clear `UserError`."""
        try:
            yield
        except FileNotFoundError as error:
            raise self._swap_lost(error) from None

    def _swap_lost(self, error: FileNotFoundError) -> UserError:
        where = self.swap.path if self.swap is not None else "the swap directory"
        return UserError(f"swap file {error.filename or '?'} is gone: {where} was removed while the run used it "
                         "(a temporary-files cleaner?), and the offloaded state in it with it. Put train.offload_dir "
                         "(or $HETEROFLOW_SWAP_DIR) where nothing deletes files during a run, and continue from the "
                         "newest checkpoint with --resume")

    def _acquire(self, nbytes: int) -> _Buffer:
        """A free staging buffer of at least `nbytes`; waits for the oldest write when all are busy."""
        if nbytes > self.buffer_bytes:
            self.buffer_bytes = nbytes  # sized by the largest chunk; smaller idle buffers get replaced
        while True:
            for buf in self._buffers:
                if buf.owner is None and (buf.request is None or buf.request.done()):
                    self._finish(buf)
                    if buf.data.numel() >= nbytes:
                        return buf
                    self._buffers.remove(buf)
                    break
            else:
                if len(self._buffers) < self.max_in_flight:
                    buf = _Buffer(self.engine.alloc(self.buffer_bytes))
                    self._buffers.append(buf)
                    self.stats.max_buffers = max(self.stats.max_buffers, len(self._buffers))
                    return buf
                writes = [b for b in self._buffers if b.owner is None and b.request is not None]
                if not writes:
                    raise RuntimeError(f"all {self.max_in_flight} staging buffers hold borrowed chunks "
                                       f"{sorted(self._staged)}; release one before fetching another")
                self._finish(min(writes, key=lambda b: b.seq))

    def _borrow(self, name: str, host_flat: torch.Tensor) -> None:
        """On a CPU device: lend the host copy itself as the device copy (charged, not copied)."""
        layout, kind = self._layouts[name], self._kinds[name]
        self.budget.charge(layout.nbytes, kind)
        self._dev[name] = _DeviceCopy(host_flat, None, kind)

    def _to_device(self, name: str, host_flat: torch.Tensor, staging: _Buffer | None = None) -> None:
        """Copy a host flat tensor to a new device tensor (charged to the budget first)."""
        layout, kind = self._layouts[name], self._kinds[name]
        self.budget.charge(layout.nbytes, kind)
        tensor = torch.empty(layout.numel, dtype=layout.dtype, device=self.device.torch_device)
        event = None
        if self._copy_stream is None:
            tensor.copy_(host_flat)
        else:
            ready = self.device.new_event()
            ready.record()  # on the current stream: the new tensor's memory may still be in use there
            with self.device.stream_context(self._copy_stream):
                self._copy_stream.wait_event(ready)
                tensor.copy_(host_flat, non_blocking=True)
                event = self.device.new_event()
                event.record(self._copy_stream)
        self._dev[name] = _DeviceCopy(tensor, event, kind)
        if staging is not None:  # the staging buffer is free once the copy has read it
            self._staged.pop(name, None)
            staging.owner, staging.event = None, event


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _typed(data: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The first `layout.numel` elements of a uint8 buffer, viewed as the chunk's dtype."""
    return data[:layout.nbytes].view(layout.dtype)


def _fill(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    start = 0
    for t in tensors:
        n = t.numel()
        flat[start:start + n].copy_(t.detach().reshape(-1))
        start += n
