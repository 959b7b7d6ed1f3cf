"""`DeviceModel` and `Hardware`: the rates the cost model uses, from the catalog or from a profile.

Without a profile, a GEMM runs at `peak x efficiency`, where the documented efficiency curve is

    efficiency(dim) = EFF_MAX[vendor] * dim / (dim + EFF_HALF_DIM[vendor])

and `dim` is the smallest of the GEMM's three dimensions (M, N, K) on one device: skinny and small matrices
fill fewer tiles of the matrix units, so tensor parallelism (which shrinks N or K) and short sequences cost
efficiency. EFF_MAX is what large bf16 GEMMs reach in public measurements (cuBLAS ~80% of the A100/H100
peak, hipBLASLt and CANN somewhat less); EFF_HALF_DIM is the dimension at which half of that is reached.
The catalog `cpu` entry is already a measured matmul rate, so its EFF_MAX is 1. A profile replaces the curve
with measured square-GEMM rates (interpolated in log(dim)), and the catalog bandwidths with measured ones.

Host-side figures the catalog does not carry (per node): HOST_MEMORY_GB_PER_S (CPU Adam and staging),
SSD_READ_GB_PER_S / SSD_WRITE_GB_PER_S (NVMe offload). Latencies: INTRA_LATENCY_S per collective step
inside a node, INTER_LATENCY_S between nodes, HOST_STAGE_LATENCY_S per host-staged hop.

A profile whose link section measured all-reduces prices collectives inside a node with those figures
(`collective_link`); point-to-point transfers keep the link's own.

Emulation (`emulate=True`, every device one local CPU process) is priced in `emulation`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from heteroflow.config.device import DeviceSpec
from heteroflow.config.topology import NodeTopology
from heteroflow.stagemap.profile import DeviceProfile, Profile, curve_rate

EFF_MAX = {"nvidia": 0.80, "amd": 0.70, "hygon": 0.60, "ascend": 0.70, "cpu": 1.0}
EFF_HALF_DIM = {"nvidia": 128.0, "amd": 160.0, "hygon": 192.0, "ascend": 160.0, "cpu": 48.0}
HOST_MEMORY_GB_PER_S = 100.0
SSD_READ_GB_PER_S = 6.0
SSD_WRITE_GB_PER_S = 4.0
INTRA_LATENCY_S = 1.0e-5
INTER_LATENCY_S = 2.0e-5
HOST_STAGE_LATENCY_S = 5.0e-5
LAUNCH_OVERHEAD_S = {"nvidia": 4e-6, "amd": 6e-6, "hygon": 8e-6, "ascend": 10e-6, "cpu": 15e-6}
"""Host-side cost of launching one kernel (eager PyTorch); matters only for small models."""
FP32_FALLBACK_DIVISOR = 8.0
"""A device that publishes no fp32 rate (Ascend cubes) is priced at its fp16/bf16 peak / 8 for fp32."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceModel:
    """One device type as the cost model sees it, computing in one precision (`precision`)."""

    name: str
    vendor: str
    memory_gib: float
    peak_tflops: float
    hbm_gb_per_s: float
    intra_node_gb_per_s: float
    host_link_gb_per_s: float
    host_memory_gb_per_s: float = HOST_MEMORY_GB_PER_S
    """Per node."""
    ssd_read_gb_per_s: float = SSD_READ_GB_PER_S
    """Per node."""
    ssd_write_gb_per_s: float = SSD_WRITE_GB_PER_S
    """Per node."""
    intra_latency_s: float = INTRA_LATENCY_S
    collective_gb_per_s: float = 0.0
    """Measured ring all-reduce bandwidth inside a node (0: the intra-node link's figures)."""
    collective_latency_s: float = 0.0
    launch_overhead_s: float = 5e-6
    """Seconds to launch one kernel (per rank; under emulation the ranks share the host's cores)."""
    eff_max: float = 0.8
    eff_half_dim: float = 128.0
    measured: DeviceProfile | None = None
    """Measured GEMM curve, used instead of peak x efficiency when present."""
    precision: str = "bf16"
    """The precision whose peak (or measured curve) `gemm_tflops` uses; a stage priced with this model
    computes in it."""
    share: float = 1.0
    """Multiple of the measured compute rates one rank gets (emulation: its threads, or its fraction of the
    whole-machine rates)."""
    attention_tflops: tuple[tuple[int, float, float], ...] = ()
    """Measured (head_dim, forward, backward) attention rates of one thread (see `ThreadProfile`); empty: the
    attention core is priced from the GEMM rate."""
    block_overhead_s: tuple[float, float] | None = None
    """Measured (forward, backward) host seconds of one decoder block; None: `launch_s` of its kernels."""
    tp_block_overhead_s: tuple[float, float] = (0.0, 0.0)
    """Measured (forward, backward) host seconds a tp layout adds to a block outside its collectives: emulated
    ranks, the profile's `emulation.tp_block_overhead_s` (measured at tp 2 without sp, paid at every tp above 1,
    with or without sp); on accelerators not priced (0)."""
    gemm_efficiency: float = 1.0
    """Calibration (`stagemap.calibration`): multiplier of the GEMM and attention rates."""
    tp_comm_efficiency: float = 1.0
    """Calibration: multiplier of the tensor-parallel collectives' bandwidth."""
    dp_comm_efficiency: float = 1.0
    """Calibration: multiplier of the data-parallel reduction's bandwidth."""
    topology: NodeTopology | None = None
    """How a node's devices are linked (`stagemap.topology` prices groups on it); None: all alike."""

    def gemm_tflops(self, dim: float) -> float:
        """Effective TFLOP/s of a GEMM whose smallest dimension is `dim`."""
        if self.measured is not None:
            rate = self.measured.gemm_rate_tflops(self.precision, dim)
            if rate is not None:
                return rate * self.share * self.gemm_efficiency
        return self.peak_tflops * self.eff_max * dim / (dim + self.eff_half_dim) * self.share * self.gemm_efficiency

    def attention_rates(self, head_dim: float) -> tuple[float, float] | None:
        """Measured (forward, backward) TFLOP/s of the attention core, or None."""
        if not self.attention_tflops:
            return None
        scale = self.share * self.gemm_efficiency
        return (curve_rate(self.attention_tflops, head_dim, 1) * scale,
                curve_rate(self.attention_tflops, head_dim, 2) * scale)

    def gemm_s(self, m: float, n: float, k: float, dtype_bytes: int) -> float:
        """Seconds for one (m x k) @ (k x n) GEMM: compute at the effective rate, or memory traffic if slower."""
        flops = 2.0 * m * n * k
        compute = flops / (self.gemm_tflops(min(m, n, k)) * 1e12)
        traffic = dtype_bytes * (m * k + k * n + m * n) / (self.hbm_gb_per_s * 1e9)
        return max(compute, traffic)

    def launch_s(self, kernels: int) -> float:
        """Host-side seconds to launch `kernels` kernels (one host thread does it, whatever `share` is)."""
        return kernels * self.launch_overhead_s

    def collective_link(self) -> tuple[float, float]:
        """(GB/s, latency per ring step) of collectives inside a node: measured all-reduces when the profile
        has them (they pay more per byte and per step than point to point), else the intra-node link."""
        if self.collective_gb_per_s > 0:
            return self.collective_gb_per_s, self.collective_latency_s
        return self.intra_node_gb_per_s, self.intra_latency_s

    def tp_link(self) -> tuple[float, float]:
        """(GB/s, latency per ring step) of the stage's tensor-parallel collectives (`collective_link`, scaled
        by the calibration's `tp_comm`)."""
        gb_per_s, latency_s = self.collective_link()
        return gb_per_s * self.tp_comm_efficiency, latency_s

    def memory_s(self, num_bytes: float) -> float:
        """Seconds to stream `num_bytes` through device memory (elementwise kernels)."""
        return num_bytes / (self.hbm_gb_per_s * 1e9)


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """The cluster's device models and network, as priced for one job."""

    models: dict[str, dict[str, DeviceModel]]
    """Per device type, its model for each precision it can train in (`DeviceSpec.supports`), in `PRECISIONS`
    order; a device type that can train in none is absent."""
    inter_node_gb_per_s: float
    inter_latency_s: float = INTER_LATENCY_S
    emulate: bool = False
    """Every rank a local CPU process: links are the local link, no host staging."""
    cores: int = 0
    """Emulation: the host's cores, which the ranks' threads share."""
    threads_per_rank: int = 1
    """Emulation: threads of each rank (`threads_per_process`)."""
    oversubscribed_slowdown: tuple[tuple[float, float], ...] = ()
    """Emulation: the host's measured (threads per core, slowdown) beyond processor sharing (a profile's
    `emulation` section; empty: none)."""
    transfer_cpu_s: float = 0.0
    """Emulation: core seconds one end (send or receive) of a stage boundary transfer takes, at this plan's
    processes per core (the profile's `emulation.transfer_cpu_s`; 0: not measured)."""

    def device(self, device_type: str, precision: str) -> DeviceModel | None:
        """The model of `device_type` computing in `precision`; None when it cannot train in it."""
        return self.models.get(device_type, {}).get(precision)

    def precisions(self, device_type: str) -> tuple[str, ...]:
        """The precisions `device_type` can train in, in `PRECISIONS` order (bf16, fp16, fp32)."""
        return tuple(self.models.get(device_type, {}))


