"""SSD I/O engines: asynchronous reads and writes of aligned host buffers at file offsets.

Two implementations behind one interface (`IOEngine`):

- `DeepSpeedAIOEngine`: DeepSpeed's `async_io` op (libaio, O_DIRECT), JIT-built on first use.
- `ThreadPoolEngine`: a thread pool doing `os.preadv` / `os.pwritev` with O_DIRECT (buffered I/O
  where the file system refuses O_DIRECT, e.g. tmpfs), used when the op cannot be built.

`open_engine()` picks one and logs once per process which path runs; `engine.which` says it too.
Every transfer uses a buffer from `engine.alloc` (page-aligned; page-locked where the engine can)
and a size and file offset that are multiples of `engine.alignment`: O_DIRECT demands all three.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import logging
import os
import threading
from typing import Any, Callable

import torch

from heteroflow.errors import UserError
from heteroflow.offload.ops import load_deepspeed_op

log = logging.getLogger("heteroflow.offload")

ALIGN_BYTES = 4096
"""Buffer address, size and file-offset alignment: a page, a multiple of every logical block size."""

ENGINE_ENV = "HETEROFLOW_AIO"
"""`auto` (default), `deepspeed` (fail if the op cannot load) or `threads` (never try the op)."""

_logged: set[str] = set()  # log "which path runs" once per process, not once per store


def log_once(message: str) -> None:
    """Log `message` at INFO the first time it is seen in this process."""
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def round_up(nbytes: int, alignment: int = ALIGN_BYTES) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment


def aligned_empty(nbytes: int, *, pin_memory: bool = False, alignment: int = ALIGN_BYTES) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` whose address is a multiple of `alignment`.

    torch gives no alignment promise for CPU tensors, so over-allocate and slice; the slice keeps the
    whole allocation alive through its storage.
    """
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift:shift + nbytes]


class IORequest:
    """One submitted read or write; `wait()` blocks until it is complete and raises its error."""

    def __init__(self, waiter: Callable[[], None], poll: Callable[[], bool]) -> None:
        self._waiter, self._poll, self._done = waiter, poll, False

    def wait(self) -> None:
        """Block until the transfer finished; raises OSError when it failed."""
        if not self._done:
            self._done = True  # set first: a failed wait must not be waited again by cleanup code
            self._waiter()

    def done(self) -> bool:
        """Whether the transfer is complete (never blocks)."""
        return self._done or self._poll()


