"""`OffloadPolicy`: one stage's offload decisions and its per-rank device budget, as plain data.

Built from the plan (`StageSpec.offload`) and the device type's memory; the runtime builds its
stores, optimizer and hooks from it (see `heteroflow/offload/__init__.py`). `offload_traffic` is
the per-step data movement the planner prices with measured bandwidths (no torch needed).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass

from heteroflow.config.cluster import ClusterSpec
from heteroflow.config.plan import ACTIVATION_TIERS, STATE_TIERS, StageSpec
from heteroflow.errors import UserError

SWAP_DIR_ENV = "HETEROFLOW_SWAP_DIR"
"""Where SSD-tier swap directories go when the job names none (default: the system temp directory)."""
DEFAULT_RESERVE_GIB = 2.0
"""Device memory kept out of the budget for the runtime's context, communication buffers and workspaces."""
DEFAULT_RESERVE_FRACTION = 0.05
"""Further share of device memory kept back for allocator fragmentation."""
GIB = 2**30


def default_swap_root(explicit: str | None = None) -> str:
    """Where swap directories go: `explicit` (train.offload_dir), else $HETEROFLOW_SWAP_DIR, else the temp dir."""
    return explicit or os.environ.get(SWAP_DIR_ENV) or tempfile.gettempdir()

@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadPolicy:
    """Where one rank of a stage keeps its training state, and how much device memory it may use."""

    optimizer: str = "device"
    """fp32 master weights and Adam moments: device, cpu or ssd."""
    params: str = "device"
    """Parameters between uses: device, cpu or ssd (fetched block by block)."""
    activations: str = "device"
    """Saved activations: device or cpu."""
    device_budget_bytes: int | None = None
    """Resident device bytes the offload bookkeeping may reach; None: unchecked."""
    swap_root: str | None = None
    """Directory under which the SSD tier makes its scratch directory (None when nothing goes to SSD)."""
    max_in_flight: int = 3
    """Staging buffers (and so SSD transfers) per store: 3 overlaps read k+1, work on k, write k-1."""
    chunk_numel: int = 1 << 22
    """Optimizer state elements per streamed chunk (a multiple of 4096)."""

    def __post_init__(self) -> None:
        for key, allowed in (("optimizer", STATE_TIERS), ("params", STATE_TIERS), ("activations", ACTIVATION_TIERS)):
            if getattr(self, key) not in allowed:
                raise UserError(f"offload.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.max_in_flight < 1 or self.chunk_numel <= 0 or self.chunk_numel % 4096:
            raise UserError("offload: max_in_flight must be >= 1 and chunk_numel a positive multiple of 4096")

    @property
    def uses_ssd(self) -> bool:
        """Whether a swap directory is needed."""
        return "ssd" in (self.optimizer, self.params)

    @property
    def any(self) -> bool:
        """Whether anything leaves the device."""
        return (self.optimizer, self.params, self.activations) != ("device", "device", "device")

    @classmethod
    def from_stage(cls, stage: StageSpec, *, cluster: ClusterSpec, swap_root: str | None = None,
                   reserve_gib: float = DEFAULT_RESERVE_GIB, reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
                   **overrides: object) -> OffloadPolicy:
        """The policy of every rank of `stage`: its plan's tiers and its device type's memory."""
        spec = cluster.device_types[stage.device_type]
        budget = device_budget_bytes(spec.memory_gib, reserve_gib=reserve_gib, reserve_fraction=reserve_fraction)
        off = stage.layout.offload
        root = None
        if "ssd" in (off.optimizer, off.params):
            root = default_swap_root(swap_root)
        return cls(optimizer=off.optimizer, params=off.params, activations=off.activations,
                   device_budget_bytes=budget, swap_root=root, **overrides)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        """Plain data for logs and reports."""
        return asdict(self)


def device_budget_bytes(memory_gib: float, *, reserve_gib: float = DEFAULT_RESERVE_GIB,
                        reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> int:
    """Bytes a rank may keep resident on a device of `memory_gib`, after the reserve."""
    budget = memory_gib * GIB * (1.0 - reserve_fraction) - reserve_gib * GIB
    if budget <= 0:
        raise UserError(f"a {memory_gib} GiB device leaves no memory after the {reserve_gib} GiB + "
                        f"{reserve_fraction:.0%} reserve; lower the reserve or use another device type")
    return int(budget)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadTraffic:
    """Bytes one rank moves per optimizer step because of offload, by link and direction."""

    host_to_device: int = 0
    device_to_host: int = 0
    disk_read: int = 0
    disk_write: int = 0
    cpu_adam_params: int = 0
    """Parameters the CPU updates (DeepSpeedCPUAdam or torch) per step."""

    def seconds(self, *, host_link_gb_per_s: float, disk_read_gb_per_s: float, disk_write_gb_per_s: float,
                cpu_adam_params_per_s: float) -> float:
        """Time if nothing overlaps with compute (the planner applies its own overlap model on top)."""
        return (self.host_to_device / (host_link_gb_per_s * 1e9) + self.device_to_host / (host_link_gb_per_s * 1e9)
                + self.disk_read / (disk_read_gb_per_s * 1e9) + self.disk_write / (disk_write_gb_per_s * 1e9)
                + self.cpu_adam_params / cpu_adam_params_per_s)


def offload_traffic(policy: OffloadPolicy, *, num_params: int, param_bytes: int, num_micro_batches: int,
                    activation_bytes_per_micro_batch: int = 0) -> OffloadTraffic:
    """Per-step traffic of one rank holding `num_params` parameters of `param_bytes` bytes each.

    Offloaded params are fetched twice per micro-batch (forward, backward) and their gradients leave
    after each backward; with params on the device the gradients leave once per step. fp32 optimizer
    state is 12 bytes per parameter, read and written once per step on SSD.
    """
    h2d = d2h = rd = wr = 0
    weights = num_params * param_bytes
    if policy.params != "device":
        h2d += 2 * weights * num_micro_batches
        d2h += weights * num_micro_batches  # gradients, in the parameter dtype
        if policy.params == "ssd":
            rd += 2 * weights * num_micro_batches
            wr += weights  # the optimizer writes the updated parameters
    if policy.optimizer != "device":
        if policy.params == "device":
            d2h += weights  # accumulated gradients, once per step
            h2d += weights  # updated parameters back to the device
        if policy.optimizer == "ssd":
            rd += 12 * num_params
            wr += 12 * num_params
    if policy.activations == "cpu":
        d2h += activation_bytes_per_micro_batch * num_micro_batches
        h2d += activation_bytes_per_micro_batch * num_micro_batches
    cpu_params = num_params if policy.optimizer != "device" else 0
    return OffloadTraffic(host_to_device=h2d, device_to_host=d2h, disk_read=rd, disk_write=wr,
                          cpu_adam_params=cpu_params)
