"""`Device`: the one place the rest of heteroflow asks about and drives an accelerator.

CUDA and ROCm both go through `torch.cuda` (ROCm builds of torch reuse the `cuda` device type), Ascend
through `torch.npu` (registered by torch_npu), and the CPU through no-op stand-ins with the same
interface, so runtime code never branches on the vendor. An *emulated* device runs on the CPU with gloo
but keeps its vendor label, so one machine can rehearse a mixed cluster.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from heteroflow.config.catalog import CATALOG
from heteroflow.config.device import VENDORS
from heteroflow.errors import UserError, did_you_mean

if TYPE_CHECKING:
    import torch

    from heteroflow.devices.probe import LocalDevice

_BACKENDS = {"nvidia": "nccl", "amd": "nccl", "hygon": "nccl", "ascend": "hccl", "cpu": "gloo"}


def collective_backend(vendor: str) -> str:
    """The torch.distributed backend for a vendor: nccl (CUDA and ROCm's RCCL), hccl, or gloo."""
    _check_vendor(vendor)
    return _BACKENDS[vendor]


_VISIBLE_DEVICES = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES", "hygon": "HIP_VISIBLE_DEVICES",
                    "ascend": "ASCEND_RT_VISIBLE_DEVICES", "cpu": None}


def visible_devices_variable(vendor: str) -> str | None:
    """The environment variable that limits which of a vendor's devices a process sees (None for cpu)."""
    _check_vendor(vendor)
    return _VISIBLE_DEVICES[vendor]


def compute_capability_major(torch_device: torch.device) -> int | None:
    """The major compute capability of a `cuda` torch device (CUDA, or ROCm's architecture as torch reports it),
    for code that picks a kernel from a tensor's device; None for any other device type."""
    if torch_device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.get_device_capability(torch_device)[0])


def emulated(vendor: str, index: int = 0) -> Device:
    """A CPU device labelled `vendor`, for running a mixed cluster as local CPU processes."""
    return Device.for_vendor(vendor, index, emulate=True)


