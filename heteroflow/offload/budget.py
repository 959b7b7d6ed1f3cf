"""`DeviceBudget`: exact bookkeeping of the device bytes the offload code keeps resident.

Every device tensor the offload package creates (fetched parameters, gradients waiting to leave,
device-tier state, device-tier activations) is charged before it is allocated and released when it
is dropped, so `resident_bytes` is exact and an overrun raises before the allocation happens. On
CUDA the caching allocator's peak is an independent check (`check_allocator`); on CPU emulation the
process RSS says nothing about one rank's "device", so the bookkeeping is the measure.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from heteroflow.devices import Device


class DeviceBudgetExceeded(RuntimeError):
    """Resident device bytes would pass the rank's budget."""


class DeviceBudget:
    """Resident device bytes by category, never above `limit_bytes` (None: track without a limit)."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.by_kind: dict[str, int] = {}
        self.peak_by_kind: dict[str, int] = {}
        """The most bytes of each kind resident at once (each kind's own peak, not at `peak_bytes`' moment)."""
        self._lock = threading.Lock()  # hooks may run on autograd's worker thread

    def charge(self, nbytes: int, kind: str) -> None:
        """Account `nbytes` more of `kind` (params, grads, optimizer, activations, ...) or raise."""
        with self._lock:
            after = self.resident_bytes + nbytes
            if self.limit_bytes is not None and after > self.limit_bytes:
                raise DeviceBudgetExceeded(
                    f"device budget exceeded: {kind} needs {nbytes} bytes with {self.resident_bytes} resident "
                    f"({self._breakdown()}), limit {self.limit_bytes} bytes")
            self.resident_bytes = after
            self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
            self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), self.by_kind[kind])
            self.peak_bytes = max(self.peak_bytes, after)

    def release(self, nbytes: int, kind: str) -> None:
        """Account `nbytes` of `kind` freed."""
        with self._lock:
            assert self.by_kind.get(kind, 0) >= nbytes, f"releasing {nbytes} {kind} bytes, {self.by_kind} held"
            self.resident_bytes -= nbytes
            self.by_kind[kind] -= nbytes

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current resident bytes."""
        with self._lock:
            self.peak_bytes = self.resident_bytes
            self.peak_by_kind = dict(self.by_kind)

    def check_allocator(self, device: Device, *, slack_bytes: int = 0) -> int | None:
        """On a real accelerator: assert the allocator's peak stayed within the limit (plus `slack_bytes`
        for what lives outside this bookkeeping, e.g. kernels' workspaces); returns the peak, or None on CPU.
        """
        if device.kind == "cpu":
            return None
        peak = device.max_memory_allocated_bytes()
        if self.limit_bytes is not None:
            assert peak <= self.limit_bytes + slack_bytes, (
                f"{device}: allocator peak {peak} bytes > budget {self.limit_bytes} + slack {slack_bytes}")
        return peak

    def _breakdown(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()) if v) or "nothing"

    def __repr__(self) -> str:
        return (f"DeviceBudget(limit={self.limit_bytes}, resident={self.resident_bytes}, peak={self.peak_bytes}, "
                f"{self._breakdown()})")
