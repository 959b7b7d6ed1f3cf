"""The work behind `heteroflow plan` (the CLI only parses arguments)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from heteroflow.errors import UserError
from heteroflow.stagemap.profile import Profile


def print_json(data: object) -> None:
    """Write `data` to stdout as indented JSON (floats as numbers)."""
    json.dump(data, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")


def plan_command(*, job_path: str, output: str | None = None, as_json: bool = False, gantt: str | None = None,
                 evaluate: str | None = None, profile_path: str | None = None, emulate: bool = False,
                 max_micro_batch_size: int | None = None, calibration_path: str | None = None,
                 profile: Profile | None = None) -> int:
    """Search (or, with `evaluate`, estimate) a plan for a job; print a table or JSON; write files.

    The search covers every layout the cost model prices, all of which `heteroflow train` runs (`RUNTIME_LAYOUTS`).
    `calibration_path` (default: the job's
    `cluster.calibration`) scales the cost model's rates with fitted factors. `profile`: priced from it when
    `profile_path` is not given (default: the job's `cluster.profile`).
    """
    from heteroflow.config import load_job, load_plan_file
    from heteroflow.config.catalog import CATALOG
    from heteroflow.stagemap.calibration import load_calibration
    from heteroflow.stagemap import RUNTIME_LAYOUTS, evaluate_plan, search_plan
    from heteroflow.stagemap.profile import load_profile
    from heteroflow.stagemap.report import format_estimate, format_report

    job = load_job(job_path)
    profile = load_profile(profile_path) if profile_path else profile
    calibration = (load_calibration(calibration_path, device_types=[*job.cluster.device_types, *CATALOG])
                   if calibration_path else None)
    if evaluate is not None:
        if evaluate == "":
            if job.plan is None:
                raise UserError(f"{job_path} has `plan: auto`; give a plan file: --evaluate PLAN.yaml")
            plan, source = job.plan, f"{job_path} (plan:)"
        else:
            plan, source = load_plan_file(evaluate, job), evaluate
        estimate = evaluate_plan(job, plan, profile=profile, emulate=emulate, calibration=calibration)
        if as_json:
            print_json(estimate.to_json())
        else:
            print(format_estimate(estimate, f"estimate of {source}"))
        _write_outputs(estimate, output, gantt)
        return 0 if estimate.feasible else 1
    if emulate:
        raise UserError("--emulate prices an explicit plan: use it with --evaluate")
    options = RUNTIME_LAYOUTS
    if max_micro_batch_size is not None:
        options = replace(options, max_micro_batch_size=max_micro_batch_size)
    report = search_plan(job, profile=profile, options=options, calibration=calibration)
    if as_json:
        print_json(report.to_json())
    else:
        print(format_report(report))
    if report.estimate is None:
        return 1
    _write_outputs(report.estimate, output, gantt)
    return 0


def _write_outputs(estimate, output: str | None, gantt: str | None) -> None:
    if output:
        from heteroflow.stagemap.planfile import write_plan
        write_plan(estimate, output)
        print(f"wrote {output}", file=sys.stderr)
    if gantt:
        from heteroflow.stagemap.gantt import draw_gantt
        draw_gantt(estimate, gantt)
        print(f"wrote {gantt}", file=sys.stderr)
