"""Which collective backend a vendor's devices use, and how two stages' devices talk across a boundary.

The device facade (`heteroflow.devices.facade.collective_backend`) owns the vendor -> backend mapping;
this module defers to it when it is installed and otherwise uses the same table, so backends/ works
before the facade lands and keeps working after.
"""

from __future__ import annotations

_BACKENDS = {"nvidia": "nccl", "amd": "nccl", "hygon": "nccl", "ascend": "hccl", "cpu": "gloo"}
"""ROCm builds of torch expose RCCL under the name `nccl`; torch_npu registers `hccl`."""

DIRECT, BRIDGE = "direct", "bridge"


def collective_backend(vendor: str) -> str:
    """The torch.distributed backend for collectives among `vendor`'s devices."""
    try:
        from heteroflow.devices.facade import collective_backend as facade_backend
    except ImportError:
        facade_backend = None
    if facade_backend is not None:
        return facade_backend(vendor)
    try:
        return _BACKENDS[vendor]
    except KeyError:
        raise ValueError(f"unknown vendor {vendor!r}; expected one of {', '.join(_BACKENDS)}") from None


def boundary_kind(src_vendor: str, dst_vendor: str) -> str:
    """`direct` when both stages run on one accelerator vendor (its backend moves the bytes device to
    device), else `bridge` (host-staged over gloo): NCCL and HCCL cannot talk to each other, and a CPU
    stage has no device backend. AMD and Hygon both say `nccl` but ship different RCCL builds, so they
    are bridged too rather than trusted to interoperate."""
    if src_vendor == dst_vendor and src_vendor != "cpu":
        return DIRECT
    return BRIDGE
