"""`PlanReport` (the planner's answer) and the text tables `heteroflow plan` prints."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from heteroflow.stagemap.calibration import describe_note
from heteroflow.stagemap.estimate import PlanEstimate


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    """One baseline: its estimate, or why it does not exist."""

    name: str
    estimate: PlanEstimate | None
    reason: str = ""

    def to_json(self) -> dict:
        if self.estimate is None:
            return {"feasible": False, "tokens_per_s": 0.0, "reason": self.reason}
        e = self.estimate
        out = {"feasible": e.feasible, "tokens_per_s": e.tokens_per_s, "step_time_s": e.step_time_s, "mfu": e.mfu,
               "bubble_fraction": e.bubble_fraction, "schedule": e.plan.schedule,
               "micro_batch_size": e.plan.micro_batch_size, "num_devices": e.plan.num_devices,
               "stages": [{"device_type": s.device_type, "num_devices": s.num_devices, "layers": list(s.layers),
                           "tp": s.layout.tp, "dp": s.layout.dp, "ep": s.layout.ep, "etp": s.layout.expert_tp,
                           "precision": s.precision} for s in e.stages]}
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """The best plan found, its estimate, the baselines and how long the search took."""

    estimate: PlanEstimate | None
    baselines: dict[str, Baseline]
    search_time_s: float
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """What the search changed or left out, one line each (device types that cannot train in
    `train.precision` and get another precision; device types that can train in none)."""
    stats: dict = field(default_factory=dict)
    calibration: dict | None = None
    """`Calibration.note` of the calibration the search used (None: uncalibrated)."""

    @property
    def feasible(self) -> bool:
        return self.estimate is not None and self.estimate.feasible

    @property
    def plan(self):
        """The best `PlanSpec` (None when nothing fits)."""
        return self.estimate.plan if self.estimate is not None else None

    def to_json(self) -> dict:
        """The plan JSON of the CLI contract."""
        if self.estimate is not None:
            out = self.estimate.to_json()
        else:
            out = {"feasible": False, "step_time_s": None, "tokens_per_s": 0.0, "mfu": 0.0, "stages": []}
        out["search_time_s"] = self.search_time_s
        out["baselines"] = {name: b.to_json() for name, b in self.baselines.items()}
        if self.problems:
            out["problems"] = list(self.problems)
        if self.notes:
            out["notes"] = list(self.notes)
        if self.stats:
            out["search"] = dict(self.stats)
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 100 else f"{seconds * 1e3:.0f}"


def format_estimate(e: PlanEstimate, title: str) -> str:
    """A table per stage and the plan's figures."""
    head = ("stage", "devices", "device type", "layers", "layout", "precision", "mem GiB peak/cap", "fwd ms",
            "bwd ms")
    rows = []
    for s in e.stages:
        devices = ",".join(s.devices)
        if len(devices) > 28:
            devices = devices[:25] + "..."
        rows.append((str(s.index), f"{s.num_devices} ({devices})", s.device_type, f"{s.layers[0]}-{s.layers[1] - 1}",
                     replace(s.layout, precision=None).describe(), s.precision,
                     f"{s.memory_peak_gib:.1f}/{s.memory_capacity_gib:.0f}"
                     + ("" if s.fits else " !"), _ms(s.forward_s), _ms(s.backward_s)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [title, fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    lines.append(f"schedule {e.plan.schedule}, micro-batch {e.plan.micro_batch_size} x {e.num_micro_batches}, "
                 f"{e.plan.num_devices} devices, bubble {e.bubble_fraction:.1%}")
    lines.append(f"step {e.step_time_s:.3f} s, {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}"
                 + (" (emulated on this machine)" if e.emulate else ""))
    lines += alltoall_lines(e)
    if e.calibration is not None:
        lines.append(describe_note(e.calibration))
    for problem in e.problems:
        lines.append(f"does not fit: {problem}")
    return "\n".join(lines)


def alltoall_lines(e: PlanEstimate) -> list[str]:
    """For a MoE plan, per stage with expert parallelism, the step time its token all-to-alls take."""
    return [f"stage {s.index} ep {s.layout.ep}: all-to-all {s.times.alltoall_s:.3f} s of the "
            f"{e.step_time_s:.3f} s step ({s.times.alltoall_s / e.step_time_s:.1%}; tokens to and from the experts "
            f"of the other ep ranks, forward and backward)"
            for s in e.stages if s.layout.ep > 1 and s.times is not None and e.step_time_s > 0]


def format_baselines(baselines: dict[str, Baseline], reference: PlanEstimate | None) -> str:
    """One line per baseline, with the plan's speed-up over it."""
    lines = ["baselines:"]
    for name, b in baselines.items():
        if b.estimate is None:
            lines.append(f"  {name}: none ({b.reason})")
            continue
        e = b.estimate
        shape = " + ".join(f"{s.num_devices} x {s.device_type} tp{s.layout.tp} dp{s.layout.dp}"
                           + (f" ep{s.layout.ep}" if s.layout.ep > 1 else "")
                           + (f" {s.layout.precision}" if s.layout.precision else "") for s in e.stages[:4])
        if len(e.stages) > 4:
            shape += f" + {len(e.stages) - 4} more stages"
        gain = f", plan is {reference.tokens_per_s / e.tokens_per_s:.2f}x" if reference is not None and e.tokens_per_s else ""
        lines.append(f"  {name}: step {e.step_time_s:.3f} s, {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}"
                     f"{gain} ({len(e.stages)} stages, mb {e.plan.micro_batch_size}: {shape})")
    return "\n".join(lines)


def format_report(report: PlanReport) -> str:
    """What `heteroflow plan` prints."""
    notes = [f"note: {n}" for n in report.notes]
    if report.estimate is None:
        lines = [f"no plan fits (searched in {report.search_time_s:.2f} s):"]
        lines += [f"  {p}" for p in report.problems]
        lines.append(format_baselines(report.baselines, None))
        if report.calibration is not None:
            lines.append(describe_note(report.calibration))
        return "\n".join(lines + notes)
    title = f"best plan (searched in {report.search_time_s:.2f} s)"
    return "\n".join([format_estimate(report.estimate, title), format_baselines(report.baselines, report.estimate),
                      *notes])
