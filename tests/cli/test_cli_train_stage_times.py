"""End-to-end: a 2-stage emulated gloo run records every stage's measured parts next to the predicted ones and
ends with the per-stage table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.runtime.metrics import read_step_records
from heteroflow.runtime.stage_times import MEASURED, PREDICTED
from heteroflow.stagemap.breakdown import PARTS

JOB = """
    cluster: {nodes: [{name: a, device: cpu, count: 4}]}
    model: {preset: micro-llama}
    train: {global_batch_size: 8, steps: 4}
    plan:
      micro_batch_size: 2
      stages:
        - {devices: ["a:0-1"], layers: 2, tp: 2}
        - {devices: ["a:2-3"], layers: 2, dp: 2}
    """


@pytest.mark.slow
def test_two_stage_run_records_every_part_of_every_stage(tmp_path, write_yaml):
    import os
    job = write_yaml(JOB)
    metrics = tmp_path / "metrics.jsonl"
    result = subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", "--metrics",
                             str(metrics)], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env={**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    records = read_step_records(metrics)
    assert len(records) == 4
    for record in records:
        stages = record["stages"]
        assert [s["stage"] for s in stages] == [0, 1] and {s["device_type"] for s in stages} == {"cpu"}
        for stage in stages:
            measured, predicted = stage["measured"], stage["predicted"]
            assert list(measured) == list(MEASURED) and list(predicted) == list(PREDICTED)
            # Both stages compute, wait on each other, step their optimizer and meet at the norm's all-reduce.
            for key in ("forward_s", "backward_s", "wait_s", "optimizer_s", "step_s"):
                assert measured[key] > 0, (key, stage)
            assert all(measured[key] >= 0 for key in PARTS), stage
            # The parts happen one after another inside the rank's step.
            assert sum(measured[key] for key in PARTS) <= measured["step_s"] * 1.001 + 1e-4, stage
            assert measured["other_s"] >= -1e-4
            if record["step"] > 0:  # from step 1 on the ranks start together (each step ends with a gather)
                assert measured["step_s"] <= record["step_time_s"] * 1.2
            assert sum(predicted[key] for key in PARTS) == pytest.approx(predicted["step_s"], rel=1e-4, abs=1e-5)
            assert predicted["step_s"] == pytest.approx(record["predicted_step_time_s"], rel=1e-4)
        tp_stage, dp_stage = stages
        assert tp_stage["measured"]["collective_s"] > 0 and dp_stage["measured"]["collective_s"] == 0
        assert tp_stage["predicted"]["collective_s"] > 0 and dp_stage["predicted"]["collective_s"] == 0
        assert dp_stage["measured"]["dp_s"] > 0 and dp_stage["predicted"]["dp_s"] > 0
    out = result.stdout
    assert "per-stage time per step, predicted vs measured (mean of steps 2-3, after 2 warm-up steps" in out
    rows = {line.removeprefix("[rank 0] ").split()[0]: line.split()[3:] for line in out.splitlines()
            if line.startswith("[rank 0] ")}
    for part in ("forward", "backward", "collective", "wait", "dp", "optimizer", "sync", "other", "step"):
        assert len(rows[part]) == 6, (part, rows.get(part))  # predicted, measured, ratio per stage
