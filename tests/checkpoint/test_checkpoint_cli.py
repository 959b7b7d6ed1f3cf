"""End to end: `heteroflow train JOB --resume` continues another plan's checkpoint with true step numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.runtime.metrics import read_step_records


def heteroflow(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=env)


@pytest.mark.slow
def test_train_resume_from_the_cli_under_another_plan(tmp_path, write_yaml):
    # `heteroflow train` prices the plan with the cost model, which lives on the stagemap branch until merged.
    pytest.importorskip("heteroflow.stagemap", reason="heteroflow train needs heteroflow.stagemap (cost model)")
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 2}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, micro_batch_size: 2, precision: fp32, steps: 3, warmup_steps: 1,
                checkpoint: {dir: ckpt, interval: 1, keep: 2}}
        plan: {micro_batch_size: 2, stages: [{devices: [a], layers: 4, tp: 1, dp: 2, zero: 1}]}
        """)
    plan_b = write_yaml("""
        plan: {micro_batch_size: 2, stages: [{devices: ["a:0-0"], layers: 1}, {devices: ["a:1-1"], layers: 3}]}
        """, name="plan-b.yaml")
    metrics = tmp_path / "metrics.jsonl"
    first = heteroflow("train", str(job), "--emulate", "--steps", "2", "--metrics", str(metrics), env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000001", "step-000002"]

    again = heteroflow("train", str(job), "--emulate", "--steps", "3", env=env)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr and "--resume" in again.stderr

    resumed = heteroflow("train", str(job), "--emulate", "--resume", "--plan", str(plan_b), "--metrics", str(metrics),
                         env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from" in resumed.stdout and "step-000002" in resumed.stdout
    assert "done, 1 steps (resumed at step 2)" in resumed.stdout
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000002", "step-000003"]
    meta = json.loads((tmp_path / "ckpt" / "step-000003" / "metadata.json").read_text())
    assert len(meta["plan"]["stages"]) == 2 and meta["data_position"]["samples_consumed"] == 12
