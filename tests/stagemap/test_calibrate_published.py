"""Calibration from a published measurements table alone (sources cited in benchmarks/data).

Megatron-LM on 32 V100s (DLPerf): fitted from any two of its configurations, the cost model orders all three as
measured and predicts the third closer to its measurement than the uncalibrated model does. DeepSpeed +
Megatron-LM on 16 T4s (the AMP artifact, 47 configurations): every configuration that ran fits in memory as
the planner prices it, and the cost model's factors, fitted to all of them, put each within 20%.
`benchmarks/bench_calibration_published.py` reports the figures, the 20% goal from two configurations and the
8-GPU table too."""

from __future__ import annotations

import itertools
import math

from conftest import REPO
from heteroflow.calibrate.fit import fit_calibration
from heteroflow.calibrate.runs import load_runs
from heteroflow.config import load_job
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.estimate import UNCALIBRATED

DATA = REPO / "benchmarks" / "data"


def test_two_published_configurations_order_the_rest_and_bring_them_closer():
    job = load_job(DATA / "dlperf-megatron-gpt-v100x32.yaml")
    runs, notes = load_runs(job, [str(DATA / "dlperf-megatron-gpt-v100x32.measurements.yaml")])
    assert len(runs) == 3 and not notes
    assert all(r.plan.num_devices == 32 and not r.emulate for r in runs)
    measured = [r.measured_step_time_s for r in runs]
    uncalibrated = [evaluate_plan(job, r.plan, calibration=UNCALIBRATED).step_time_s for r in runs]
    for pair in itertools.combinations(range(3), 2):
        fit = fit_calibration([runs[i] for i in pair])
        predicted = [evaluate_plan(job, r.plan, calibration=fit.calibration).step_time_s for r in runs]
        assert sorted(range(3), key=predicted.__getitem__) == sorted(range(3), key=measured.__getitem__), pair
        (held,) = set(range(3)) - set(pair)
        error = abs(math.log(predicted[held] / measured[held]))
        assert error < abs(math.log(uncalibrated[held] / measured[held])), pair


def test_sixteen_t4_table_fits_in_memory_and_within_reach_of_the_factors():
    job = load_job(DATA / "amp-deepspeed-gpt2-t4x16.yaml")
    runs, notes = load_runs(job, [str(DATA / "amp-deepspeed-gpt2-t4x16.measurements.yaml")])
    assert len(runs) == 47 and not notes
    for run in runs:
        assert run.plan.num_devices == 16 and not run.emulate
        assert evaluate_plan(job, run.plan, calibration=UNCALIBRATED).feasible, run.source
    fit = fit_calibration(runs)
    ratios = [p / r.measured_step_time_s for p, r in zip(fit.predicted_after_s, runs)]
    assert all(abs(math.log(v)) < math.log(1.2) for v in ratios), (min(ratios), max(ratios))
