"""Multi-node runs on loopback: each "node" is a separate `heteroflow train --node X --rdzv ... --emulate`
process on this machine. The plan puts ranks 0 and 3 on node a and 1, 2 on node b."""

from __future__ import annotations

import time

import pytest

from conftest import REPO

from heteroflow.config import parse_job
from heteroflow.launcher.launch import free_port
from heteroflow.runtime.metrics import read_step_records
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing import run_ranks
from multinode_helpers import job_dict, outputs, start_nodes, stop_all, wait_nodes, write_job

pytestmark = pytest.mark.slow

_REFERENCE: dict[str, list[float]] = {}


def _train_rank(rank: int, world_size: int, args: WorkerArgs):
    return run_worker(args)


def single_node_losses(data_dir: str) -> list[float]:
    """The same plan run on one node (every rank a local process): the losses to reproduce."""
    if "losses" not in _REFERENCE:
        job = parse_job(job_dict())
        args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=job.train.steps, data_dir=data_dir,
                          show_progress=False, timeout_s=120)
        _REFERENCE["losses"] = list(run_ranks(_train_rank, job.plan.num_devices, args, timeout_s=300)[0].losses)
    return _REFERENCE["losses"]


def metrics_losses(path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_step_records(path)]


@pytest.fixture
def job(tmp_path):
    return write_job(tmp_path / "job.yaml", job_dict())


def test_two_nodes_reproduce_the_single_node_losses(tmp_path, job):
    metrics = tmp_path / "metrics.jsonl"
    nodes = start_nodes(tmp_path, job, ["a", "b"], free_port(), "--metrics", str(metrics), "--timeout", "120",
                        "--join-timeout", "120")
    try:
        codes = wait_nodes(nodes, 400)
    finally:
        stop_all(nodes)
    assert codes == {"a": 0, "b": 0}, outputs(nodes)
    assert "node a of 2: ranks 0, 3 of 4" in nodes[0].output()
    assert "node b of 2: ranks 1, 2 of 4" in nodes[1].output()
    assert "done, 3 steps" in nodes[0].output() and "node b done (ranks 1, 2)" in nodes[1].output()
    want = single_node_losses(str(tmp_path / "cache" / "data"))
    assert [loss for _, loss in metrics_losses(metrics)] == want  # same ranks, same order: bit for bit


def test_node_naming_mismatch_is_a_clear_error_on_every_node(tmp_path, job):
    nodes = start_nodes(tmp_path, job, ["a", "bb"], free_port(), "--join-timeout", "120")
    try:
        codes = wait_nodes(nodes, 300)
    finally:
        stop_all(nodes)
    assert codes == {"a": 2, "bb": 2}, outputs(nodes)
    for node in nodes:
        text = node.output()
        assert "do not match the plan" in text and "Traceback" not in text, outputs(nodes)
        assert "node 'bb' joined, but the plan has no ranks on a node of that name (did you mean 'b'?)" in text
        assert "node 'b' of the plan did not join" in text
    # decided when both had arrived, not at the join timeout
    assert max(time.monotonic() - n.started for n in nodes) < 120


def test_killed_rank_is_restarted_and_the_run_completes(tmp_path, job):
    metrics = tmp_path / "metrics.jsonl"
    nodes = start_nodes(tmp_path, job, ["a", "b"], free_port(), "--metrics", str(metrics), "--max-restarts", "1",
                        "--timeout", "120", "--join-timeout", "120",
                        env={"a": {"HETEROFLOW_INJECT_FAULT": "kill@3:1"}})  # SIGKILL plan rank 3 at step 1
    try:
        codes = wait_nodes(nodes, 500)
    finally:
        stop_all(nodes)
    assert codes == {"a": 0, "b": 0}, outputs(nodes)
    assert "injected fault: kill rank 3 at step 1" in "".join(
        p.read_text() for p in (tmp_path / "logs" / "a").glob("*/attempt_0/*/stderr.log"))
    assert list((tmp_path / "logs" / "a").glob("*/attempt_1")), "the agent did not restart the workers"
    assert ("heteroflow: restart 1 of 1 (--max-restarts): a rank failed and every worker was started again; "
            "continuing from step 0 (the job has no train.checkpoint)") in nodes[0].output(), outputs(nodes)
    records = metrics_losses(metrics)
    # Without a checkpoint the restart trains from step 0 again: step 0 is logged by both attempts.
    assert [s for s, _ in records][:1] == [0] and [s for s, _ in records][-3:] == [0, 1, 2], records
    want = single_node_losses(str(tmp_path / "cache" / "data"))
    assert [loss for _, loss in records[-3:]] == want


