"""`calibrate --stage-parts`: a metrics run's per-stage figures pin down factors its step time alone cannot."""

from __future__ import annotations

import pytest

from heteroflow.calibrate import fit_calibration, load_runs
from heteroflow.calibrate.runs import FIT_PARTS
from heteroflow.config import parse_job
from heteroflow.runtime.metrics import MetricsWriter, StepRecord, header_record
from heteroflow.runtime.stage_times import stage_records
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.calibration import Calibration, DeviceFactors
from heteroflow.stagemap.estimate import UNCALIBRATED

TRUTH = {"nvidia-a100-80g": DeviceFactors(gemm=0.6, tp_comm=0.5), "ascend-910b2": DeviceFactors(gemm=0.4, dp_comm=0.3)}


def _job():
    return parse_job({
        "cluster": {"inter_node_gb_per_s": 25,
                    "nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 8},
                              {"name": "npu-0", "device": "ascend-910b2", "count": 8}]},
        "model": {"preset": "llama2-7b", "seq_length": 2048},
        "train": {"global_batch_size": 64, "precision": "bf16"},
        "plan": {"micro_batch_size": 4, "stages": [
            {"devices": ["gpu-0"], "layers": 18, "tp": 4, "dp": 2, "zero": 1},
            {"devices": ["npu-0"], "layers": 14, "tp": 2, "dp": 4, "zero": 1}]}})


def _measured_run(job, path) -> None:
    """A metrics file of the job's plan measured on hardware that runs as `TRUTH` says."""
    truth = evaluate_plan(job, job.plan, calibration=Calibration(factors=TRUTH, num_runs=1, emulate=False))
    measured = [{**s.times.to_dict(), "other_s": 0.0, "step_s": truth.step_time_s} for s in truth.stages]
    writer = MetricsWriter(path, header=header_record(job=job.to_dict(), plan=job.plan.to_dict(), emulate=False,
                                                      predicted_step_time_s=None))
    for step in range(5):
        writer.write(StepRecord(step=step, loss=5.0, tokens_per_s=1.0, step_time_s=truth.step_time_s, lr=1e-4,
                                grad_norm=1.0, stages=stage_records(measured, None, ["nvidia-a100-80g", "ascend-910b2"])))
    writer.close()


def test_stage_parts_pin_down_the_compute_and_collective_factors_of_one_run(tmp_path):
    job = _job()
    _measured_run(job, tmp_path / "run.jsonl")
    runs, _ = load_runs(job, [str(tmp_path / "run.jsonl")])
    (run,) = runs
    assert {part for _, part, _ in run.measured_parts} == set(FIT_PARTS)
    factors = ("gemm", "tp_comm", "dp_comm")
    alone = fit_calibration(runs, factors=factors)
    with_parts = fit_calibration(runs, factors=factors, stage_parts=True)
    # One step time pins down one combination; the parts pin each factor down.
    assert len(alone.calibration.not_pinned_down) >= len(factors) * 2 - 1
    assert not with_parts.calibration.not_pinned_down
    for name, truth in TRUTH.items():
        fitted = with_parts.calibration.factors[name]
        for factor in factors:
            assert getattr(fitted, factor) == pytest.approx(getattr(truth, factor), rel=0.1), (name, factor)
    assert with_parts.predicted_after_s[0] == pytest.approx(run.measured_step_time_s, rel=0.02)
    # Without --stage-parts the same file fits as before: from its step times only.
    assert alone.predicted_before_s[0] == evaluate_plan(job, job.plan, calibration=UNCALIBRATED).step_time_s
