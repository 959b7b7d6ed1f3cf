"""The imported Megatron layout next to heteroflow's best plan on the same cluster (throughput, memory,
layout per stage), priced by the same cost model."""

from __future__ import annotations

from heteroflow.config import JobConfig


def _stage_lines(estimate) -> list[str]:
    lines = []
    for s in estimate.stages:
        layout = s.layout.describe()
        fits = "" if s.fits else "  DOES NOT FIT"
        lines.append(f"    stage {s.index}: {s.num_devices:>4} x {s.device_type:<16} layers {s.layers[0]:>3}-{s.layers[1] - 1:<3} "
                     f"{layout:<30} mem {s.memory_peak_gib:6.1f}/{s.memory_capacity_gib:.0f} GiB{fits}")
    return lines


def _summary(name: str, estimate) -> list[str]:
    if estimate is None:
        return [f"  {name}: none"]
    head = (f"  {name}: {estimate.tokens_per_s:,.0f} tokens/s, step {estimate.step_time_s:.3f} s, MFU "
            f"{100 * estimate.mfu:.1f}%, {estimate.plan.num_devices} devices, micro-batch {estimate.plan.micro_batch_size}"
            if estimate.feasible else f"  {name}: does not fit")
    return [head, *_stage_lines(estimate), *(f"    problem: {p}" for p in estimate.problems)]


def compare_with_planner(job: JobConfig) -> str:
    """A side-by-side text: the job's explicit (imported) plan and the planner's best plan for its cluster."""
    from heteroflow.stagemap import evaluate_plan, search_plan
    assert job.plan is not None, "an imported job carries the Megatron layout as its plan"
    imported = evaluate_plan(job, job.plan)
    report = search_plan(job.with_plan(None))
    lines = ["Megatron layout vs heteroflow's plan on this cluster (same cost model):"]
    lines += _summary("megatron (imported)", imported)
    lines += _summary("heteroflow (planned)", report.estimate)
    if imported.feasible and report.feasible and imported.tokens_per_s > 0:
        lines.append(f"  heteroflow / megatron: {report.estimate.tokens_per_s / imported.tokens_per_s:.2f}x tokens/s")
    return "\n".join(lines)
