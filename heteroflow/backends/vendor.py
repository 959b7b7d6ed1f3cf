"""How two stages' devices talk across a boundary; the vendor -> backend table lives in devices/."""

from __future__ import annotations

from heteroflow.devices.facade import collective_backend

__all__ = ["BRIDGE", "DIRECT", "boundary_kind", "collective_backend"]

DIRECT, BRIDGE = "direct", "bridge"


def boundary_kind(src_vendor: str, dst_vendor: str) -> str:
    """`direct` when both stages run on one accelerator vendor (its backend moves the bytes device to
    device), else `bridge` (host-staged over gloo): NCCL and HCCL cannot talk to each other, and a CPU
    stage has no device backend. AMD and Hygon both say `nccl` but ship different RCCL builds, so they
    are bridged too rather than trusted to interoperate."""
    if src_vendor == dst_vendor and src_vendor != "cpu":
        return DIRECT
    return BRIDGE