def peak_for(spec: DeviceSpec, precision: str) -> float | None:
    """Dense peak TFLOP/s of `spec` for `precision`, with the documented fp32 fallback."""
    peak = spec.peak_tflops(precision)
    if peak is None and precision == "fp32":
        low = max(spec.tflops_bf16 or 0.0, spec.tflops_fp16 or 0.0)
        peak = low / FP32_FALLBACK_DIVISOR if low else None
    return peak


def device_model(spec: DeviceSpec, precision: str, profile: Profile | None = None) -> DeviceModel | None:
    """The model of `spec` for `precision`; None when the device cannot train in that precision."""
    peak = peak_for(spec, precision)
    measured = profile.device(spec.name) if profile is not None else None
    if measured is not None and measured.gemm_tflops.get(precision):
        peak = peak or max(r for _, r in measured.gemm_tflops[precision])
    if peak is None:
        return None
    model = DeviceModel(name=spec.name, vendor=spec.vendor, memory_gib=spec.memory_gib, peak_tflops=peak,
                        hbm_gb_per_s=spec.hbm_gb_per_s, intra_node_gb_per_s=spec.intra_node_gb_per_s,
                        host_link_gb_per_s=spec.host_link_gb_per_s, eff_max=EFF_MAX[spec.vendor],
                        launch_overhead_s=LAUNCH_OVERHEAD_S[spec.vendor],
                        eff_half_dim=EFF_HALF_DIM[spec.vendor], precision=precision, topology=spec.topology)
    if measured is not None:
        model = apply_measurements(model, measured, profile)
    return model


