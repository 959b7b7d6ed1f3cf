"""`--replan-on-failure` control flow: nodes are threads running `run_node` against a real loopback store,
with the elastic launch and the planner replaced (the planner `heteroflow.stagemap.search_plan` is merged
separately; this checks what happens around it)."""

from __future__ import annotations

import sys
import threading

import pytest

from heteroflow.config import parse_job
from heteroflow.errors import UserError
from heteroflow.launcher.launch import TrainingFailed, free_port
from heteroflow.launcher.multinode import job_on_nodes, replan, run_node
from heteroflow.launcher.prepare import TrainOptions

CLUSTER = {"nodes": [{"name": n, "device": "cpu", "count": 1, "host": "127.0.0.1"} for n in ("a", "b", "c")]}
JOB = {"cluster": CLUSTER, "model": {"preset": "micro-llama"},
       "train": {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "steps": 2},
       "plan": {"micro_batch_size": 2, "stages": [{"devices": ["a"], "layers": 1}, {"devices": ["b"], "layers": 2},
                                                  {"devices": ["c"], "layers": 1}]}}
TWO_STAGES = {"micro_batch_size": 2, "stages": [{"devices": ["a"], "layers": 2}, {"devices": ["b"], "layers": 2}]}


class NodeDied(Exception):
    """Stands for a node that is gone: it never comes back to any meeting."""


def run_nodes(start, planner, *, names=("a", "b", "c"), rejoin_timeout_s=2.0) -> dict:
    """Run `run_node` for each name in a thread; name -> result or exception."""
    job = parse_job(JOB)
    port = free_port()
    outcome: dict = {}

    def node(name: str) -> None:
        options = TrainOptions(emulate=True, node=name, rdzv=f"127.0.0.1:{port}", join_timeout_s=20,
                               replan_on_failure=True, rejoin_timeout_s=rejoin_timeout_s, timeout_s=20)
        try:
            outcome[name] = run_node(job, job.plan, options, planner=planner, start=start)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcome[name] = error

    threads = [threading.Thread(target=node, args=(n,)) for n in names]
    threads[0].start()  # a hosts the store
    threads[0].join(0.5)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "run_node did not return"
    return outcome


def test_lost_node_replans_on_the_survivors_and_resumes():
    launches = []
    planned = []

    def start(spec, entrypoint, args):
        node = next(n for n in ("a", "b", "c") if spec.env["HETEROFLOW_NODE"] == n)
        launches.append((node, spec.run_id, spec.num_nodes, spec.rank_order, args.resume,
                         [s.devices for s in args.plan.stages]))
        if not args.resume:
            if node == "c":
                raise NodeDied()
            raise TrainingFailed(f"rank on node {node} lost its peer")
        return {rank: f"{node} done" for rank in spec.rank_order}

    def planner(job, keep):
        planned.append(list(keep))
        assert [n.name for n in job.cluster.nodes] == ["a", "b", "c"]
        return parse_job({**JOB, "cluster": job_on_nodes(job, keep).cluster.to_dict(), "plan": TWO_STAGES}).plan

    outcome = run_nodes(start, planner)
    assert isinstance(outcome["c"], NodeDied)
    assert outcome["a"] == {0: "a done"} and outcome["b"] == {1: "b done"}
    assert planned == [["a", "b"], ["a", "b"]]  # each survivor planned, from the same roster
    first = sorted(l for l in launches if not l[4])
    second = sorted(l for l in launches if l[4])
    assert [(n, k, r) for n, _, k, r, _, _ in first] == [("a", 3, (0,)), ("b", 3, (1,)), ("c", 3, (2,))]
    assert [(n, k, r, d) for n, _, k, r, _, d in second] == [("a", 2, (0,), [("a",), ("b",)]),
                                                           ("b", 2, (1,), [("a",), ("b",)])]
    assert second[0][1] == second[1][1] != first[0][1]  # a new run id for the new plan, shared by the survivors


def test_failure_with_every_node_back_is_reported_not_replanned():
    def start(spec, entrypoint, args):
        raise TrainingFailed("rank 1 failed (exit code 1): RuntimeError: boom")

    def planner(job, keep):
        raise AssertionError("must not replan")

    outcome = run_nodes(start, planner)
    for name in "abc":
        assert isinstance(outcome[name], TrainingFailed), outcome
        assert "RuntimeError: boom" in str(outcome[name])
        assert "every node is still here after the failure: not replanning" in str(outcome[name])


def test_replan_without_a_planner_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "heteroflow.stagemap", None)  # as in a build without stagemap
    job = parse_job(JOB)
    with pytest.raises(UserError, match="this build has no planner"):
        replan(job, ["a", "b"])


def test_job_on_nodes_keeps_the_named_nodes_and_asks_for_a_plan():
    job = job_on_nodes(parse_job(JOB), ["a", "c"])
    assert [n.name for n in job.cluster.nodes] == ["a", "c"] and job.plan is None
