"""`Profile`: measured figures of one machine, as written by `heteroflow profile` (pure data, no torch).

A job names a profile with `cluster.profile: FILE.yaml`; for every cluster device type that the profile
measured (matched by name), the cost model uses the measured GEMM curve, memory bandwidth, links and disk
instead of catalog figures and the documented efficiency curve.

File format (one top-level `profile:` mapping):

```yaml
profile:
  version: 1
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
  link: {backend: gloo, gb_per_s: 1.4, latency_s: 4.0e-05}   # two local processes
  disk: {path: /tmp, read_gb_per_s: 1.9, write_gb_per_s: 1.1, direct_io: true}
```
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from heteroflow.config.device import PRECISIONS, VENDORS
from heteroflow.config.reader import Problems, Section

PROFILE_VERSION = 1


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
        if not curve:
            return None
        if dim <= curve[0][0]:
            return curve[0][1] * max(dim, 1.0) / curve[0][0]  # below the smallest size: linear falloff
        if dim >= curve[-1][0]:
            return curve[-1][1]
        for (n0, r0), (n1, r1) in zip(curve, curve[1:]):
            if n0 <= dim <= n1:
                x = (math.log(dim) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return r0 + x * (r1 - r0)
        return curve[-1][1]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """Point-to-point transfer between two local processes over `backend`."""

    backend: str = "gloo"
    gb_per_s: float = 0.0
    latency_s: float = 0.0


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
        if self.disk is not None:
            out["disk"] = {"path": self.disk.path, "read_gb_per_s": _r(self.disk.read_gb_per_s),
                           "write_gb_per_s": _r(self.disk.write_gb_per_s), "direct_io": self.disk.direct_io}
        return out


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write `profile` as YAML (one top-level `profile:` mapping)."""
    text = yaml.safe_dump({"profile": profile.to_dict()}, sort_keys=False, default_flow_style=None, width=120)
    Path(path).write_text("# written by `heteroflow profile`; name it in a job as cluster.profile\n" + text,
                          encoding="utf-8")


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
    version = sec.integer("version", PROFILE_VERSION)
    if version is not None and version > PROFILE_VERSION:
        problems.add(sec.at("version"), f"profile version {version} is newer than this heteroflow understands")
    host = HostProfile()
    h = sec.mapping("host", None)
    if h is not None:
        host = HostProfile(name=h.string("name", "") or "", cpu_cores=h.integer("cpu_cores", 1) or 1,
                           memory_gib=h.number("memory_gib", 0.0, minimum=0.0) or 0.0,
                           memory_gb_per_s=h.number("memory_gb_per_s", 0.0, minimum=0.0) or 0.0)
        h.finish()
    devices = []
    for i, raw in enumerate(sec.sequence("devices", []) or []):
        d = Section(raw, f"{sec.at('devices')}[{i}]", problems)
        gemm: dict[str, tuple[tuple[int, float], ...]] = {}
        g = d.mapping("gemm_tflops", None)
        if g is not None:
            for prec in list(g.data):
                pts = g.sequence(str(prec))
                if str(prec) not in PRECISIONS:
                    problems.add(g.at(str(prec)), f"unknown precision; expected one of {', '.join(PRECISIONS)}")
                    continue
                ok = isinstance(pts, list) and pts and all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in p)
                    for p in pts)
                if not ok:
                    problems.add(g.at(str(prec)), "expected a non-empty list of [n, tflops] pairs of positive numbers")
                    continue
                gemm[str(prec)] = tuple(sorted((int(n), float(r)) for n, r in pts))
            g.finish()
        dev = dict(device_type=d.string("device_type"), vendor=d.string("vendor", "cpu", choices=VENDORS),
                   description=d.string("description", "") or "",
                   memory_gib=d.number("memory_gib", 0.0, minimum=0.0),
                   memory_gb_per_s=d.number("memory_gb_per_s", 0.0, minimum=0.0),
                   host_link_gb_per_s=d.number("host_link_gb_per_s", 0.0, minimum=0.0),
                   launch_overhead_s=d.number("launch_overhead_s", 0.0, minimum=0.0))
        d.finish()
        if all(v is not None for v in dev.values()):
            devices.append(DeviceProfile(gemm_tflops=gemm, **dev))
    link = None
    ls = sec.mapping("link", None)
    if ls is not None:
        link = LinkProfile(backend=ls.string("backend", "gloo") or "gloo",
                           gb_per_s=ls.number("gb_per_s", 0.0, minimum=0.0) or 0.0,
                           latency_s=ls.number("latency_s", 0.0, minimum=0.0) or 0.0)
        ls.finish()
    disk = None
    ds = sec.mapping("disk", None)
    if ds is not None:
        disk = DiskProfile(path=ds.string("path", "") or "", read_gb_per_s=ds.number("read_gb_per_s", 0.0, minimum=0.0) or 0.0,
                           write_gb_per_s=ds.number("write_gb_per_s", 0.0, minimum=0.0) or 0.0,
                           direct_io=bool(ds.boolean("direct_io", False)))
        ds.finish()
    sec.finish()
    if not sec.valid:
        return None
    return Profile(host=host, devices=tuple(devices), link=link, disk=disk, version=version or PROFILE_VERSION)
