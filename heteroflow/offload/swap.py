"""`SwapDir`: the scratch directory that holds one process's SSD-tier files.

Swap files are scratch, never checkpoints, and the code keeps the two apart:

- each process gets its own directory `<swap_root>/heteroflow-swap-<pid>-[<label>-]<uuid>/` with a marker
  file saying it is scratch; only a directory carrying that marker is ever deleted. Ranks on one node (tp or
  dp ranks of a stage, several stages) therefore never share a swap file; the label (the runtime's
  `s<stage>-dp<i>-cp<k>-tp<j>`) says whose directory it is;
- a swap root inside a checkpoint directory, or inside a directory marked as a checkpoint
  (heteroflow's, Megatron's or DeepSpeed's marker files), is refused;
- free disk space is checked before anything is written, with an error naming the path and numbers;
- the directory is removed on normal exit, on an exception (context manager), at interpreter exit
  (atexit) and on SIGTERM; directories left by killed processes (SIGKILL) are swept on the next start.

`SwapChecksums` keeps a CRC-32 of every block of every swap file, taken from the bytes as they are
written and checked on every read: a swap file changed on disk (zeros, flipped bits) is a
`StateCorrupted` error naming the file and block, never training on garbage.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import shutil
import signal
import threading
import uuid
import zlib
from pathlib import Path
from typing import Iterable

from heteroflow.errors import StateCorrupted, UserError

SCRATCH_MARKER = "HETEROFLOW-SWAP-SCRATCH"
"""File inside every swap directory; its presence is what allows deleting the directory."""
SWAP_PREFIX = "heteroflow-swap-"
CHECKPOINT_MARKERS = ("heteroflow-checkpoint.json", "latest_checkpointed_iteration.txt", "zero_to_fp32.py")
"""Files that mark a checkpoint directory: heteroflow's (the runtime writes it), Megatron's, DeepSpeed's."""
DEFAULT_HEADROOM_BYTES = 1 << 30
"""Free space left over after the swap files, so the disk never fills up to the last byte."""

