"""`heteroflow train`: choose the plan, prepare the data, launch one worker per device, collect results.

One machine runs every rank of the plan (or, with `node`/`rdzv`, the ranks of one node of a multi-node
run: `heteroflow.launcher.multinode`).
"""

from __future__ import annotations

from heteroflow.config import JobConfig
from heteroflow.data.builtin import open_train_data
from heteroflow.launcher.launch import LaunchSpec, launch
from heteroflow.launcher.multinode import run_node
from heteroflow.launcher.placement import declared_environment, plan_nodes
from heteroflow.launcher.prepare import (TrainOptions, cache_dir, calibration_line, check_local_devices,
                                         choose_plan, prepare_resume, tensorboard_dir, worker_args)
from heteroflow.launcher.swap import check_swap_space, sweep_swap
from heteroflow.models.hf_checkpoint import check_init_from
from heteroflow.runtime.tensorboard import require_tensorboard
from heteroflow.runtime.worker import WorkerResult, run_worker


def train_job(job: JobConfig, options: TrainOptions) -> dict[int, WorkerResult]:
    """Run the training job (on this node's ranks with `options.node`); returns each local rank's
    `WorkerResult` by plan rank."""
    check_init_from(job)  # config.json and the index only: a bad directory stops here, before the planner
    if tensorboard_dir(job, options):
        require_tensorboard("--tensorboard-dir" if options.tensorboard_dir else "train.tensorboard_dir")
    plan = choose_plan(job, options.plan_path)
    # Open (and for the built-in corpus, write) the data here: bad data is a user error before any launch.
    open_train_data(job, work_dir=cache_dir() / "data")
    resume_note = prepare_resume(job, resume=options.resume)
    if resume_note:
        print(f"heteroflow: {resume_note}", flush=True)
    calibrated = calibration_line(job, emulate=options.emulate)
    if calibrated:
        print(f"heteroflow: {calibrated}", flush=True)
    # The ranks on this machine (all of them, or this node's) put their swap files under one root.
    swap_root = check_swap_space(job, plan, node=options.node)
    try:
        if options.node is not None or options.rdzv is not None:
            return run_node(job, plan, options)
        if not options.emulate:
            check_local_devices(job, plan)
        args = worker_args(job, plan, options)
        print(f"heteroflow: {len(plan.stages)} stages on {plan.num_devices} "
              f"{'emulated ' if options.emulate else ''}devices, {plan.schedule}, {args.steps} steps", flush=True)
        env, conflicts = declared_environment(job, plan_nodes(plan))  # the cluster YAML's env, as on a node
        for line in conflicts:
            print(f"heteroflow: --emulate runs every node's ranks on this machine: {line}", flush=True)
        spec = LaunchSpec(num_processes=plan.num_devices, log_dir=options.log_dir, max_restarts=options.max_restarts,
                          env=env, stop_grace_s=options.stop_grace_s)
        return launch(spec, run_worker, args)
    finally:
        sweep_swap(swap_root)  # swap directories of ranks killed before they could remove their own
