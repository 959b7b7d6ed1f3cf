"""`cluster.env` reaches the workers of a single-machine run as it does a node's workers of a multi-node run."""

from __future__ import annotations

import os

import pytest

from heteroflow.config import parse_job
from heteroflow.launcher import train as train_module
from heteroflow.launcher.placement import declared_environment, node_environment
from heteroflow.launcher.prepare import TrainOptions

JOB = {
    "cluster": {"env": {"HF_TEST_CLUSTER": "cluster", "HF_TEST_SHARED": "cluster"},
                "nodes": [{"name": "a", "device": "cpu", "count": 1, "env": {"HF_TEST_SHARED": "a"}},
                          {"name": "b", "device": "cpu", "count": 1, "env": {"HF_TEST_NODE_B": "b"}}]},
    "model": {"preset": "micro-llama"},
    "train": {"global_batch_size": 2, "steps": 1},
    "plan": {"micro_batch_size": 1, "stages": [{"devices": ["a"], "layers": 2}, {"devices": ["b"], "layers": 2}]},
}


def test_one_function_for_a_node_and_for_this_machine():
    job = parse_job(JOB)
    env, conflicts = declared_environment(job, ["a"])
    assert env == {"HF_TEST_CLUSTER": "cluster", "HF_TEST_SHARED": "a"} and conflicts == []
    assert node_environment(job, job.plan, "a", emulate=True).items() >= env.items()  # the multi-node path
    env, conflicts = declared_environment(job, ["a", "b"])  # an emulated run: both nodes' ranks here
    assert env == {"HF_TEST_CLUSTER": "cluster", "HF_TEST_SHARED": "a", "HF_TEST_NODE_B": "b"}
    assert conflicts == ["cluster env HF_TEST_SHARED: node b sets 'cluster', node a sets 'a'; every rank here gets "
                         "'a'"]


def _environment_probe(args) -> dict[str, str | None]:
    """Stands in for the worker: what its environment holds."""
    return {name: os.environ.get(name) for name in ("HF_TEST_CLUSTER", "HF_TEST_SHARED", "HF_TEST_NODE_B")}


@pytest.mark.slow
def test_single_machine_run_sets_cluster_env_for_its_workers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HETEROFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(train_module, "run_worker", _environment_probe)
    results = train_module.train_job(parse_job(JOB), TrainOptions(emulate=True, log_dir=str(tmp_path / "logs")))
    want = {"HF_TEST_CLUSTER": "cluster", "HF_TEST_SHARED": "a", "HF_TEST_NODE_B": "b"}
    assert results == {0: want, 1: want}
    assert "--emulate runs every node's ranks on this machine: cluster env HF_TEST_SHARED" in capsys.readouterr().out
    assert "HF_TEST_CLUSTER" not in os.environ  # the launcher's own environment is restored
