"""`heteroflow train --emulate` runs a ZeRO-Infinity plan (ZeRO-3 with parameters and optimizer state offloaded)
and says which paths run (rank 0's line)."""

from __future__ import annotations

import pytest

from conftest import run_heteroflow
from heteroflow.runtime.metrics import read_step_records


@pytest.mark.slow
def test_train_runs_zero_infinity(tmp_path, cache_env, write_yaml):
    job = write_yaml(f"""
        cluster: {{nodes: [{{name: a, device: cpu, count: 4}}]}}
        model: {{preset: micro-llama}}
        train: {{global_batch_size: 4, steps: 2, precision: fp32, offload_dir: {tmp_path / "swap"}}}
        plan: {{micro_batch_size: 2, stages: [
          {{devices: ["a:0-1"], layers: 2, dp: 2, zero: 3, offload: {{optimizer: ssd, params: ssd}}}},
          {{devices: ["a:2-3"], layers: 2, cp: 2, zero: 3, offload: {{optimizer: cpu, params: cpu}}}}]}}
        """)
    metrics = tmp_path / "metrics.jsonl"
    result = run_heteroflow("train", str(job), "--emulate", "--metrics", str(metrics), env=cache_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stage 0 zero 3 offload {optimizer: ssd, params: ssd}" in result.stdout
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["predicted_step_time_s"] > 0 and r["loss"] > 0 and r["grad_norm"] > 0 for r in records)
    assert not any((tmp_path / "swap").glob("heteroflow-swap-*"))  # swap directories removed at the end

