"""Before any worker starts: the run's options, its plan, and every check that can fail on this machine
(devices, runnable layouts, resumable checkpoints), so that a bad run stops with a `UserError` at once.

Used by the single-node entry (`heteroflow.launcher.train`) and by each node's agent
(`heteroflow.launcher.multinode`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from heteroflow.checkpoint.files import complete_checkpoints
from heteroflow.checkpoint.meta import check_model, read_metadata
from heteroflow.checkpoint.verify import checkpoint_to_resume
from heteroflow.config import JobConfig, PlanSpec, load_plan_file
from heteroflow.errors import UserError
from heteroflow.launcher.signals import DEFAULT_STOP_GRACE_S
from heteroflow.runtime.checkpoint import checkpoint_root
from heteroflow.runtime.worker import WorkerArgs


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """Command-line choices for one training run."""

    plan_path: str | None = None
    emulate: bool = False
    steps: int | None = None
    metrics_path: str | None = None
    log_dir: str | None = None
    timeout_s: float = 600.0
    """Step limit: the watchdog reports a rank stuck in one step this long; collectives time out a little later."""
    max_restarts: int = 0
    """Times the elastic agents restart every worker after a failure (from the newest checkpoint)."""
    node: str | None = None
    """Multi-node: the node this machine is (`--node`); None runs every rank here."""
    rdzv: str | None = None
    """Multi-node: HOST:PORT where the node agents meet (`--rdzv`)."""
    join_timeout_s: float = 300.0
    """Multi-node: how long nodes wait for each other, at the start and after a restart."""
    replan_on_failure: bool = False
    """Multi-node: when the run fails and nodes are gone for good, plan again on the others and resume."""
    rejoin_timeout_s: float | None = None
    """Multi-node: how long survivors wait for each other after a failure; None: timeout_s + join_timeout_s."""
    resume: bool = False
    """Continue from the newest complete checkpoint in train.checkpoint.dir (step 0 when there is none)."""
    tensorboard_dir: str | None = None
    """`--tensorboard-dir`: overrides train.tensorboard_dir."""
    stop_grace_s: float = DEFAULT_STOP_GRACE_S
    """After SIGTERM or SIGINT, how long the ranks have to finish their step and save before they are killed."""


def cache_dir() -> Path:
    """Where heteroflow keeps generated files (the built-in corpus's token file)."""
    return Path(os.environ.get("HETEROFLOW_CACHE", Path.home() / ".cache" / "heteroflow"))


def choose_plan(job: JobConfig, plan_path: str | None) -> PlanSpec:
    """`--plan FILE`, else the job's explicit plan, else the planner's best plan."""
    if plan_path is not None:
        return load_plan_file(plan_path, job)
    if job.plan is not None:
        return job.plan
    return search_plan_or_fail(job)


def search_plan_or_fail(job: JobConfig) -> PlanSpec:
    """The planner's best plan for `job` among the layouts this runtime runs (`RUNTIME_LAYOUTS`), or a
    `UserError` when none fits."""
    try:
        from heteroflow.stagemap import RUNTIME_LAYOUTS, search_plan
    except ImportError:
        raise UserError("`plan: auto` needs the planner, but this build has no planner (heteroflow.stagemap); "
                        "write the plan in the job's `plan:` or pass --plan PLAN.yaml") from None
    report = search_plan(job, options=RUNTIME_LAYOUTS)
    if not report.feasible:
        problems = report.estimate.problems if report.estimate is not None else ["no layout fits"]
        raise UserError("the planner found no plan that fits this cluster; `heteroflow plan` explains why:\n"
                        + "\n".join(problems))
    return report.plan


def predicted_times(job: JobConfig, plan: PlanSpec, *, emulate: bool
                    ) -> tuple[float | None, tuple[dict[str, float], ...] | None]:
    """The cost model's step time for this plan (emulated runs priced as local CPU processes sharing this
    machine's cores, from the job's `cluster.profile` or else this host's cached quick profile) and, per stage,
    its parts of it with `step_s`; (None, None) when the cost model finds the plan infeasible."""
    from heteroflow.stagemap import evaluate_plan
    profile = None
    if emulate:  # without the job's `cluster.profile`, this host's cached quick profile (measure/host.py)
        from heteroflow.measure.host import emulation_profile
        profile = emulation_profile(job, cache_dir())
    estimate = evaluate_plan(job, plan, emulate=emulate, profile=profile)
    if not estimate.feasible:
        return None, None
    stages = tuple({**s.times.to_dict(), "step_s": estimate.step_time_s} for s in estimate.stages if s.times)
    return estimate.step_time_s, stages


def calibration_line(job: JobConfig, *, emulate: bool) -> str | None:
    """What `train` says about the job's `cluster.calibration` (read and checked here, before any launch), or
    None when the job names none."""
    if not job.cluster.calibration:
        return None
    from heteroflow.stagemap.calibration import describe_note
    from heteroflow.stagemap.estimate import resolve_calibration
    calibration = resolve_calibration(job, None)
    assert calibration is not None
    return "predicted step time " + describe_note(calibration.note(emulate=emulate))


def check_local_devices(job: JobConfig, plan: PlanSpec, node_name: str | None = None) -> None:
    """Without --emulate, this machine must hold the plan's devices of one node (`node_name`, or the plan's
    only node): its vendor, enough of them."""
    from heteroflow.devices.probe import probe_local_devices
    nodes = sorted({ref.node for stage in plan.stages for ref in stage.device_refs})
    if node_name is None and len(nodes) > 1:
        raise UserError(f"the plan spans {len(nodes)} nodes ({', '.join(nodes)}); run `heteroflow train JOB --node "
                        "NAME --rdzv HOST:PORT` on each of them, or use --emulate to run every rank here as a CPU "
                        "process")
    node = job.cluster.node(node_name or nodes[0])
    vendor = job.cluster.device_types[node.device].vendor
    found = [d for d in probe_local_devices() if d.vendor == vendor]
    needed = max(ref.index for stage in plan.stages for ref in stage.device_refs if ref.node == node.name) + 1
    if vendor != "cpu" and len(found) < needed:
        raise UserError(f"the plan needs {needed} {vendor} devices on node {node.name!r} but this machine has "
                        f"{len(found)}; run with --emulate to emulate them as CPU processes")


def prepare_resume(job: JobConfig, *, resume: bool) -> str | None:
    """Before launching: check that the run can start as asked; returns a line to show, or None.

    `--resume` needs `train.checkpoint`; it continues from the newest intact checkpoint (every file's checksum
    verified; damaged ones are reported and moved aside; its model must be the job's), or starts at step 0
    when there is none yet. Without `--resume`, a directory
    that already holds checkpoints is refused, so a fresh run never mixes with an older one.
    """
    root = checkpoint_root(job)
    if root is None:
        if resume:
            raise UserError("--resume needs a checkpoint directory: add `train.checkpoint: {dir: PATH, interval: "
                            "STEPS, keep: N}` to the job")
        return None
    found = complete_checkpoints(root)
    if not resume:
        if found:
            raise UserError(f"train.checkpoint.dir {root} already holds checkpoints (newest: {found[-1][1].name}); "
                            "pass --resume to continue from it, or use an empty directory for a fresh run")
        return None
    # verified before any worker starts: a damaged newest checkpoint is reported and moved aside
    step_dir = checkpoint_to_resume(root, report=lambda line: print(f"heteroflow: {line}", flush=True))
    if step_dir is None:
        return f"no complete checkpoint in {root}: starting at step 0"
    step = int(step_dir.name.split("-")[1])
    meta = read_metadata(step_dir)
    check_model(step_dir, meta, job.model.to_dict())
    stages = len(meta.get("plan", {}).get("stages", ()))
    return f"resuming from {step_dir} (step {step}, written by a {stages}-stage plan)"


def worker_args(job: JobConfig, plan: PlanSpec, options: TrainOptions, *, resume: bool = False) -> WorkerArgs:
    """What every worker of `plan` gets."""
    step_time_s, stage_times = predicted_times(job, plan, emulate=options.emulate)
    return WorkerArgs(job=job, plan=plan, emulate=options.emulate, steps=steps_of(job, options),
                      data_dir=str(cache_dir() / "data"),
                      metrics_path=os.path.abspath(options.metrics_path) if options.metrics_path else None,
                      tensorboard_dir=tensorboard_dir(job, options),
                      predicted_step_time_s=step_time_s, predicted_stages=stage_times,
                      timeout_s=options.timeout_s, resume=resume or options.resume)


def tensorboard_dir(job: JobConfig, options: TrainOptions) -> str | None:
    """`--tensorboard-dir`, else train.tensorboard_dir (relative to the job file), as an absolute path; or None."""
    if options.tensorboard_dir:
        return os.path.abspath(options.tensorboard_dir)
    if job.train.tensorboard_dir:
        return os.path.abspath(job.resolve_path(job.train.tensorboard_dir))
    return None


def steps_of(job: JobConfig, options: TrainOptions) -> int:
    """`--steps`, else train.steps."""
    return options.steps if options.steps is not None else job.train.steps
