"""`Calibration`: per device type factors that scale the cost model's rates, fitted by `heteroflow calibrate`.

Each factor multiplies one rate of a device type's `DeviceModel` (1.0: the uncalibrated model):

- `gemm`: GEMM and attention-core rates (the efficiency curve or the profile's measured curve);
- `memory`: device memory bandwidth (elementwise kernels, the on-device optimizer, bandwidth-bound GEMMs);
- `overhead`: the host-side cost of each block (kernel launches, or the profile's measured block overhead);
- `tp_comm`: the bandwidth of the stage's tensor-parallel collectives;
- `dp_comm`: the bandwidth of its data-parallel gradient reduction (and ZeRO gathers).

A calibration fitted on emulated runs (`emulate: true`) applies only to emulated estimates, and one fitted on
real runs only to real ones: an emulated rank is a CPU process, whatever its device type's label says.

The file (YAML): `version`, `emulate`, `num_runs`, `device_types: {NAME: {gemm: ..., ...}}`, and what the
fit reported: `not_pinned_down` (factors the runs could not determine) and `runs` (residuals).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Iterable

from heteroflow.config.reader import Problems, Section
from heteroflow.config.yamlfile import dump_yaml, read_yaml
from heteroflow.config.chip_names import device_type_hint
from heteroflow.stagemap.hardware import DeviceModel

CALIBRATION_VERSION = 1
FACTOR_LIMIT = (1e-3, 1e3)
"""A factor outside this range is a broken fit or a broken file, not a slow card."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceFactors:
    """Multipliers of one device type's rates (see the module docstring); 1.0 leaves a rate as it is."""

    gemm: float = 1.0
    """GEMM and attention-core TFLOP/s."""
    memory: float = 1.0
    """Device memory GB/s."""
    overhead: float = 1.0
    """Host seconds per block (a multiplier of time, not of a rate)."""
    tp_comm: float = 1.0
    """Tensor-parallel collective GB/s."""
    dp_comm: float = 1.0
    """Data-parallel reduction GB/s."""

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(f"{getattr(self, f.name):.6g}") for f in fields(self)}


FACTORS: tuple[str, ...] = tuple(f.name for f in fields(DeviceFactors))
TIME_FACTORS: tuple[str, ...] = ("overhead",)
"""The factors that multiply a time (larger is slower); the others multiply a rate (larger is faster)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Fitted factors per device type, and where they came from."""

    factors: dict[str, DeviceFactors] = field(hash=False)
    num_runs: int
    emulate: bool = False
    """Fitted on emulated runs: applies to emulated estimates only (and a real-run fit to real ones only)."""
    source: str = ""
    """The file it was read from ('' when built in memory)."""
    not_pinned_down: tuple[str, ...] = ()
    """`DEVICE_TYPE.factor` names the runs could not determine (they stay near 1.0)."""
    runs: tuple[dict, ...] = ()
    """Per run: its source and measured, predicted-before and predicted-after step times."""

    def for_device(self, device_type: str) -> DeviceFactors | None:
        """The factors of `device_type`, or None when the calibration has none for it."""
        return self.factors.get(device_type)

    def applies(self, *, emulate: bool) -> bool:
        """Whether it prices an estimate made with `emulate`."""
        return self.emulate == emulate

    def note(self, *, emulate: bool) -> dict:
        """What `--json` reports under `calibration`."""
        return {"file": self.source, "num_runs": self.num_runs, "emulate": self.emulate,
                "applied": self.applies(emulate=emulate)}


def describe_note(note: dict) -> str:
    """The line `plan`, `plan --evaluate` and `train` print for a calibration note."""
    where = f" ({note['file']})" if note.get("file") else ""
    runs = f"{note['num_runs']} run{'s' * (note['num_runs'] != 1)}"
    if note["applied"]:
        return f"calibrated from {runs}{where}"
    kind = "emulated" if note["emulate"] else "real (not emulated)"
    return f"calibration{where} not applied: it was fitted on {kind} runs ({runs})"


