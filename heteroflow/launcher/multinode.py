"""`heteroflow train JOB --node NAME --rdzv HOST:PORT`: this machine's share of a multi-node run.

Each node's agent
1. meets the others at HOST:PORT (`rendezvous.meet`): the roster must be exactly the plan's nodes, each
   once, all with the same job fingerprint, else every node stops with the same error;
2. starts its ranks through torch elastic's c10d rendezvous on the same store (`launch`), one worker
   per device of the plan on this node, with the node's environment (`placement.node_environment`); the
   agents restart every worker after a failure up to `--max-restarts` times, resuming from the newest
   checkpoint;
3. with `--replan-on-failure`, when the run has failed for good: meets the survivors; if nodes are
   missing (not back within the rejoin timeout), plans again on the nodes that remain and relaunches
   with resume. If every node is still there the failure was not a lost node and is reported as is.

The agent on the machine named by HOST hosts the store; it must outlive the run (as with torchrun), so
it is the node a replan cannot lose.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Callable

from heteroflow import __version__
from heteroflow.backends.rankmap import RankMap
from heteroflow.config import JobConfig, PlanSpec
from heteroflow.errors import UserError
from heteroflow.launcher.launch import LaunchSpec, TrainingFailed, launch
from heteroflow.launcher.placement import node_environment, node_ranks, plan_nodes
from heteroflow.launcher.prepare import (TrainOptions, check_local_devices, search_plan_or_fail,
                                         steps_of, worker_args)
from heteroflow.launcher.rendezvous import (MEETING_PREFIX, NodeEntry, check_roster, meet, open_store,
                                            parse_endpoint, plan_fingerprint)
from heteroflow.runtime.worker import WorkerResult, run_worker


def job_on_nodes(job: JobConfig, keep: list[str]) -> JobConfig:
    """`job` on the nodes named in `keep` only, with `plan: auto` (for the planner)."""
    nodes = tuple(n for n in job.cluster.nodes if n.name in keep)
    return replace(job, cluster=replace(job.cluster, nodes=nodes), plan=None)


def replan(job: JobConfig, keep: list[str]) -> PlanSpec:
    """The planner's plan for `job` on the nodes in `keep`; a `UserError` when none fits."""
    return search_plan_or_fail(job_on_nodes(job, keep))


def fingerprint(job: JobConfig, plan: PlanSpec, options: TrainOptions) -> str:
    """What every node must agree on: the job under this plan, the steps, emulation."""
    return plan_fingerprint(job.with_plan(plan).to_dict(), steps=steps_of(job, options), emulate=options.emulate,
                            version=__version__)


def local_problem(job: JobConfig, plan: PlanSpec, options: TrainOptions) -> str:
    """Why this machine cannot run its node's ranks, or ''."""
    if options.emulate or options.node not in plan_nodes(plan):
        return ""
    try:
        check_local_devices(job, plan, options.node)
    except UserError as error:
        return str(error)
    return ""


def run_node(job: JobConfig, plan: PlanSpec, options: TrainOptions, *,
             planner: Callable[[JobConfig, list[str]], PlanSpec] = replan,
             start: Callable[..., dict[int, Any]] = launch) -> dict[int, WorkerResult]:
    """Run this node's ranks of `plan` until the run ends; their results by plan rank (`start` and
    `planner` are replaceable for tests)."""
    if options.node is None or options.rdzv is None:
        raise UserError("a multi-node run needs both --node NAME and --rdzv HOST:PORT")
    host, port = parse_endpoint(options.rdzv)
    endpoint = f"{host}:{port}"
    store, hosting = open_store(host, port, timeout_s=options.join_timeout_s)
    rejoin_s = options.rejoin_timeout_s if options.rejoin_timeout_s is not None else \
        options.timeout_s + options.join_timeout_s
    attempt, resume = 0, False
    try:
        while True:
            nodes = plan_nodes(plan)
            if options.node not in nodes and attempt > 0:
                print(f"heteroflow: node {options.node} has no ranks in the new plan; it stays idle", flush=True)
                _wait_for_others(store, hosting, len(nodes), job, options)
                return {}
            key = f"run{attempt}"
            me = NodeEntry.here(options.node, fingerprint(job, plan, options), local_problem(job, plan, options))
            roster, index = meet(store, key, me, expected=len(nodes), timeout_s=options.join_timeout_s)
            check_roster(roster, endpoint=endpoint, plan_nodes=nodes, me=me, my_index=index,
                         timeout_s=options.join_timeout_s)
            try:
                return _start_node(job, plan, options, endpoint, key, resume=resume, start=start)
            except TrainingFailed as failure:
                if not options.replan_on_failure:
                    raise
                keep = _survivors(store, attempt, nodes, options, rejoin_s, failure)
                print(f"heteroflow: node{'s' * (len(nodes) - len(keep) > 1)} "
                      f"{', '.join(n for n in nodes if n not in keep)} did not come back within {rejoin_s:g} s; "
                      f"planning again on {', '.join(keep)}", flush=True)
                plan = planner(job, keep)
                job = job_on_nodes(job, keep).with_plan(plan)
                attempt, resume = attempt + 1, True
    finally:
        _finish(store, hosting)


