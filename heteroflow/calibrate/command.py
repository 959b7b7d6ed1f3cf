"""The work behind `heteroflow calibrate` (the CLI only parses arguments)."""

from __future__ import annotations

import json
import sys

from heteroflow.calibrate.fit import PRIOR_WEIGHT, Fit, fit_calibration
from heteroflow.calibrate.runs import load_runs
from heteroflow.config import load_job
from heteroflow.stagemap.calibration import FACTORS, calibration_document, save_calibration


def calibrate_command(*, job_path: str, run_paths: list[str], output: str | None = None, as_json: bool = False,
                      factors: tuple[str, ...] = FACTORS, prior_weight: float = PRIOR_WEIGHT,
                      stage_parts: bool = False) -> int:
    """Fit the factors of `job_path`'s device types to the runs (`stage_parts`: also their stages' measured
    parts); print a report (or JSON); write `output`."""
    job = load_job(job_path)
    runs, notes = load_runs(job, run_paths)
    fit = fit_calibration(runs, factors=factors, prior_weight=prior_weight, stage_parts=stage_parts)
    if as_json:
        doc = calibration_document(fit.calibration)
        doc["sensitivity"] = dict(zip(fit.params, fit.sensitivity))
        doc["resolution"] = dict(zip(fit.params, fit.resolution))
        doc["notes"] = notes
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_fit(fit, notes))
    if output:
        save_calibration(fit.calibration, output)
        print(f"wrote {output}", file=sys.stderr)
    return 0


def format_fit(fit: Fit, notes: list[str]) -> str:
    """The factors per device type, each run's predicted/measured before and after, what is not pinned down."""
    cal = fit.calibration
    kind = "emulated" if cal.emulate else "real"
    lines = [f"calibrated from {cal.num_runs} {kind} run{'s' * (cal.num_runs != 1)}"]
    width = max(len("device type"), *(len(d) for d in cal.factors))
    lines.append(f"{'device type':<{width}}  " + "  ".join(f"{f:>8}" for f in FACTORS))
    for name, factors in sorted(cal.factors.items()):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{getattr(factors, f):8.3f}" for f in FACTORS))
    source_width = max(len("run"), *(len(r["source"]) for r in cal.runs))
    lines.append(f"{'run':<{source_width}}  {'measured s':>10}  {'predicted s':>11}  {'pred/meas':>9}  "
                 f"{'calibrated s':>12}  {'pred/meas':>9}")
    for r in cal.runs:
        lines.append(f"{r['source']:<{source_width}}  {r['measured_step_time_s']:10.4g}  "
                     f"{r['predicted_before_s']:11.4g}  {r['ratio_before']:9.3f}  {r['predicted_after_s']:12.4g}  "
                     f"{r['ratio_after']:9.3f}")
    if cal.not_pinned_down:
        shown = [f"{n} (sensitivity {s:.2g})" for n, s, r in zip(fit.params, fit.sensitivity, fit.resolution)
                 if n in cal.not_pinned_down]
        lines.append("not pinned down by these runs (kept near 1.0, the uncalibrated model): " + ", ".join(shown))
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
