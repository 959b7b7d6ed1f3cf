"""`search_plan`: the planner's entry point, with baselines and explanations."""

from __future__ import annotations

from time import perf_counter

from heteroflow.config.job import JobConfig
from heteroflow.stagemap.baselines import megatron_uniform
from heteroflow.stagemap.calibration import Calibration
from heteroflow.stagemap.estimate import (UNCALIBRATED, PlanEstimate, evaluate_plan, job_hardware, resolve_calibration,
                                          resolve_profile)
from heteroflow.stagemap.hardware import Hardware
from heteroflow.stagemap.explain import explain_infeasible
from heteroflow.stagemap.profile import Profile
from heteroflow.stagemap.report import Baseline, PlanReport
from heteroflow.stagemap.search import run_search
from heteroflow.stagemap.space import SearchOptions, stage_precisions


def search_plan(job: JobConfig, *, profile: Profile | None = None, options: SearchOptions | None = None,
                calibration: Calibration | None = None) -> PlanReport:
    """Find the plan with the highest predicted throughput for `job` (its `plan:` section is ignored).

    Every stage computes in `train.precision` unless its device type cannot (`space.stage_precisions`): then
    it gets the precision of the fastest plan among those the type supports, written in the plan.
    The result holds the best plan's estimate, the `megatron_uniform` and `best_single_type` baselines and
    the search time; when nothing fits, `problems` explains which device type lacks how much memory;
    `notes` names the device types whose precision differs from `train.precision` or that were left out.
    `calibration` (default: the job's `cluster.calibration`) scales the device rates everywhere.
    """
    options = options or SearchOptions()
    start = perf_counter()
    profile = resolve_profile(job, profile)
    calibration = resolve_calibration(job, calibration)
    hardware = job_hardware(job, profile, calibration=calibration)
    calibration = calibration or UNCALIBRATED  # resolved once: the estimates below must not read the file again
    result = run_search(job, hardware, options)
    uniform = megatron_uniform(job, hardware, options)
    best = result.best
    if options.include_megatron and not isinstance(uniform, str) and (best is None or uniform[0] < best[0]):
        best = uniform  # the uniform plan can lie outside the template space (stages spanning node parts)
    single = min(result.per_type.values(), key=lambda v: v[0], default=None)
    elapsed = perf_counter() - start
    def estimate_of(plan):
        return evaluate_plan(job, plan, profile=profile, calibration=calibration)

    estimate = estimate_of(best[1]) if best is not None else None
    baselines = {
        "megatron_uniform": Baseline(name="megatron_uniform", reason=uniform if isinstance(uniform, str) else "",
                                     estimate=None if isinstance(uniform, str) else estimate_of(uniform[1])),
        "best_single_type": Baseline(name="best_single_type", reason="" if single else "no single device type fits",
                                     estimate=estimate_of(single[1]) if single else None),
    }
    problems = () if estimate is not None else tuple(explain_infeasible(job, hardware))
    stats = {"templates": result.templates, "templates_solved": result.solved}
    note = calibration.note(emulate=False) if calibration.num_runs else None
    return PlanReport(estimate=estimate, baselines=baselines, search_time_s=elapsed, problems=problems,
                      notes=tuple(precision_notes(job, hardware)), stats=stats, calibration=note)


def precision_notes(job: JobConfig, hardware: Hardware) -> list[str]:
    """One line per device type of the cluster that cannot train in `train.precision`: the precisions its
    stages may get instead, or that it is left out."""
    notes = []
    for device_type in sorted({n.device for n in job.cluster.nodes}):
        if hardware.device(device_type, job.train.precision) is not None:
            continue
        others = stage_precisions(job, hardware, device_type)
        if others:
            notes.append(f"{device_type} cannot train in {job.train.precision} (train.precision): its stages "
                         f"compute in {' or '.join(others)}, whichever gives the faster plan")
        else:
            notes.append(f"{device_type} cannot train in any precision: its nodes are left out")
    return notes


def search_top_plans(job: JobConfig, top_k: int, *, profile: Profile | None = None,
                     options: SearchOptions | None = None, calibration: Calibration | None = None) -> list[PlanEstimate]:
    """The `top_k` plans with the highest predicted throughput (fewer when fewer exist), fastest first: the
    best plan of each of the best templates and micro-batch sizes, and the `megatron_uniform` plan when it
    is among them. `calibration` (default: the job's `cluster.calibration`) scales the device rates."""
    options = options or SearchOptions()
    profile = resolve_profile(job, profile)
    calibration = resolve_calibration(job, calibration)
    hardware = job_hardware(job, profile, calibration=calibration)
    found = run_search(job, hardware, options, top_k=top_k).top
    uniform = megatron_uniform(job, hardware, options) if options.include_megatron else "not asked"
    if not isinstance(uniform, str) and all(plan.to_dict() != uniform[1].to_dict() for _, plan in found):
        found = sorted([*found, uniform], key=lambda v: v[0])[:top_k]
    return [evaluate_plan(job, plan, profile=profile, calibration=calibration or UNCALIBRATED) for _, plan in found]
