"""`heteroflow train`: choose the plan, prepare the data, launch one worker per device, collect results."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from heteroflow.config import JobConfig, PlanSpec, load_plan_file
from heteroflow.errors import UserError
from heteroflow.runtime.launch import LaunchSpec, launch
from heteroflow.runtime.offload_step import check_offload_plan, check_swap_space, sweep_swap
from heteroflow.runtime.worker import WorkerArgs, WorkerResult, run_worker


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """Command-line choices for one training run."""

    plan_path: str | None = None
    emulate: bool = False
    steps: int | None = None
    metrics_path: str | None = None
    log_dir: str | None = None
    timeout_s: float = 600.0


def cache_dir() -> Path:
    """Where heteroflow keeps generated files (the built-in corpus's token file)."""
    return Path(os.environ.get("HETEROFLOW_CACHE", Path.home() / ".cache" / "heteroflow"))


def choose_plan(job: JobConfig, plan_path: str | None) -> PlanSpec:
    """`--plan FILE`, else the job's explicit plan, else the planner's best plan."""
    if plan_path is not None:
        return load_plan_file(plan_path, job)
    if job.plan is not None:
        return job.plan
    from heteroflow.stagemap import search_plan
    report = search_plan(job)
    if not report.estimate.feasible:
        raise UserError("the planner found no plan that fits this cluster:\n" + "\n".join(report.estimate.problems))
    return report.plan


def predicted_step_time(job: JobConfig, plan: PlanSpec, *, emulate: bool) -> float | None:
    """The cost model's step time for this plan (emulated runs priced as local CPU processes)."""
    from heteroflow.stagemap import evaluate_plan
    try:
        estimate = evaluate_plan(job, plan, emulate=emulate)
    except TypeError:  # a cost model without emulation pricing: its figure would be for real devices
        return None if emulate else evaluate_plan(job, plan).step_time_s
    return estimate.step_time_s


def check_local_devices(job: JobConfig, plan: PlanSpec) -> None:
    """Without --emulate, this machine must hold the plan's devices (one node, its vendor, enough of them)."""
    from heteroflow.devices.probe import probe_local_devices
    nodes = sorted({ref.node for stage in plan.stages for ref in stage.device_refs})
    if len(nodes) > 1:
        raise UserError(f"the plan spans {len(nodes)} nodes ({', '.join(nodes)}); this command runs the ranks of one "
                        "machine: use --emulate to run every rank here as a CPU process")
    node = job.cluster.node(nodes[0])
    vendor = job.cluster.device_types[node.device].vendor
    found = [d for d in probe_local_devices() if d.vendor == vendor]
    needed = max(ref.index for stage in plan.stages for ref in stage.device_refs) + 1
    if vendor != "cpu" and len(found) < needed:
        raise UserError(f"the plan needs {needed} {vendor} devices on node {node.name!r} but this machine has "
                        f"{len(found)}; run with --emulate to emulate them as CPU processes")


def train_job(job: JobConfig, options: TrainOptions) -> dict[int, WorkerResult]:
    """Run the training job; returns each rank's `WorkerResult`."""
    plan = choose_plan(job, options.plan_path)
    if any(stage.cp != 1 for stage in plan.stages):
        raise UserError("context parallelism (cp > 1) is priced by the planner but not run by the runtime yet; "
                        "use cp: 1")
    check_offload_plan(plan)
    if any(stage.zero == 3 for stage in plan.stages):
        raise UserError("ZeRO-3 is not run by the runtime yet; use zero: 0, 1 or 2")
    if not options.emulate:
        check_local_devices(job, plan)
    steps = options.steps if options.steps is not None else job.train.steps
    data_dir = cache_dir() / "data"
    # Open (and for the built-in corpus, write) the data here: bad data is a user error before any launch.
    from heteroflow.data.builtin import open_train_data
    open_train_data(job, work_dir=data_dir)
    swap_root = check_swap_space(job, plan)  # every rank runs on this machine (one node, or --emulate)
    args = WorkerArgs(job=job, plan=plan, emulate=options.emulate, steps=steps, data_dir=str(data_dir),
                      metrics_path=os.path.abspath(options.metrics_path) if options.metrics_path else None,
                      predicted_step_time_s=predicted_step_time(job, plan, emulate=options.emulate),
                      timeout_s=options.timeout_s)
    print(f"heteroflow: {len(plan.stages)} stages on {plan.num_devices} "
          f"{'emulated ' if options.emulate else ''}devices, {plan.schedule}, {steps} steps", flush=True)
    try:
        return launch(LaunchSpec(num_processes=plan.num_devices, log_dir=options.log_dir), run_worker, args)
    finally:
        sweep_swap(swap_root)  # swap directories of ranks killed before they could remove their own
