"""Activation tier: tensors autograd saves for backward stay on the device or move to pinned CPU memory.

`activation_context(tier, device)` wraps a stage's forward. With tier `cpu`, every saved activation
(not parameters: those have their own tier and are fetched again for backward) is copied into a
pinned host buffer when saved and back to the device when backward needs it; the copies are exact.

With full recompute (`torch.utils.checkpoint.checkpoint`, either form) the checkpointed block's inputs
are saved through autograd under these hooks while the tensors inside the block go to checkpoint's own
hooks, so exactly the checkpointed activations go to the CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from heteroflow.devices import Device


@dataclass(slots=True)
class ActivationStats:
    """What the CPU tier has held: bytes saved in total and at most at once."""

    bytes_saved: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0


class _HostCopy:
    """A saved activation in host memory; frees its byte count from the stats when collected."""

    __slots__ = ("tensor", "device", "stats")

    def __init__(self, tensor: torch.Tensor, device: torch.device, stats: ActivationStats) -> None:
        self.tensor, self.device, self.stats = tensor, device, stats

    def __del__(self) -> None:
        self.stats.live_bytes -= self.tensor.numel() * self.tensor.element_size()


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of at least `min_bytes` (parameters excepted) live in pinned host memory."""

    def __init__(self, device: Device, *, min_bytes: int = 1024) -> None:
        self.stats = ActivationStats()
        pin = device.kind != "cpu"
        stats = self.stats

        def pack(tensor: torch.Tensor) -> object:
            nbytes = tensor.numel() * tensor.element_size()
            if isinstance(tensor, nn.Parameter) or nbytes < min_bytes:
                return tensor  # parameters have their own tier; tiny tensors are not worth a copy
            host = device.pinned_empty(tensor.shape, tensor.dtype) if pin else torch.empty_like(tensor, device="cpu")
            host.copy_(tensor, non_blocking=pin)  # D2H on the current stream: ordered before any reuse
            stats.bytes_saved += nbytes
            stats.live_bytes += nbytes
            stats.peak_live_bytes = max(stats.peak_live_bytes, stats.live_bytes)
            return _HostCopy(host, tensor.device, stats)

        def unpack(saved: object) -> torch.Tensor:
            if isinstance(saved, _HostCopy):
                return saved.tensor.to(saved.device, non_blocking=pin)
            return saved  # type: ignore[return-value]

        pack.chains_param_views = True  # OffloadedParams may put its parameter-view hook on top of this one

        super().__init__(pack, unpack)

    def __enter__(self) -> ActivationOffload:
        super().__enter__()
        return self  # torch's returns None; callers want the stats


def activation_context(tier: str, device: Device) -> contextlib.AbstractContextManager:
    """The context for a stage's forward: `ActivationOffload` for tier `cpu`, nothing for `device`."""
    assert tier in ("device", "cpu"), tier
    return ActivationOffload(device) if tier == "cpu" else contextlib.nullcontext()