def _start_node(job: JobConfig, plan: PlanSpec, options: TrainOptions, endpoint: str, key: str, *, resume: bool,
                start: Callable[..., dict[int, Any]]) -> dict[int, Any]:
    """Launch this node's workers of `plan` through the elastic agent."""
    placement = node_ranks(RankMap.from_plan(plan, job.cluster), options.node)
    num_nodes = len(plan_nodes(plan))
    print(f"heteroflow: node {options.node} of {num_nodes}: ranks {', '.join(map(str, placement.ranks))} of "
          f"{plan.num_devices} ({len(plan.stages)} stages, {plan.schedule}, {steps_of(job, options)} steps"
          f"{', emulated' if options.emulate else ''}{', resuming' if resume else ''})", flush=True)
    tee = placement.ranks.index(0) if 0 in placement.ranks else None  # rank 0 shows progress
    spec = LaunchSpec(num_processes=len(placement.ranks),
                      log_dir=os.path.join(options.log_dir, options.node) if options.log_dir else None,
                      max_restarts=options.max_restarts, rdzv_endpoint=endpoint, num_nodes=num_nodes,
                      run_id=f"heteroflow-{fingerprint(job, plan, options)}-{key}",
                      join_timeout_s=options.join_timeout_s, local_addr=job.cluster.node(options.node).host,
                      env=node_environment(job, plan, options.node, emulate=options.emulate),
                      rank_order=placement.ranks, tee_local_rank=tee, stop_grace_s=options.stop_grace_s)
    return start(spec, run_worker, worker_args(job, plan, options, resume=resume))


def _survivors(store: Any, attempt: int, nodes: list[str], options: TrainOptions, rejoin_s: float,
               failure: TrainingFailed) -> list[str]:
    """The plan's nodes still here after `failure`, or re-raise it when none is missing (or we cannot tell)."""
    me = NodeEntry.here(options.node, "")
    try:
        roster, index = meet(store, f"survivors{attempt}", me, expected=len(nodes), timeout_s=rejoin_s)
    except RuntimeError as error:  # the store's host is gone: nobody can meet any more
        raise TrainingFailed(f"{failure}\ncannot replan: the rendezvous store at {options.rdzv} is gone "
                             f"({type(error).__name__}); the node hosting it must stay up") from None
    names = [e.node for e in roster]
    if index >= len(roster):
        raise TrainingFailed(f"{failure}\nthe surviving nodes ({', '.join(names)}) replanned without this node "
                             f"({options.node}), which came back too late")
    keep = [n for n in nodes if n in names]
    if len(keep) == len(nodes):
        raise TrainingFailed(f"{failure}\nevery node is still here after the failure: not replanning")
    return keep


def _wait_for_others(store: Any, hosting: bool, num_nodes: int, job: JobConfig, options: TrainOptions) -> None:
    """An idle node that hosts the store keeps it up until the others finish: every step is bounded by the
    step limit, so the wait is bounded too."""
    if not hosting:
        return
    limit_s = options.join_timeout_s * 2 + steps_of(job, options) * options.timeout_s
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and store.add(f"{MEETING_PREFIX}/finished", 0) < num_nodes:
        time.sleep(0.5)


def _finish(store: Any, hosting: bool) -> None:
    """Say this node is finished; the host gives the others a moment (to read a roster, to pass elastic's
    exit barrier) before the store goes away with it."""
    try:
        finished = store.add(f"{MEETING_PREFIX}/finished", 1)
        joined = store.add(f"{MEETING_PREFIX}/run0/count", 0)
        deadline = time.monotonic() + 10.0
        while hosting and finished < joined and time.monotonic() < deadline:
            time.sleep(0.1)
            finished = store.add(f"{MEETING_PREFIX}/finished", 0)
    except RuntimeError:
        pass  # the store's host is gone already
