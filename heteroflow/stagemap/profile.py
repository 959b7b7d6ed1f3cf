"""`Profile`: measured figures of one machine, as written by `heteroflow profile` (pure data, no torch).

A job names a profile with `cluster.profile: FILE.yaml`; for every cluster device type that the profile
measured (matched by name), the cost model uses the measured GEMM curve, memory bandwidth, links and disk
instead of catalog figures and the documented efficiency curve. The `cpu_thread` section describes one host
CPU thread running heteroflow's own code; it prices the ranks of `train --emulate` (local CPU processes).
Its figures are timed in thread CPU time, so other jobs' load on a shared machine does not count.

File format (one top-level `profile:` mapping):

```yaml
profile:
  version: 2
  host: {name: dev-box, cpu_cores: 2, memory_gib: 24.0, memory_gb_per_s: 11.2}
  devices:
    - device_type: cpu                 # the cluster device type these numbers describe
      vendor: cpu
      description: "Intel Xeon ... (2 threads)"
      memory_gib: 24.0
      memory_gb_per_s: 11.2            # device memory bandwidth (copy)
      host_link_gb_per_s: 11.2         # device <-> host (copy; PCIe on accelerators)
      launch_overhead_s: 1.2e-05       # one small kernel (dispatch and launch)
      gemm_tflops:                     # square n x n x n matmuls: [[n, TFLOP/s], ...]
        fp32: [[256, 0.05], [1024, 0.2]]
        bf16: [[256, 0.03], [1024, 0.11]]
  cpu_thread:                          # one CPU thread (version 2; a version 1 file has none)
    gemm_tflops: {fp32: [[16, 0.004], [128, 0.1], [1024, 0.12]], bf16: [...], fp16: [...]}
    attention_tflops:                  # causal SDPA, [head_dim, forward, backward] TFLOP/s (see ThreadProfile)
      fp32: [[16, 0.02, 0.009], [64, 0.04, 0.013]]
    elementwise_gb_per_s: 14.0         # heteroflow's norms, RoPE, activation and adds, counted as compute.py counts
    block_forward_overhead_s: 4.0e-04  # one decoder block at negligible size: Python, dispatch, autograd
    block_backward_overhead_s: 5.0e-04
    reference_block:                   # heteroflow's real block at one mid-size shape, parameter gradients too
      shape: {hidden_size: 192, ffn_hidden_size: 512, num_attention_heads: 6, num_kv_heads: 2, seq_length: 128,
              micro_batch_size: 3}
      seconds: {fp32: [0.006, 0.011], bf16: [...], fp16: [...]}    # [forward, backward]
  link: {backend: gloo, gb_per_s: 1.4, latency_s: 4.0e-05,    # two local processes, point to point
         allreduce_gb_per_s: 1.7, allreduce_latency_s: 6.5e-05}   # and all-reduce (version 2)
  disk: {path: /tmp, read_gb_per_s: 1.9, write_gb_per_s: 1.1, direct_io: true}
  emulation:                           # what `train --emulate` pays on this host beyond the rates (version 3)
    busy_latency_s: [[1, 1.0e-03], [2, 1.6e-03], [4, 2.0e-03]]   # [processes per core, seconds per ring step]
    oversubscribed_slowdown: [[2, 1.1], [4, 1.2]]   # [processes per core, CPU time per unit of work / alone]
    thread_speedup: [[2, 1.2]]         # [torch threads, the real block's speed over one thread's] (optional)
    tp_block_overhead_s: [3.0e-04, 3.0e-04]   # [forward, backward] host seconds tp 2 adds to a block (optional)
    transfer_cpu_s: [[1, 4.0e-04], [2, 1.0e-03], [4, 1.0e-03]]   # [processes per core, CPU s a transfer end] (optional)
```
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from heteroflow.config import limits
from heteroflow.config.device import PRECISIONS, VENDORS
from heteroflow.config.reader import Problems, Section
from heteroflow.config.yamlfile import dump_yaml

PROFILE_VERSION = 3
"""2 added `cpu_thread` and the link's all-reduce figures; version 1 files (without them) are still read:
emulation then shares the measured whole-machine figures between the ranks, and collectives use the
point-to-point link figures."""
ATTENTION_PROBE_SEQ = 256
"""Sequence length of the attention measurement."""
REFERENCE_SHAPE_KEYS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "seq_length",
                        "micro_batch_size")


def curve_rate(curve: tuple[tuple[float, ...], ...], dim: float, column: int = 1) -> float:
    """The rate in `column` of a curve of (size, rate, ...) points at `dim`: interpolated in log(size), the
    largest size's rate above it, and falling off linearly below the smallest size (fixed costs dominate)."""
    if dim <= curve[0][0]:
        return curve[0][column] * max(dim, 1.0) / curve[0][0]
    if dim >= curve[-1][0]:
        return curve[-1][column]
    for lo, hi in zip(curve, curve[1:]):
        if lo[0] <= dim <= hi[0]:
            x = (math.log(dim) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
            return lo[column] + x * (hi[column] - lo[column])
    return curve[-1][column]


@dataclass(frozen=True, kw_only=True, slots=True)
class HostProfile:
    """The host CPU and memory."""

    name: str = ""
    cpu_cores: int = 1
    memory_gib: float = 0.0
    memory_gb_per_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """Measured figures of one device type."""

    device_type: str
    """Cluster device type (catalog name or `cluster.device_types` key) these numbers replace."""
    vendor: str
    description: str = ""
    memory_gib: float = 0.0
    memory_gb_per_s: float = 0.0
    host_link_gb_per_s: float = 0.0
    launch_overhead_s: float = 0.0
    """Seconds per small kernel (launch and dispatch overhead)."""
    gemm_tflops: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    """Per precision: (n, TFLOP/s) of n x n x n matmuls, n ascending."""

    def gemm_rate_tflops(self, precision: str, dim: float) -> float | None:
        """Measured TFLOP/s for a GEMM whose smallest dimension is `dim` (log-linear, clamped)."""
        curve = self.gemm_tflops.get(precision)
        return curve_rate(curve, dim) if curve else None


@dataclass(frozen=True, kw_only=True, slots=True)
class ThreadProfile:
    """One host CPU thread running heteroflow's code: what an emulated rank with one thread gets.

    Timed in thread CPU time (`time.thread_time`), so a loaded machine still measures what a core does.
    """

    gemm_tflops: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict, hash=False)
    """Per precision: (n, TFLOP/s) of n x n x n matmuls on one thread, n ascending."""
    attention_tflops: dict[str, tuple[tuple[int, float, float], ...]] = field(default_factory=dict, hash=False)
    """Per precision: (head_dim, forward, backward) of causal scaled-dot-product attention over
    `ATTENTION_PROBE_SEQ` tokens. Both rates are the forward's FLOPs (2 s^2 d per head: the causal halves of
    QK^T and PV) divided by the forward's, resp. the backward's, seconds."""
    elementwise_gb_per_s: float = 0.0
    """The rate at which heteroflow's block streams its elementwise bytes (norms, RoPE, activation, residual
    adds, as `compute.elementwise_elements` counts them; the backward counted as twice the forward)."""
    block_forward_overhead_s: float = 0.0
    """Forward seconds of one decoder block whose tensors are tiny: Python, dispatch and autograd recording."""
    block_backward_overhead_s: float = 0.0
    """Backward seconds of that block: the autograd engine's per-node cost."""
    reference_block_shape: dict[str, int] = field(default_factory=dict, hash=False)
    """The shape (`REFERENCE_SHAPE_KEYS`) at which `reference_block_s` was measured."""
    reference_block_s: dict[str, tuple[float, float]] = field(default_factory=dict, hash=False)
    """Per precision: (forward, backward) seconds of one real block of that shape (parameter gradients included;
    bf16 / fp16 forward under autocast, as the runtime runs it). Kernels inside a block run slower than alone
    (fresh activations, cold caches, page faults); the cost model scales the curves' rates to match this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """Point-to-point transfer between two local processes over `backend`."""

    backend: str = "gloo"
    gb_per_s: float = 0.0
    latency_s: float = 0.0
    allreduce_gb_per_s: float = 0.0
    """Ring all-reduce figures (0: not measured): over n ranks, 2(n-1)/n x bytes / allreduce_gb_per_s +
    2(n-1) x allreduce_latency_s, fitted to two-process all-reduces of 4 bytes and of a large buffer."""
    allreduce_latency_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulationProfile:
    """What local CPU processes (`train --emulate`) pay on this host beyond the rates the other sections
    measure, measured as a training step meets it (`measure.emulation`)."""

    busy_latency_s: tuple[tuple[float, float], ...] = ()
    """(processes per core, seconds): per ring step of an activation-sized all-reduce (its bytes at the idle link's
    bandwidth taken off) between two one-thread processes that compute between all-reduces (as tp ranks do)
    while the host runs that many processes per core, every one of them such a pair: the partner is late or
    waits for a core. It replaces the idle link's latency for emulated transfers, read (`per_core_value`) at the
    plan's mean computing threads per core (`estimate.computing_per_core`); these waits take no core
    (`pipeline.run_shared`)."""
    oversubscribed_slowdown: tuple[tuple[float, float], ...] = ()
    """(processes per core, slowdown): how much more CPU time a unit of one-thread work takes in each of that many
    processes per core, alternating work with point-to-point exchanges as pipeline stages do, than alone (context
    switches at every wake-up, caches shared), ascending (`pipeline.sharing_speed` reads it)."""
    thread_speedup: tuple[tuple[float, float], ...] = ()
    """(torch threads, speedup): how much faster one process runs heteroflow's real block (the profile's reference
    block, forward and backward) with that many threads than with one, in wall time on the host to itself (the
    best of several rounds). Small kernels barely use a second thread; without it each thread is taken to add
    one thread's rate (`thread_speedup`)."""
    tp_block_overhead_s: tuple[float, float] | tuple[()] = ()
    """(forward, backward): the host seconds a tensor-parallel layout adds to one decoder block per micro-batch
    outside its collectives (the tp functions around them, the sharded projections' extra work), measured on
    two ranks at tp 2 without sp with the runtime's timer, minus the same ranks' block at tp 1; priced for every
    tp above 1, with or without sp. Empty: not measured (0)."""
    transfer_cpu_s: tuple[tuple[float, float], ...] = ()
    """(processes per core, seconds): the CPU time one end (a send or a receive) of a point-to-point transfer of
    an activation-sized buffer takes outside the work, in pairs of one-thread processes that alternate work with
    such exchanges while the host runs that many processes per core (`measure.emulation`): gloo's threads,
    system calls and wake-ups. Emulated, each stage boundary's send and receive take it from the cores the ranks
    share, read at the plan's processes per core (`stagemap.emulation.boundary_cpu_s`). Empty: not measured (0)."""



