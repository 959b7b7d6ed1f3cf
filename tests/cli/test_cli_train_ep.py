"""`heteroflow train --emulate` runs a MoE job whose stages set ep; what the runtime does not run is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.runtime.metrics import read_step_records

JOB = """
    cluster: {{nodes: [{{name: gpu, device: nvidia-a100-80g, count: 2}}, {{name: npu, device: ascend-910b2, count: 2}}]}}
    model: {{preset: micro-llama, moe: {{num_experts: 4, top_k: 2, ffn_hidden_size: 64, aux_loss_coeff: 0.01}}}}
    train: {{global_batch_size: 4, micro_batch_size: 2, steps: 2, precision: fp32}}
    plan:
      micro_batch_size: 2
      stages:
        - {{devices: [gpu], layers: 2, dp: 2, ep: 2, {extra}}}
        - {{devices: [npu], layers: 2, tp: 2, ep: 2, etp: 1, sp: true}}
    """


def _train(job, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


@pytest.mark.slow
def test_train_emulated_moe_job_with_ep_per_stage(tmp_path, write_yaml):
    metrics = tmp_path / "metrics.jsonl"
    result = _train(write_yaml(JOB.format(extra="zero: 1")), tmp_path, "--metrics", str(metrics))
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1] and all(r["aux_loss"] > 0 for r in records)
    for stage in records[-1]["stages"]:  # each stage's all-to-alls are timed and priced as their own part
        assert stage["measured"]["alltoall_s"] > 0 and stage["predicted"]["alltoall_s"] > 0, stage


def test_train_refuses_zero3_with_ep(tmp_path, write_yaml):
    result = _train(write_yaml(JOB.format(extra="zero: 3")), tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "plan.stages[0].ep:" in result.stderr and "ZeRO 0-2" in result.stderr
