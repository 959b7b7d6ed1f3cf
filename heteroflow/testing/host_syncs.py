"""Count, on CPU, the host syncs a training step would make on an accelerator (tests).

On CPU nothing waits, so `HostSyncs` counts the operations that make the host wait for the device when tensors
live on one: reading a device tensor's value (`.item()`, `.tolist()`, `float()`, `int()`, `bool()`, `.numpy()`),
copying it to the host (`.cpu()`), copying a host tensor to the device without `non_blocking` (torch then
synchronizes the stream), and `Device.synchronize`. Which tensors are the device's comes from the strict
stand-ins' host tags (`heteroflow.testing.strict`): `count_rank` runs one rank of the real path on them
(`HETEROFLOW_STRICT_BACKENDS=1`, accelerator stages) and returns its result with the syncs of each step, each
named by the heteroflow line that made it.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from heteroflow.testing.strict import _device_argument, is_host

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.numpy}
_PACKAGE = str(Path(__file__).resolve().parents[1])
_HERE = str(Path(__file__).resolve())


def _caller() -> str:
    """The innermost heteroflow line outside this module (`runtime/worker.py:244`)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_PACKAGE) and frame.filename != _HERE:
            return f"{Path(frame.filename).relative_to(_PACKAGE).as_posix()}:{frame.lineno}"
    return "?"


class HostSyncs(TorchFunctionMode):
    """Records each would-be host sync in the current step's list (`steps[step]`); none before the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, list[str]] = {}
        self._step: int | None = None

    def begin(self, step: int) -> None:
        self._step = step
        self.steps[step] = []

    def record(self, what: str) -> None:
        if self._step is not None:
            self.steps[self._step].append(f"{what} at {_caller()}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None:
            if func in _READS and not is_host(first):
                self.record(func.__name__)
            elif func is torch.Tensor.cpu and not is_host(first):
                self.record("cpu")
            elif (func is torch.Tensor.to and is_host(first) and not kwargs.get("non_blocking")
                  and _device_argument(args[1:], kwargs) is not None):
                self.record("to(device)")
        return func(*args, **kwargs)


def count_rank(rank: int, world_size: int, args):
    """One rank of `run_ranks`: the training worker with its host syncs counted; (its result, syncs by step)."""
    from heteroflow.devices.facade import Device
    from heteroflow.runtime import watchdog
    from heteroflow.runtime.worker import run_worker
    from heteroflow.testing import strict

    counter = HostSyncs()
    install, begin, synchronize = strict.install, watchdog.StepWatchdog.begin, Device.synchronize

    def install_and_count(vendor_backend: str):
        standins = install(vendor_backend)
        counter.__enter__()  # inside the host tags: they are set when the counter looks
        return standins

    def begin_step(self, step: int) -> None:
        counter.begin(step)
        begin(self, step)

    def count_synchronize(self) -> None:
        counter.record("Device.synchronize")
        synchronize(self)

    strict.install = install_and_count
    watchdog.StepWatchdog.begin = begin_step
    Device.synchronize = count_synchronize
    return run_worker(args), counter.steps