@dataclass(frozen=True, kw_only=True, slots=True)
class DiskProfile:
    """Sequential read/write of large blocks, with O_DIRECT when `direct_io`."""

    path: str = ""
    read_gb_per_s: float = 0.0
    write_gb_per_s: float = 0.0
    direct_io: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Everything `heteroflow profile` measured on one machine."""

    host: HostProfile = field(default_factory=HostProfile)
    devices: tuple[DeviceProfile, ...] = ()
    link: LinkProfile | None = None
    disk: DiskProfile | None = None
    cpu_thread: ThreadProfile | None = None
    emulation: EmulationProfile | None = None
    version: int = PROFILE_VERSION

    def device(self, device_type: str) -> DeviceProfile | None:
        """The measurements for `device_type`, if the profile has them."""
        for d in self.devices:
            if d.device_type == device_type:
                return d
        return None

    def to_dict(self) -> dict:
        """Plain data in the profile YAML schema (the `profile:` mapping)."""
        out: dict = {"version": self.version,
                     "host": {"name": self.host.name, "cpu_cores": self.host.cpu_cores,
                              "memory_gib": _r(self.host.memory_gib), "memory_gb_per_s": _r(self.host.memory_gb_per_s)},
                     "devices": [{"device_type": d.device_type, "vendor": d.vendor, "description": d.description,
                                  "memory_gib": _r(d.memory_gib), "memory_gb_per_s": _r(d.memory_gb_per_s),
                                  "host_link_gb_per_s": _r(d.host_link_gb_per_s),
                                  "launch_overhead_s": float(f"{d.launch_overhead_s:.4g}"),
                                  "gemm_tflops": {p: [[n, _r(r)] for n, r in c] for p, c in d.gemm_tflops.items()}}
                                 for d in self.devices]}
        if self.link is not None:
            out["link"] = {"backend": self.link.backend, "gb_per_s": _r(self.link.gb_per_s),
                           "latency_s": float(f"{self.link.latency_s:.4g}")}
            if self.link.allreduce_gb_per_s:
                out["link"].update(allreduce_gb_per_s=_r(self.link.allreduce_gb_per_s),
                                   allreduce_latency_s=_r(self.link.allreduce_latency_s))
        if self.disk is not None:
            out["disk"] = {"path": self.disk.path, "read_gb_per_s": _r(self.disk.read_gb_per_s),
                           "write_gb_per_s": _r(self.disk.write_gb_per_s), "direct_io": self.disk.direct_io}
        if self.emulation is not None:
            e = self.emulation
            out["emulation"] = {"busy_latency_s": [[_r(r), _r(v)] for r, v in e.busy_latency_s],
                                "oversubscribed_slowdown": [[_r(r), _r(v)] for r, v in e.oversubscribed_slowdown]}
            if e.thread_speedup:
                out["emulation"]["thread_speedup"] = [[_r(t), _r(v)] for t, v in e.thread_speedup]
            if e.tp_block_overhead_s:
                out["emulation"]["tp_block_overhead_s"] = [_r(v) for v in e.tp_block_overhead_s]
            if e.transfer_cpu_s:
                out["emulation"]["transfer_cpu_s"] = [[_r(r), _r(v)] for r, v in e.transfer_cpu_s]
        if self.cpu_thread is not None:
            t = self.cpu_thread
            out["cpu_thread"] = {
                "gemm_tflops": {p: [[n, _r(r)] for n, r in c] for p, c in t.gemm_tflops.items()},
                "attention_tflops": {p: [[d, _r(f), _r(b)] for d, f, b in c] for p, c in t.attention_tflops.items()},
                "elementwise_gb_per_s": _r(t.elementwise_gb_per_s),
                "block_forward_overhead_s": _r(t.block_forward_overhead_s),
                "block_backward_overhead_s": _r(t.block_backward_overhead_s)}
            if t.reference_block_s:
                out["cpu_thread"]["reference_block"] = {
                    "shape": dict(t.reference_block_shape),
                    "seconds": {p: [_r(f), _r(b)] for p, (f, b) in t.reference_block_s.items()}}
        return out


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write `profile` as YAML (one top-level `profile:` mapping)."""
    text = dump_yaml({"profile": profile.to_dict()}, sort_keys=False, default_flow_style=None, width=120)
    Path(path).write_text("# written by `heteroflow profile`; name it in a job as cluster.profile\n" + text,
                          encoding="utf-8")