_live: dict[str, SwapDir] = {}  # process-wide, for the atexit and SIGTERM handlers
_live_lock = threading.Lock()
_handlers_installed = False


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class SwapDir:
    """One process's scratch directory under `swap_root`; use as a context manager or call `remove()`."""

    def __init__(self, swap_root: str | os.PathLike, *, checkpoint_dirs: Iterable[str | os.PathLike] = (),
                 headroom_bytes: int = DEFAULT_HEADROOM_BYTES, label: str = "") -> None:
        root = Path(swap_root).expanduser().resolve()
        check_not_checkpoint(root, checkpoint_dirs)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the offload swap root {root}: {exc}; pick a writable directory") from exc
        sweep_stale(root)
        self.root = root
        tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)
        # The pid comes first: `sweep_stale` reads it to tell a dead owner's directory from a live one.
        self.path = root / f"{SWAP_PREFIX}{os.getpid()}-{tag + '-' if tag else ''}{uuid.uuid4().hex[:12]}"
        self.path.mkdir(mode=0o700)
        (self.path / SCRATCH_MARKER).write_text(
            "Scratch swap files of a heteroflow training process (offloaded parameters and optimizer state).\n"
            "NOT a checkpoint: deleted when the process exits; safe to delete when that process is gone.\n"
            f"pid={os.getpid()}\n")
        self.headroom_bytes = headroom_bytes
        self.reserved_bytes = 0
        _register(self)

    def file(self, name: str) -> str:
        """Path of the swap file for chunk `name` (any string; made safe for a file name)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return str(self.path / f"{safe}-{uuid.uuid5(uuid.NAMESPACE_OID, name).hex[:8]}.swp")

    def check_free(self, nbytes: int) -> None:
        """Raise a UserError unless `nbytes` more (plus the headroom) fit on the disk."""
        free = shutil.disk_usage(self.path).free
        if nbytes + self.headroom_bytes > free:
            raise UserError(
                f"not enough free disk space for offload swap files in {self.root}: they need {_gib(nbytes)} "
                f"({nbytes} bytes) plus {_gib(self.headroom_bytes)} headroom, but only {_gib(free)} ({free} bytes) "
                "is available; free space there, point the swap directory to a larger disk, or keep this "
                "stage's state on cpu")

    def reserve(self, nbytes: int) -> None:
        """Account `nbytes` of new swap files, checking that they fit first."""
        self.check_free(nbytes)
        self.reserved_bytes += nbytes

    def remove(self) -> None:
        """Delete the directory and its files (idempotent); only ever a directory with our marker."""
        with _live_lock:
            _live.pop(str(self.path), None)
        _remove_scratch(self.path)

    def __enter__(self) -> SwapDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"SwapDir({self.path})"


SWAP_BLOCK_BYTES = 1 << 20
"""Checksum granularity: big enough that one CRC call per block costs nothing, small enough that a
partial write (not on this grid) re-reads little."""


class SwapChecksums:
    """CRC-32 (zlib's; see `heteroflow.checkpoint.files.CHECKSUM`) per `block_bytes` block of each swap file.

    `record` takes the bytes about to be written at an offset; a write that covers a block only in
    part first re-reads (and checks) the rest of that block from the file, so the caller must have
    finished earlier writes to it (`span` gives the byte range). The CRCs of whole blocks of a large
    write are computed in a helper thread while the write runs (zlib releases the GIL): `record`
    returns a pending result that `settle` stores, which the caller must do once the write is done and
    before the bytes are read or recorded again, keeping the buffer unchanged until then. `verify`
    checks bytes just read. Buffers are anything with the buffer protocol (a NumPy view of a tensor).
    """

    def __init__(self, block_bytes: int = SWAP_BLOCK_BYTES) -> None:
        assert block_bytes > 0
        self.block_bytes = block_bytes
        self._files: dict[str, tuple[int, list[int | None]]] = {}  # path -> (size, CRC per block; None: unwritten)
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None

    def track(self, path: str, nbytes: int) -> None:
        """Start keeping checksums of the swap file `path` of `nbytes` bytes (nothing written yet)."""
        self._files[path] = (nbytes, [None] * -(-nbytes // self.block_bytes))

    def forget(self, path: str) -> None:
        """Stop tracking `path` (deleted)."""
        self._files.pop(path, None)

    def span(self, path: str, start: int, end: int) -> tuple[int, int]:
        """The whole blocks holding bytes `[start, end)` of `path`, as a byte range."""
        size = self._files[path][0]
        block = self.block_bytes
        return start // block * block, min(size, -(-end // block) * block)

    def record(self, path: str, offset: int, data, *, label: str = "") -> tuple | None:
        """Take the checksums of `data`, about to be written at `offset` of `path`; returns what to `settle`."""
        size, sums = self._files[path]
        end = offset + len(data)
        assert 0 <= offset < end <= size, (path, offset, end, size)
        block = self.block_bytes
        view = memoryview(data).cast("B")
        whole = []
        for i in range(offset // block, -(-end // block)):
            lo, hi = i * block, min(size, (i + 1) * block)
            a, b = max(lo, offset), min(hi, end)
            if a == lo and b == hi:
                whole.append((i, view[a - offset:b - offset]))
                continue
            old = self._read(path, lo, hi)  # a partial block: the rest of it comes from the file
            if sums[i] is not None:
                self._check(path, i, lo, hi, old, label)
            crc = zlib.crc32(old[:a - lo])
            crc = zlib.crc32(view[a - offset:b - offset], crc)
            sums[i] = zlib.crc32(old[b - lo:], crc)
        if len(whole) < 4:  # small: not worth a thread hop
            for i, part in whole:
                sums[i] = zlib.crc32(part)
            return None
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="heteroflow-crc")
        return path, self._helper.submit(lambda: [(i, zlib.crc32(part)) for i, part in whole])

    def settle(self, pending: tuple | None) -> None:
        """Store the checksums `record` left computing (waits for them)."""
        if pending is None:
            return
        path, future = pending
        results = future.result()
        entry = self._files.get(path)
        if entry is not None:
            for i, crc in results:
                entry[1][i] = crc

    def close(self) -> None:
        """Stop the helper thread (after every pending result was settled or dropped)."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def verify(self, path: str, offset: int, data, *, label: str = "") -> None:
        """Check `data`, just read from `offset` of `path`, against the checksums of what was written there."""
        size, sums = self._files[path]
        end = offset + len(data)
        block = self.block_bytes
        assert offset % block == 0 and (end % block == 0 or end == size), (offset, end, size)
        view = memoryview(data).cast("B")
        for i in range(offset // block, -(-end // block)):
            lo, hi = i * block, min(size, (i + 1) * block)
            if sums[i] is not None:
                self._check(path, i, lo, hi, view[lo - offset:hi - offset], label)

    def _check(self, path: str, i: int, lo: int, hi: int, data, label: str) -> None:
        expected, found = self._files[path][1][i], zlib.crc32(data)
        if found != expected:
            what = f" (chunk {label!r})" if label else ""
            raise StateCorrupted(
                f"swap file {path}{what}: block {i} (bytes {lo}-{hi}) fails its checksum (crc32 {expected:08x} "
                f"written, {found:08x} read back): the file was changed or damaged on disk after heteroflow wrote "
                "it, so the training state in it is lost. Restart from the last checkpoint (`heteroflow train "
                "--resume`, or by itself under --max-restarts), and check the disk that holds the swap directory")

    @staticmethod
    def _read(path: str, lo: int, hi: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, hi - lo, lo)
        finally:
            os.close(fd)


def check_not_checkpoint(root: Path, checkpoint_dirs: Iterable[str | os.PathLike]) -> None:
    """Refuse a swap root inside a checkpoint directory, or inside one carrying a checkpoint marker."""
    for ckpt in checkpoint_dirs:
        ckpt_path = Path(ckpt).expanduser().resolve()
        if root == ckpt_path or ckpt_path in root.parents:
            raise UserError(f"offload swap directory {root} is inside the checkpoint directory {ckpt_path}; swap "
                            "files are scratch and must never mix with checkpoints: choose a swap directory "
                            "outside it")
    for directory in (root, *root.parents):
        for marker in CHECKPOINT_MARKERS:
            if (directory / marker).is_file():
                raise UserError(f"offload swap directory {root} is inside {directory}, which holds {marker} and so "
                                "is a checkpoint; choose a swap directory outside any checkpoint")


def sweep_stale(root: Path) -> list[Path]:
    """Remove swap directories under `root` left by processes of this host that no longer exist."""
    removed = []
    for entry in root.glob(f"{SWAP_PREFIX}*"):
        pid_text = entry.name[len(SWAP_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _pid_alive(int(pid_text)):
            continue
        if _remove_scratch(entry):
            removed.append(entry)
    return removed


def live_swap_dirs() -> list[Path]:
    """Swap directories this process has open (for tests and diagnostics)."""
    with _live_lock:
        return [d.path for d in _live.values()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove_scratch(path: Path) -> bool:
    """rmtree `path` only if it is a directory carrying our scratch marker."""
    if not (path / SCRATCH_MARKER).is_file():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _remove_all() -> None:
    with _live_lock:
        dirs = list(_live.values())
    for d in dirs:
        d.remove()


def _on_sigterm(signum: int, frame: object) -> None:
    _remove_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # Default action: die by SIGTERM as if we had never caught it (the parent sees the same status).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


_previous_sigterm: object = signal.SIG_DFL


def _register(swap: SwapDir) -> None:
    global _handlers_installed, _previous_sigterm
    with _live_lock:
        _live[str(swap.path)] = swap
        if _handlers_installed:
            return
        _handlers_installed = True
    atexit.register(_remove_all)
    # Signal handlers can only be set from the main thread; elsewhere atexit and `with` still clean up.
    if threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