@dataclass(frozen=True, slots=True)
class Device:
    """One local device, by vendor and local index; stateless, so cheap to build and pass around."""

    vendor_label: str
    """The cluster's vendor for this rank (`ascend`), kept when the rank is emulated on the CPU."""
    index: int = 0
    """Local index within the vendor's runtime."""
    emulated: bool = False
    """Run on the CPU with gloo whatever `vendor_label` says (a `cpu` device runs there anyway)."""

    def __post_init__(self) -> None:
        _check_vendor(self.vendor_label)
        if self.index < 0:
            raise UserError(f"device index must be >= 0, got {self.index}")

    @classmethod
    def for_vendor(cls, vendor: str, index: int = 0, *, emulate: bool = False) -> Device:
        """The device `index` of `vendor`'s runtime here, or a CPU stand-in for it when `emulate`."""
        return cls(vendor_label=vendor, index=index, emulated=emulate)

    @classmethod
    def from_local(cls, local: LocalDevice, *, emulate: bool = False) -> Device:
        """The device a probe result describes (`probe_local_devices()[i]`)."""
        return cls(vendor_label=local.vendor, index=local.index, emulated=emulate)

    @classmethod
    def cpu(cls) -> Device:
        """The host CPU."""
        return cls(vendor_label="cpu", index=0)

    @property
    def kind(self) -> str:
        """torch device type actually used: `cuda` (CUDA and ROCm), `npu` or `cpu`."""
        if self.emulated or self.vendor_label == "cpu":
            return "cpu"
        return "npu" if self.vendor_label == "ascend" else "cuda"

    @property
    def torch_device_str(self) -> str:
        """`cuda:0`, `npu:1` or `cpu`; available without the vendor's runtime installed."""
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """The `torch.device` to put tensors on."""
        import torch

        if self.kind == "npu":
            self._runtime()  # torch.device('npu:0') only parses once torch_npu registered 'npu'
        return torch.device(self.torch_device_str)

    @property
    def collective_backend(self) -> str:
        """Backend for this rank's process groups; gloo when emulated."""
        return "gloo" if self.kind == "cpu" else collective_backend(self.vendor_label)

    @property
    def supports_bf16(self) -> bool:
        """Whether the hardware has bf16 math (CPU: True, torch has bf16 kernels for it)."""
        if self.kind == "cpu":
            return True
        runtime = self._runtime()
        if self.vendor_label == "nvidia":
            return runtime.get_device_properties(self.index).major >= 8  # Ampere and later
        # ROCm and Ascend report no capability flag we trust (torch says True for every ROCm
        # device); the catalog knows which chips lack bf16 units (Z100, K100, 910A).
        from heteroflow.devices.probe import match_catalog_name

        matched = match_catalog_name(self.vendor_label, str(runtime.get_device_name(self.index)))
        if matched is not None:
            return CATALOG[matched].tflops_bf16 is not None
        probe = getattr(runtime, "is_bf16_supported", None)
        return bool(probe()) if probe is not None else False

    @property
    def available(self) -> bool:
        """Whether this device is here: its runtime is installed and sees index `index` (the CPU always is).

        Unlike every other call, never raises: for code that adapts to the machine rather than requiring it.
        """
        if self.kind == "cpu":
            return True
        try:
            self._runtime()
        except UserError:
            return False
        return True

    def set_current(self) -> None:
        """Make this the current device of its runtime (checks that it exists)."""
        if self.kind != "cpu":
            self._runtime().set_device(self.index)

    def synchronize(self) -> None:
        """Wait for all queued work on this device (CPU work is already done)."""
        if self.kind != "cpu":
            self._runtime().synchronize(self.index)

    def memory_allocated_bytes(self) -> int:
        """Bytes held by tensors on the device.

        CPU: the whole process's resident memory (RSS), an upper bound on tensor memory; torch keeps
        no per-tensor counter for CPU allocations.
        """
        if self.kind == "cpu":
            return _rss_bytes()
        return int(self._runtime().memory_allocated(self.index))

    def max_memory_allocated_bytes(self) -> int:
        """Peak of `memory_allocated_bytes` since the last `reset_peak_memory` (CPU: peak RSS)."""
        if self.kind == "cpu":
            return max(_peak_rss_bytes(), _rss_bytes())
        return int(self._runtime().max_memory_allocated(self.index))

    def reset_peak_memory(self) -> None:
        """Start a new peak measurement.

        CPU: resets the kernel's peak-RSS counter (Linux /proc/self/clear_refs); where that is not
        possible the peak stays the peak since process start.
        """
        if self.kind == "cpu":
            with contextlib.suppress(OSError):
                with open("/proc/self/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")
            return
        self._runtime().reset_peak_memory_stats(self.index)

    def total_memory_bytes(self) -> int:
        """Device memory capacity (CPU: host RAM, shared by every rank on the host)."""
        if self.kind == "cpu":
            import psutil

            return int(psutil.virtual_memory().total)
        return int(self._runtime().get_device_properties(self.index).total_memory)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, page-locked for fast async copies to this device (CPU: plain)."""
        import torch

        if self.kind == "cpu":
            return torch.empty(tuple(shape), dtype=dtype)
        self._runtime()
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def new_stream(self) -> Any:
        """A new side stream (CPU: a stand-in whose operations do nothing)."""
        if self.kind == "cpu":
            return NullStream()
        return self._runtime().Stream(device=self.torch_device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        """`with device.stream_context(s):` queues the enclosed work on `s`."""
        if self.kind == "cpu":
            return contextlib.nullcontext(stream)
        return self._runtime().stream(stream)

    def new_event(self, enable_timing: bool = False) -> Any:
        """A new event (CPU: a stand-in that records wall time, since CPU work is synchronous)."""
        if self.kind == "cpu":
            return NullEvent()
        return self._runtime().Event(enable_timing=enable_timing)

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator and this device's generator."""
        import torch

        torch.manual_seed(seed)  # covers CUDA/ROCm generators too
        if self.kind != "cpu":  # torch_npu releases differ on whether the line above reaches NPUs
            self._runtime().manual_seed_all(seed)

    def _runtime(self) -> Any:
        """`torch.cuda` or `torch.npu` for this device; a UserError saying what is missing otherwise.

        Checked on every call (cheap: torch caches the device count) so a wrong index or torch build
        is a clear message, not an assertion deep inside torch.
        """
        import torch

        assert self.kind != "cpu", "the CPU has no device runtime"
        if self.kind == "npu":
            from heteroflow.devices.probe import import_torch_npu

            if import_torch_npu() is None or not hasattr(torch, "npu"):
                raise UserError(f"{self}: torch_npu is not installed or does not import here; "
                                "install the ascend extra or run with --emulate")
            runtime = torch.npu
        else:
            hip = getattr(torch.version, "hip", None)
            if self.vendor_label == "nvidia" and hip is not None:
                raise UserError(f"{self}: this torch is a ROCm build; an NVIDIA device needs a CUDA build")
            if self.vendor_label in ("amd", "hygon") and hip is None:
                raise UserError(f"{self}: this torch is not a ROCm build; "
                                f"{self.vendor_label} needs a ROCm/DTK build of torch")
            runtime = torch.cuda
        count = runtime.device_count() if runtime.is_available() else 0
        if self.index >= count:
            raise UserError(f"{self}: only {count} {self.kind} device(s) visible here; check "
                            "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES "
                            "or run with --emulate")
        return runtime

    def __str__(self) -> str:
        suffix = " (emulated on cpu)" if self.emulated and self.vendor_label != "cpu" else ""
        index = "" if self.vendor_label == "cpu" else f":{self.index}"
        return f"{self.vendor_label}{index}{suffix}"


