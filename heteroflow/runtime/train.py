"""`heteroflow train`: choose the plan, prepare the data, launch one worker per device, collect results."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from heteroflow.config import JobConfig, PlanSpec, load_plan_file
from heteroflow.errors import UserError
from heteroflow.runtime.launch import LaunchSpec, launch
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
    resume: bool = False
    """Continue from the newest complete checkpoint in train.checkpoint.dir (step 0 when there is none)."""


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
    if not report.feasible:
        problems = report.estimate.problems if report.estimate is not None else ["no layout fits"]
        raise UserError("the planner found no plan that fits this cluster; `heteroflow plan` explains why:\n"
                        + "\n".join(problems))
    return report.plan


def predicted_step_time(job: JobConfig, plan: PlanSpec, *, emulate: bool) -> float | None:
    """The cost model's step time for this plan (emulated runs priced as local CPU processes sharing
    this machine's cores); None when the cost model finds the plan infeasible."""
    from heteroflow.stagemap import evaluate_plan
    estimate = evaluate_plan(job, plan, emulate=emulate)
    return estimate.step_time_s if estimate.feasible else None


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
    if any(stage.offload.any for stage in plan.stages):
        raise UserError("offload tiers are not run by the runtime yet; remove the stages' offload settings")
    if any(stage.zero == 3 for stage in plan.stages):
        raise UserError("ZeRO-3 is not run by the runtime yet; use zero: 0, 1 or 2")
    if not options.emulate:
        check_local_devices(job, plan)
    steps = options.steps if options.steps is not None else job.train.steps
    from heteroflow.runtime.checkpoint import prepare_resume
    resume_note = prepare_resume(job, resume=options.resume)
    data_dir = cache_dir() / "data"
    # Open (and for the built-in corpus, write) the data here: bad data is a user error before any launch.
    from heteroflow.data.builtin import open_train_data
    open_train_data(job, work_dir=data_dir)
    args = WorkerArgs(job=job, plan=plan, emulate=options.emulate, steps=steps, data_dir=str(data_dir),
                      metrics_path=os.path.abspath(options.metrics_path) if options.metrics_path else None,
                      predicted_step_time_s=predicted_step_time(job, plan, emulate=options.emulate),
                      timeout_s=options.timeout_s, resume=options.resume)
    print(f"heteroflow: {len(plan.stages)} stages on {plan.num_devices} "
          f"{'emulated ' if options.emulate else ''}devices, {plan.schedule}, {steps} steps", flush=True)
    if resume_note:
        print(f"heteroflow: {resume_note}", flush=True)
    return launch(LaunchSpec(num_processes=plan.num_devices, log_dir=options.log_dir), run_worker, args)
