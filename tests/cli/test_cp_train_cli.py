"""`heteroflow train --emulate` runs context-parallel plans, next to cp 1 stages and with ZeRO-3."""

from __future__ import annotations

import pytest

from conftest import run_heteroflow
from heteroflow.runtime.metrics import read_step_records


@pytest.mark.slow
def test_train_runs_a_cp2_stage_next_to_a_cp1_stage(tmp_path, cache_env, write_yaml):
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 3}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, steps: 2, precision: fp32}
        plan: {micro_batch_size: 2, stages: [{devices: ["a:0-1"], layers: 2, cp: 2}, {devices: ["a:2-2"], layers: 2}]}
        """)
    metrics = tmp_path / "metrics.jsonl"
    result = run_heteroflow("train", str(job), "--emulate", "--metrics", str(metrics), env=cache_env)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["predicted_step_time_s"] > 0 and r["loss"] > 0 for r in records)


@pytest.mark.slow
def test_train_runs_cp2_dp2_with_zero3(tmp_path, cache_env, write_yaml):
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 4}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, steps: 2, precision: fp32}
        plan: {micro_batch_size: 2, stages: [{devices: [a], layers: 4, cp: 2, dp: 2, zero: 3}]}
        """)
    metrics = tmp_path / "metrics.jsonl"
    result = run_heteroflow("train", str(job), "--emulate", "--steps", "2", "--metrics", str(metrics), env=cache_env)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["predicted_step_time_s"] > 0 and r["loss"] > 0 and r["grad_norm"] > 0 for r in records)