def apply_factors(model: DeviceModel, factors: DeviceFactors | None) -> DeviceModel:
    """`model` with its rates scaled by `factors`."""
    if factors is None or factors == DeviceFactors():
        return model
    block = model.block_overhead_s
    return replace(model, gemm_efficiency=model.gemm_efficiency * factors.gemm,
                   hbm_gb_per_s=model.hbm_gb_per_s * factors.memory,
                   launch_overhead_s=model.launch_overhead_s * factors.overhead,
                   block_overhead_s=None if block is None else (block[0] * factors.overhead,
                                                                block[1] * factors.overhead),
                   tp_block_overhead_s=tuple(v * factors.overhead for v in model.tp_block_overhead_s),
                   tp_comm_efficiency=model.tp_comm_efficiency * factors.tp_comm,
                   dp_comm_efficiency=model.dp_comm_efficiency * factors.dp_comm)


def calibration_document(calibration: Calibration) -> dict:
    """Plain data in the calibration file's schema."""
    doc: dict = {"version": CALIBRATION_VERSION, "emulate": calibration.emulate, "num_runs": calibration.num_runs,
                 "device_types": {name: f.to_dict() for name, f in sorted(calibration.factors.items())}}
    doc["not_pinned_down"] = list(calibration.not_pinned_down)
    doc["runs"] = [dict(r) for r in calibration.runs]
    return doc


def save_calibration(calibration: Calibration, path: str | os.PathLike) -> None:
    """Write the calibration file that `cluster.calibration` and `plan --calibration` read."""
    text = dump_yaml(calibration_document(calibration), sort_keys=False, default_flow_style=None, width=120)
    Path(path).write_text("# written by `heteroflow calibrate`; use it with `cluster.calibration: FILE`\n" + text,
                          encoding="utf-8")


def load_calibration(path: str | os.PathLike, *, device_types: Iterable[str]) -> Calibration:
    """Read a calibration file, checked strictly; `device_types` are the names it may use (the job's cluster
    and the catalog). Every problem is reported with its path."""
    known = list(device_types)
    problems = Problems(str(path))
    sec = Section(read_yaml(path), "", problems)
    version = sec.integer("version", minimum=1)
    if version is not None and version > CALIBRATION_VERSION:
        problems.add("version", f"version {version} is newer than this heteroflow reads ({CALIBRATION_VERSION}); "
                                "upgrade heteroflow")
    emulate = sec.boolean("emulate", False)
    num_runs = sec.integer("num_runs", minimum=1)
    factors: dict[str, DeviceFactors] = {}
    types = sec.mapping("device_types")
    if types is not None:
        for name in list(types.data):
            entry = types.mapping(str(name))
            if entry is None:
                continue
            if str(name) not in known:
                problems.add(entry.path, f"unknown device type {str(name)!r}" + device_type_hint(str(name), known))
            values = {f: entry.number(f, 1.0, minimum=FACTOR_LIMIT[0], maximum=FACTOR_LIMIT[1]) for f in FACTORS}
            entry.finish()
            if all(v is not None and math.isfinite(v) for v in values.values()):
                factors[str(name)] = DeviceFactors(**values)
        types.finish()
    pinned = sec.raw("not_pinned_down", [])
    runs = sec.raw("runs", [])
    if not isinstance(pinned, list) or not all(isinstance(p, str) for p in pinned):
        problems.add("not_pinned_down", "expected a list of DEVICE_TYPE.factor names")
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        problems.add("runs", "expected a list of mappings (one per run)")
    sec.finish()
    problems.raise_if_any()
    assert num_runs is not None and emulate is not None
    return Calibration(factors=factors, num_runs=num_runs, emulate=emulate, source=str(path),
                       not_pinned_down=tuple(pinned), runs=tuple(runs))
