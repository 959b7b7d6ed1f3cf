"""`heteroflow train --emulate` runs context-parallel plans and refuses the cp combination it does not run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.runtime.metrics import read_step_records


def heteroflow(*args: str, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=env)


@pytest.fixture
def env(tmp_path):
    import os
    return {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}


@pytest.mark.slow
def test_train_runs_a_cp2_stage_next_to_a_cp1_stage(tmp_path, env, write_yaml):
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 3}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, steps: 2, precision: fp32}
        plan: {micro_batch_size: 2, stages: [{devices: ["a:0-1"], layers: 2, cp: 2}, {devices: ["a:2-2"], layers: 2}]}
        """)
    metrics = tmp_path / "metrics.jsonl"
    result = heteroflow("train", str(job), "--emulate", "--metrics", str(metrics), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["predicted_step_time_s"] > 0 and r["loss"] > 0 for r in records)


def test_train_refuses_cp_with_zero3_before_any_worker_starts(env, write_yaml):
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 4}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4}
        plan: {micro_batch_size: 2, stages: [{devices: [a], layers: 4, cp: 2, dp: 2, zero: 3}]}
        """)
    result = heteroflow("train", str(job), "--emulate", env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "plan.stages[0]: cp 2 with zero: 3 is not run yet" in result.stderr