def test_stuck_rank_is_reported_with_stage_and_step(tmp_path, job):
    limit = 15
    nodes = start_nodes(tmp_path, job, ["a", "b"], free_port(), "--timeout", str(limit), "--join-timeout", "120",
                        env={"b": {"HETEROFLOW_INJECT_FAULT": "hang@1:1"}})  # plan rank 1 (node b) stops at step 1
    try:
        codes = wait_nodes(nodes, 400)
    finally:
        stop_all(nodes)
    assert codes["b"] == 1 and codes["a"] != 0, outputs(nodes)
    text = nodes[1].output()
    assert ("rank 1 failed (exit code 3): StepTimeout: heteroflow watchdog: rank 1 (stage 1, dp 0 cp 0 tp 0, "
            "node b) has been in step 1 for") in text, outputs(nodes)
    assert "computing or stuck at heteroflow/runtime/watchdog.py" in text


# A deterministic stand-in for the planner's search in the replan test, loaded into every process through
# sitecustomize: one stage per node, layers split evenly. The rest of `heteroflow.stagemap` (the cost
# model that prices the plan) stays real.
STUB_PLANNER = '''
import sys, types
sys.path.insert(0, REPO)  # sitecustomize runs before `python -m` puts the working directory on the path

def search_plan(job, **kwargs):
    from types import SimpleNamespace
    from heteroflow.config.plan import parse_plan
    from heteroflow.config.reader import Problems
    nodes, n = job.cluster.nodes, job.model.num_layers
    layers = [n // len(nodes) + (i < n % len(nodes)) for i in range(len(nodes))]
    raw = {"micro_batch_size": job.train.micro_batch_size,
           "stages": [{"devices": [node.name], "layers": k} for node, k in zip(nodes, layers)]}
    problems = Problems()
    plan = parse_plan(raw, problems, cluster=job.cluster, model=job.model, train=job.train)
    problems.raise_if_any()
    return SimpleNamespace(plan=plan, feasible=True, estimate=SimpleNamespace(feasible=True, problems=[]))

import heteroflow.stagemap
heteroflow.stagemap.search_plan = search_plan
'''


def test_lost_node_is_replanned_away_and_the_run_resumes(tmp_path):
    import os

    from multinode_helpers import CLUSTER
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    (stub_dir / "sitecustomize.py").write_text(STUB_PLANNER.replace("REPO", repr(str(REPO))))
    cluster = {"nodes": [{"name": n, "device": "cpu", "count": 1, "host": "127.0.0.1"} for n in ("a", "b", "c")]}
    assert cluster != CLUSTER
    plan = {"micro_batch_size": 2, "stages": [{"devices": ["a"], "layers": 1}, {"devices": ["b"], "layers": 2},
                                              {"devices": ["c"], "layers": 1}]}
    job = write_job(tmp_path / "job.yaml", job_dict(plan=plan, cluster=cluster))
    metrics = tmp_path / "metrics.jsonl"
    path = {"PYTHONPATH": os.pathsep.join(filter(None, [str(stub_dir), os.environ.get("PYTHONPATH")]))}
    nodes = start_nodes(tmp_path, job, ["a", "b", "c"], free_port(), "--metrics", str(metrics), "--timeout", "120",
                        "--join-timeout", "120", "--replan-on-failure", "--rejoin-timeout", "10",
                        env={"a": path, "b": path, "c": {**path, "HETEROFLOW_INJECT_FAULT": "hang@2:1"}})
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
            assert all(n.proc.poll() is None for n in nodes), outputs(nodes)
            time.sleep(0.2)
        nodes[2].kill()  # node c, stuck in step 1, goes away with its workers
        codes = wait_nodes(nodes[:2], 400)
    finally:
        stop_all(nodes)
    assert codes == {"a": 0, "b": 0}, outputs(nodes)
    text = nodes[0].output()
    assert "node c did not come back within 10 s; planning again on a, b" in text, outputs(nodes)
    assert "node a of 2: ranks 0 of 2 (2 stages, 1f1b, 3 steps, emulated, resuming)" in text, outputs(nodes)
    steps = [s for s, _ in metrics_losses(metrics)]
    assert steps[0] == 0 and steps[-3:] == [0, 1, 2], steps  # no checkpoint here: the new plan starts again
