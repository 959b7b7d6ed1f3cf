"""End-to-end: `heteroflow train --emulate` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.runtime.metrics import read_metrics, read_step_records


def heteroflow(*args: str, env_cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=env_cache)


@pytest.fixture
def env_cache(tmp_path, monkeypatch):
    import os
    return {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}


@pytest.mark.slow
def test_train_emulated_three_vendor_job_writes_metrics(tmp_path, env_cache):
    metrics = tmp_path / "metrics.jsonl"
    result = heteroflow("train", "configs/jobs/emulated-three-vendor.yaml", "--emulate", "--steps", "4",
                        "--metrics", str(metrics), "--log-dir", str(tmp_path / "logs"), env_cache=env_cache)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records:
        assert {"step", "loss", "tokens_per_s", "step_time_s", "predicted_step_time_s"} <= record.keys()
        assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0
    assert records[-1]["loss"] < records[0]["loss"]
    assert "step 4/4" in result.stdout and "done, 4 steps" in result.stdout
    # The header says what was measured, so the file alone calibrates the cost model.
    (header, steps), = read_metrics(metrics)
    assert header["version"] == 1 and header["emulate"] is True and len(steps) == 4
    assert header["job"]["model"]["num_layers"] and len(header["plan"]["stages"]) == 3
    assert header["predicted_step_time_s"] == records[0]["predicted_step_time_s"]
    calibrated = heteroflow("calibrate", "configs/jobs/emulated-three-vendor.yaml", str(metrics), "-o",
                            str(tmp_path / "cal.yaml"), env_cache=env_cache)
    assert calibrated.returncode == 0, calibrated.stdout + calibrated.stderr
    assert "calibrated from 1 emulated run" in calibrated.stdout


def test_train_bad_input_exits_2_without_traceback(tmp_path, env_cache, write_yaml):
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 2}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, data: {path: missing.bin}}
        plan: {micro_batch_size: 2, stages: [{devices: [a], layers: 4, tp: 1, dp: 2}]}
        """)
    result = heteroflow("train", str(job), "--emulate", "--steps", "1", env_cache=env_cache)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.data.path" in result.stderr and "missing.bin" in result.stderr
    result = heteroflow("train", str(job), "--emulate", "--steps", "0", env_cache=env_cache)
    assert result.returncode == 2 and "--steps: must be between 1 and 1000000000, got 0" in result.stderr


OFFLOAD_JOB = """
    cluster: {nodes: [{name: a, device: cpu, count: 2}]}
    model: {preset: micro-llama}
    train: {global_batch_size: 4, steps: 3, offload_dir: swap, checkpoint: {dir: ckpt, interval: 2, keep: 2}}
    plan:
      micro_batch_size: 2
      stages:
        - {devices: ["a:0"], layers: 2, offload: %s}
        - {devices: ["a:1"], layers: 2, recompute: full, offload: {optimizer: cpu, activations: cpu}}
    """


@pytest.mark.slow
def test_train_with_offload_tiers_checkpoints_and_leaves_no_swap_files(tmp_path, env_cache, write_yaml):
    job = write_yaml(OFFLOAD_JOB % "{optimizer: ssd, params: ssd}")
    metrics = tmp_path / "metrics.jsonl"
    result = heteroflow("train", str(job), "--emulate", "--metrics", str(metrics), env_cache=env_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage 0 offload {optimizer: ssd, params: ssd, activations: device}: adam " in result.stdout
    assert [r["step"] for r in read_step_records(metrics)] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000002", "step-000003"]
    assert list((tmp_path / "swap").iterdir()) == []  # the ranks made their directories there and removed them


def test_train_refuses_zero_1_2_with_offloaded_params_as_a_plan_error(env_cache, write_yaml):
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 2}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4}
        plan: {micro_batch_size: 2, stages: [{devices: [a], layers: 4, dp: 2, zero: 1, offload: {params: cpu}}]}
        """)
    result = heteroflow("train", str(job), "--emulate", env_cache=env_cache)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert ("plan.stages[0].offload: params: cpu needs zero 3 or 0, got zero 1 (ZeRO 1/2 do not shard parameters)"
            in result.stderr)