class IOEngine(abc.ABC):
    """Asynchronous transfer of aligned host buffers to and from files."""

    which: str
    """Which path runs: `deepspeed-aio`, `threads-odirect` or `threads-buffered`."""
    alignment: int
    """Sizes and file offsets must be multiples of this (a multiple of `ALIGN_BYTES`)."""

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 host buffer of `nbytes` (a multiple of `alignment`)."""

    @abc.abstractmethod
    def read(self, buf: torch.Tensor, path: str, offset: int = 0) -> IORequest:
        """Start reading `buf.numel()` bytes of `path` at `offset` into `buf`."""

    @abc.abstractmethod
    def write(self, buf: torch.Tensor, path: str, offset: int = 0) -> IORequest:
        """Start writing `buf` into `path` at `offset` (the file is created if missing)."""

    def close(self) -> None:
        """Release threads and buffers; outstanding requests must have been waited."""

    def _check(self, buf: torch.Tensor, offset: int) -> None:
        # Internal invariants: the store only ever hands aligned buffers, sizes and offsets.
        assert buf.dtype == torch.uint8 and buf.is_contiguous() and buf.device.type == "cpu", buf
        assert buf.data_ptr() % ALIGN_BYTES == 0, "I/O buffer is not page-aligned; use engine.alloc"
        assert buf.numel() % self.alignment == 0 and offset % self.alignment == 0, (buf.numel(), offset)

    @staticmethod
    def _check_readable(path: str, offset: int, nbytes: int) -> None:
        # DeepSpeed's op asserts (aborts the process) on a short file; turn that into an exception.
        size = os.stat(path).st_size
        if offset + nbytes > size:
            raise OSError(f"{path}: reading {nbytes} bytes at offset {offset} runs past the end ({size} bytes)")


class ThreadPoolEngine(IOEngine):
    """The fallback: a thread pool, each request split into blocks read or written in parallel."""

    def __init__(self, *, num_threads: int = 4, block_bytes: int = 8 << 20, direct: bool = True,
                 pin_memory: bool = False) -> None:
        assert block_bytes % ALIGN_BYTES == 0
        self.which = "threads-odirect" if direct else "threads-buffered"
        self.alignment = ALIGN_BYTES
        self._block_bytes = block_bytes
        self._flags = os.O_DIRECT if direct else 0
        self._pin = pin_memory
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="heteroflow-io")

    def alloc(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pin_memory=self._pin)

    def read(self, buf: torch.Tensor, path: str, offset: int = 0) -> IORequest:
        self._check(buf, offset)
        self._check_readable(path, offset, buf.numel())
        return self._submit(buf, path, offset, read=True)

    def write(self, buf: torch.Tensor, path: str, offset: int = 0) -> IORequest:
        self._check(buf, offset)
        return self._submit(buf, path, offset, read=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _submit(self, buf: torch.Tensor, path: str, offset: int, *, read: bool) -> IORequest:
        view = memoryview(buf.numpy())
        step = self._block_bytes
        futures = [self._pool.submit(self._transfer, view[start:start + step], path, offset + start, read)
                   for start in range(0, buf.numel(), step)]

        def wait() -> None:
            for future in futures:
                future.result()

        return IORequest(wait, lambda: all(f.done() for f in futures))

    def _transfer(self, view: memoryview, path: str, offset: int, read: bool) -> None:
        # One fd per block: open is cheap next to a multi-megabyte transfer, and it keeps no shared
        # fd state between threads or after the request.
        flags = (os.O_RDONLY if read else os.O_WRONLY | os.O_CREAT) | self._flags
        fd = os.open(path, flags, 0o600)
        try:
            done = 0
            while done < len(view):
                io = os.preadv if read else os.pwritev
                n = io(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{path}: {'read' if read else 'write'} stopped at offset {offset + done}")
                done += n
        finally:
            os.close(fd)


class DeepSpeedAIOEngine(IOEngine):
    """DeepSpeed's `async_io` op. A pool of handles, one per request in flight.

    A DeepSpeed handle's `wait()` waits for *all* its pending operations; one handle per request
    lets the store wait for exactly the transfer it needs while others continue.
    """

    def __init__(self, module: Any, *, num_handles: int = 4, block_bytes: int = 1 << 20, queue_depth: int = 32,
                 intra_op_parallelism: int = 2, pin_memory: bool = False) -> None:
        self.which = "deepspeed-aio"
        self.alignment = ALIGN_BYTES * intra_op_parallelism  # each thread's share must stay aligned
        self._module = module
        self._free = collections.deque(
            module.aio_handle(block_bytes, queue_depth, False, True, intra_op_parallelism) for _ in range(num_handles))
        self._busy: collections.deque = collections.deque()  # (handle, request) in submission order
        self._pin = pin_memory
        self._locked: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> torch.Tensor:
        if self._pin:  # torch-pinned (cudaHostAlloc) memory is page-aligned and used without a bounce
            return aligned_empty(nbytes, pin_memory=True)
        # Without a GPU runtime torch cannot pin; the op's own page-locked buffers avoid its bounce copy.
        # The op aborts the process when mlock fails, so check the limit here and say what to change.
        locked = sum(b.numel() for b in self._locked) + nbytes
        if locked > memlock_limit_bytes():
            raise UserError(f"offload I/O needs {locked} bytes of page-locked memory but RLIMIT_MEMLOCK allows "
                            f"{memlock_limit_bytes()}; raise `ulimit -l` or set {ENGINE_ENV}=threads")
        handle = self._free[0] if self._free else self._busy[0][0]
        buf = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        assert buf.data_ptr() % ALIGN_BYTES == 0
        self._locked.append(buf)
        return buf

    def read(self, buf: torch.Tensor, path: str, offset: int = 0) -> IORequest:
        self._check(buf, offset)
        self._check_readable(path, offset, buf.numel())
        return self._submit(lambda h: h.async_pread(buf, path, offset), path, "read")

    def write(self, buf: torch.Tensor, path: str, offset: int = 0) -> IORequest:
        self._check(buf, offset)
        return self._submit(lambda h: h.async_pwrite(buf, path, offset), path, "write")

    def close(self) -> None:
        while self._busy:
            self._busy[0][1].wait()
        if self._locked and self._free:
            for buf in self._locked:
                self._free[0].free_cpu_locked_tensor(buf)
        self._locked.clear()
        self._free.clear()

    def _submit(self, start: Callable[[Any], int], path: str, what: str) -> IORequest:
        while True:
            with self._lock:
                if self._free:
                    handle = self._free.popleft()
                    break
                oldest = self._busy[0][1]
            oldest.wait()  # more requests than handles: finish the oldest first
        if start(handle) != 0:
            self._free.append(handle)
            raise OSError(f"{path}: DeepSpeed async_io could not start the {what} (see its message above)")
        state = {"done": False}

        def wait() -> None:
            try:
                completed = handle.wait()
            finally:
                state["done"] = True
                with self._lock:
                    self._busy = collections.deque(b for b in self._busy if b[0] is not handle)
                    self._free.append(handle)
            if completed != 1:
                raise OSError(f"{path}: DeepSpeed async_io {what} completed {completed} operations, expected 1")

        request = IORequest(wait, lambda: state["done"])
        with self._lock:
            self._busy.append((handle, request))
        return request


_ds_status: tuple[Any, str] | None = None


def deepspeed_aio_module() -> tuple[Any, str]:
    """DeepSpeed's async_io op loaded (JIT-built the first time), or None and why it is unavailable."""
    global _ds_status
    if _ds_status is None:
        _ds_status = load_deepspeed_op("AsyncIOBuilder", missing_hint=" (install libaio-dev)")
    return _ds_status