class NullStream:
    """Stream stand-in for the CPU: every operation is a no-op, and it works in `with`."""

    def wait_stream(self, stream: Any) -> None:
        """No-op: CPU work is already ordered."""

    def wait_event(self, event: Any) -> None:
        """No-op: CPU work is already ordered."""

    def record_event(self, event: NullEvent | None = None) -> NullEvent:
        """Record `event` (or a new one) now."""
        event = event if event is not None else NullEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """No-op: nothing is queued."""

    def query(self) -> bool:
        """Always True: nothing is pending."""
        return True

    def __enter__(self) -> NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class NullEvent:
    """Event stand-in for the CPU; `elapsed_time` is real wall time between two records."""

    def __init__(self) -> None:
        self._recorded_s: float | None = None

    def record(self, stream: Any = None) -> None:
        """Note the current time."""
        self._recorded_s = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """No-op: CPU work is already ordered."""

    def synchronize(self) -> None:
        """No-op: nothing is pending."""

    def query(self) -> bool:
        """Always True: nothing is pending."""
        return True

    def elapsed_time(self, end: NullEvent) -> float:
        """Milliseconds from this event's record to `end`'s, like `torch.cuda.Event.elapsed_time`."""
        if self._recorded_s is None or end._recorded_s is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._recorded_s - self._recorded_s) * 1000.0


def _check_vendor(vendor: str) -> None:
    if vendor not in VENDORS:
        raise UserError(f"unknown vendor {vendor!r}{did_you_mean(vendor, VENDORS)}; "
                        f"expected one of {', '.join(VENDORS)}")


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _peak_rss_bytes() -> int:
    """VmHWM from /proc (resettable); elsewhere ru_maxrss (peak since process start)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            found = re.search(r"^VmHWM:\s+(\d+)\s+kB", status.read(), re.MULTILINE)
        if found:
            return int(found.group(1)) * 1024
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