def apply_measurements(model: DeviceModel, measured: DeviceProfile, profile: Profile) -> DeviceModel:
    """Replace catalog figures by whatever the profile measured."""
    changes: dict = {"measured": measured}
    if measured.memory_gb_per_s:
        changes["hbm_gb_per_s"] = measured.memory_gb_per_s
    if measured.host_link_gb_per_s:
        changes["host_link_gb_per_s"] = measured.host_link_gb_per_s
    if measured.launch_overhead_s:
        changes["launch_overhead_s"] = measured.launch_overhead_s
    if profile.link is not None and profile.link.gb_per_s:
        changes["intra_node_gb_per_s"] = profile.link.gb_per_s
        changes["intra_latency_s"] = profile.link.latency_s or model.intra_latency_s
    if profile.link is not None and profile.link.allreduce_gb_per_s:
        changes["collective_gb_per_s"] = profile.link.allreduce_gb_per_s
        changes["collective_latency_s"] = profile.link.allreduce_latency_s
    if profile.host.memory_gb_per_s:
        changes["host_memory_gb_per_s"] = profile.host.memory_gb_per_s
    if profile.disk is not None and profile.disk.read_gb_per_s and profile.disk.write_gb_per_s:
        changes["ssd_read_gb_per_s"] = profile.disk.read_gb_per_s
        changes["ssd_write_gb_per_s"] = profile.disk.write_gb_per_s
    return replace(model, **changes)


def threads_per_process(cores: int, processes: int) -> int:
    """Threads each of `processes` local workers gets: the cores split evenly, at least one. The launcher sets
    its workers' torch threads with this function, so emulated runs are priced with the threads they get."""
    return max(1, cores // max(1, processes))