def memlock_limit_bytes() -> float:
    """Bytes this process may mlock (infinite for root, whose CAP_IPC_LOCK ignores the limit)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY:
        return float("inf")
    return float(soft)


def odirect_supported(directory: str) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (tmpfs and some overlays refuse)."""
    probe = os.path.join(directory, f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def open_engine(directory: str, *, prefer: str | None = None, pin_memory: bool = False,
                max_in_flight: int = 4) -> IOEngine:
    """An I/O engine for files in `directory`: DeepSpeed's op when it loads, the thread pool otherwise.

    `prefer` (or the HETEROFLOW_AIO environment variable): `auto`, `deepspeed` or `threads`.
    """
    prefer = prefer or os.environ.get(ENGINE_ENV, "auto")
    if prefer not in ("auto", "deepspeed", "threads"):
        raise UserError(f"{ENGINE_ENV}={prefer!r}: expected auto, deepspeed or threads")
    direct = odirect_supported(directory)
    reason = f"{directory} does not support O_DIRECT" if not direct else "HETEROFLOW_AIO=threads"
    if prefer != "threads" and direct and not pin_memory and memlock_limit_bytes() < (1 << 30):
        reason = f"RLIMIT_MEMLOCK is {int(memlock_limit_bytes())} bytes, too little for DeepSpeed's locked buffers"
    elif prefer != "threads" and direct:
        module, reason = deepspeed_aio_module()
        if module is not None:
            engine = DeepSpeedAIOEngine(module, num_handles=max_in_flight, pin_memory=pin_memory)
            log_once("offload I/O: DeepSpeed async_io (libaio, O_DIRECT)")
            return engine
    if prefer == "deepspeed":
        raise UserError(f"{ENGINE_ENV}=deepspeed but the op cannot be used: {reason}")
    engine = ThreadPoolEngine(direct=direct, pin_memory=pin_memory, num_threads=max(2, max_in_flight))
    log_once(f"offload I/O: thread pool with {'O_DIRECT' if direct else 'buffered I/O'} ({reason})")
    return engine
