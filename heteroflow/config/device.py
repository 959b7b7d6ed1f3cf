"""`DeviceSpec`: what the planner needs to know about one kind of accelerator."""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.config.topology import NodeTopology
from heteroflow.layout import PRECISIONS

__all__ = ["PRECISIONS", "VENDORS", "DeviceSpec"]

VENDORS = ("nvidia", "amd", "hygon", "ascend", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """Published (or measured) capabilities of one device type, as torch sees one device.

    Rates are dense peaks per device; the cost model applies efficiencies on top.
    """

    name: str
    """Catalog key, e.g. `nvidia-a100-80g`."""
    vendor: str
    """One of `VENDORS`; chooses the collective backend and the boundary transport."""
    memory_gib: float
    """Device memory in GiB."""
    tflops_bf16: float | None = None
    """Dense bf16 peak in TFLOP/s; None when the device has no bf16 support."""
    tflops_fp16: float | None = None
    """Dense fp16 peak in TFLOP/s; None when unsupported."""
    tflops_fp32: float | None = None
    """Dense fp32 (non-tensor-core) peak in TFLOP/s; None when unknown."""
    hbm_gb_per_s: float = 1600.0
    """Device memory bandwidth in GB/s."""
    intra_node_gb_per_s: float = 25.0
    """Device-to-device bandwidth inside a node, per direction, in GB/s (NVLink, xGMI, HCCS)."""
    host_link_gb_per_s: float = 25.0
    """Device-to-host bandwidth per direction in GB/s (PCIe); used by host staging and offload."""
    source: str = ""
    """Where the numbers come from (datasheet, measurement, user override)."""
    topology: NodeTopology | None = None
    """How a node's devices of this type are linked (`config.topology`); None: each reaches every other at
    `intra_node_gb_per_s`, as through a switch."""

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak TFLOP/s for `precision` (`bf16`, `fp16`, `fp32`), or None if unsupported."""
        assert precision in PRECISIONS, precision
        return {"bf16": self.tflops_bf16, "fp16": self.tflops_fp16, "fp32": self.tflops_fp32}[precision]

    def supports(self, precision: str) -> bool:
        """Whether the device can train in `precision`: fp32 always (priced from the 16-bit peak when no fp32
        rate is published), bf16 and fp16 when their peak is known (Ascend 910A has no bf16)."""
        return precision == "fp32" or self.peak_tflops(precision) is not None

    def to_dict(self) -> dict:
        """Plain data for JSON/YAML output."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["topology"] = self.topology.to_dict() if self.topology is not None else None
        return out