_GB_PER_S, _SECONDS, _GIB = limits.MEASURED_GB_PER_S, limits.MEASURED_S, limits.MEASURED_GIB


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile file; problems raise a `ConfigError` naming their paths."""
    from heteroflow.config.job import read_yaml
    problems = Problems(str(path))
    top = Section(read_yaml(path), "", problems)
    sec = top.mapping("profile")
    top.finish()
    if sec is None:
        problems.raise_if_any()
    profile = parse_profile(sec, problems)
    problems.raise_if_any()
    assert profile is not None
    return profile


def parse_profile(sec: Section, problems: Problems) -> Profile | None:
    """Build a `Profile` from the `profile:` mapping."""
    version = sec.integer("version", PROFILE_VERSION, limit=limits.FILE_VERSION)
    if version is not None and version > PROFILE_VERSION:
        problems.add(sec.at("version"), f"profile version {version} is newer than this heteroflow understands")
    host = HostProfile()
    h = sec.mapping("host", None)
    if h is not None:
        host = HostProfile(name=h.string("name", "") or "",
                           cpu_cores=h.integer("cpu_cores", 1, limit=limits.CPU_CORES) or 1,
                           memory_gib=h.number("memory_gib", 0.0, limit=_GIB) or 0.0,
                           memory_gb_per_s=h.number("memory_gb_per_s", 0.0, limit=_GB_PER_S) or 0.0)
        h.finish()
    devices = []
    for i, raw in enumerate(sec.sequence("devices", []) or []):
        d = Section(raw, f"{sec.at('devices')}[{i}]", problems)
        gemm = _curves(d, "gemm_tflops", ("n", "tflops"), problems)
        dev = dict(device_type=d.string("device_type"), vendor=d.string("vendor", "cpu", choices=VENDORS),
                   description=d.string("description", "") or "",
                   memory_gib=d.number("memory_gib", 0.0, limit=_GIB),
                   memory_gb_per_s=d.number("memory_gb_per_s", 0.0, limit=_GB_PER_S),
                   host_link_gb_per_s=d.number("host_link_gb_per_s", 0.0, limit=_GB_PER_S),
                   launch_overhead_s=d.number("launch_overhead_s", 0.0, limit=_SECONDS))
        d.finish()
        if all(v is not None for v in dev.values()):
            devices.append(DeviceProfile(gemm_tflops=gemm, **dev))
    link = None
    ls = sec.mapping("link", None)
    if ls is not None:
        link = LinkProfile(backend=ls.string("backend", "gloo") or "gloo",
                           gb_per_s=ls.number("gb_per_s", 0.0, limit=_GB_PER_S) or 0.0,
                           latency_s=ls.number("latency_s", 0.0, limit=_SECONDS) or 0.0,
                           allreduce_gb_per_s=ls.number("allreduce_gb_per_s", 0.0, limit=_GB_PER_S) or 0.0,
                           allreduce_latency_s=ls.number("allreduce_latency_s", 0.0, limit=_SECONDS) or 0.0)
        ls.finish()
    disk = None
    ds = sec.mapping("disk", None)
    if ds is not None:
        disk = DiskProfile(path=ds.string("path", "") or "",
                           read_gb_per_s=ds.number("read_gb_per_s", 0.0, limit=_GB_PER_S) or 0.0,
                           write_gb_per_s=ds.number("write_gb_per_s", 0.0, limit=_GB_PER_S) or 0.0,
                           direct_io=bool(ds.boolean("direct_io", False)))
        ds.finish()
    cpu_thread = None
    ts = sec.mapping("cpu_thread", None)
    if ts is not None:
        cpu_thread = ThreadProfile(
            gemm_tflops=_curves(ts, "gemm_tflops", ("n", "tflops"), problems),
            attention_tflops=_curves(ts, "attention_tflops", ("head_dim", "forward", "backward"), problems),
            elementwise_gb_per_s=ts.number("elementwise_gb_per_s", 0.0, limit=_GB_PER_S) or 0.0,
            block_forward_overhead_s=ts.number("block_forward_overhead_s", 0.0, limit=_SECONDS) or 0.0,
            block_backward_overhead_s=ts.number("block_backward_overhead_s", 0.0, limit=_SECONDS) or 0.0,
            **_reference_block(ts, problems))
        ts.finish()
    emulation = _emulation(sec)
    sec.finish()
    if not sec.valid:
        return None
    return Profile(host=host, devices=tuple(devices), link=link, disk=disk, cpu_thread=cpu_thread,
                   emulation=emulation, version=version or PROFILE_VERSION)


def _emulation(sec: Section) -> EmulationProfile | None:
    """The `emulation` section (absent: None)."""
    es = sec.mapping("emulation", None)
    if es is None:
        return None
    out = EmulationProfile(busy_latency_s=_per_core_points(es, "busy_latency_s", minimum=1.0),
                           oversubscribed_slowdown=_per_core_points(es, "oversubscribed_slowdown", minimum=1.0 + 1e-9),
                           thread_speedup=_per_core_points(es, "thread_speedup", minimum=2.0, what="torch threads"),
                           tp_block_overhead_s=_forward_backward(es, "tp_block_overhead_s"),
                           transfer_cpu_s=_per_core_points(es, "transfer_cpu_s", minimum=1.0))
    es.finish()
    return out


def _per_core_points(sec: Section, key: str, *, minimum: float,
                     what: str = "processes per core") -> tuple[tuple[float, float], ...]:
    """`[[x, value], ...]` (x, the `what` of each point, at least `minimum`), sorted by x; () when absent."""
    points = sec.sequence(key, []) or []
    if not all(isinstance(p, list) and len(p) == 2 and all(_positive_finite(v) for v in p) and p[0] >= minimum
               for p in points):
        sec.problems.add(sec.at(key), f"expected a list of [{what} (at least {minimum:.0f}), value] "
                                      "pairs of finite positive numbers")
        return ()
    return tuple(sorted((float(r), float(v)) for r, v in points))


def _forward_backward(sec: Section, key: str) -> tuple[float, float] | tuple[()]:
    """`[forward, backward]` seconds, each finite and at least 0; () when absent."""
    value = sec.sequence(key, None)
    if value is None:
        return ()
    if not (len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                    and _SECONDS.minimum <= v <= _SECONDS.maximum for v in value)):
        sec.problems.add(sec.at(key), f"expected [forward, backward] seconds, each {_SECONDS.describe()}")
        return ()
    return float(value[0]), float(value[1])


def thread_speedup(emulation: EmulationProfile | None, threads: int) -> float:
    """How much faster one process with `threads` torch threads runs than with one: linear between the measured
    points (`EmulationProfile.thread_speedup`, from (1, 1.0)), the last one beyond them (the profiled host
    had no more cores); `threads` itself when not measured."""
    if emulation is None or not emulation.thread_speedup or threads <= 1:
        return float(max(1, threads))
    return per_core_value(((1.0, 1.0), *emulation.thread_speedup), threads)


def per_core_value(points: tuple[tuple[float, float], ...], processes_per_core: float) -> float:
    """A per-core curve of the `emulation` section at `processes_per_core`: linear between its points, its
    first value below them, its last beyond them."""
    if processes_per_core <= points[0][0]:
        return points[0][1]
    for (r0, v0), (r1, v1) in zip(points, points[1:]):
        if processes_per_core <= r1:
            return v0 + (v1 - v0) * (processes_per_core - r0) / (r1 - r0)
    return points[-1][1]


def _reference_block(sec: Section, problems: Problems) -> dict:
    """`reference_block_shape` and `reference_block_s` from `cpu_thread.reference_block` (absent: empty)."""
    rb = sec.mapping("reference_block", None)
    if rb is None:
        return {}
    shape: dict[str, int] = {}
    sh = rb.mapping("shape")
    if sh is not None:
        for key in REFERENCE_SHAPE_KEYS:
            value = sh.integer(key, limit=limits.SEQ_LENGTH)
            if value is not None:
                shape[key] = value
        sh.finish()
    seconds: dict[str, tuple[float, float]] = {}
    for prec, (f, b) in _curves(rb, "seconds", ("forward", "backward"), problems, sized=False).items():
        seconds[prec] = (f, b)
    rb.finish()
    return {"reference_block_shape": shape, "reference_block_s": seconds}


def _curves(sec: Section, key: str, columns: tuple[str, ...], problems: Problems, *,
            sized: bool = True) -> dict[str, tuple]:
    """Per precision, a list of points `[size, rate, ...]` of positive numbers, sorted by size; with
    `sized=False`, one list of `columns` numbers instead."""
    out: dict[str, tuple] = {}
    g = sec.mapping(key, None)
    if g is None:
        return out
    for prec in list(g.data):
        pts = g.sequence(str(prec))
        if str(prec) not in PRECISIONS:
            problems.add(g.at(str(prec)), f"unknown precision; expected one of {', '.join(PRECISIONS)}")
            continue
        if not sized:
            ok = isinstance(pts, list) and len(pts) == len(columns) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in pts)
            if not ok:
                problems.add(g.at(str(prec)), f"expected [{', '.join(columns)}], finite positive numbers")
                continue
            out[str(prec)] = tuple(float(v) for v in pts)
            continue
        ok = isinstance(pts, list) and pts and all(
            isinstance(p, list) and len(p) == len(columns)
            and all(_positive_finite(v) for v in p) for p in pts)
        if not ok:
            problems.add(g.at(str(prec)), f"expected a non-empty list of [{', '.join(columns)}] lists of finite "
                         "positive numbers")
            continue
        out[str(prec)] = tuple(sorted((int(p[0]), *(float(v) for v in p[1:])) for p in pts))
    g.finish()
    return out
