"""Calibration: factors scale the cost model, the fit recovers known factors from synthetic runs, names the
ones the runs cannot pin down, and two measured configurations predict the others (measurements files)."""

from __future__ import annotations

import math

import pytest
import yaml

from heteroflow.calibrate import Run, fit_calibration, load_runs
from heteroflow.calibrate.fit import COMMON_SHARE
from heteroflow.config import parse_job
from heteroflow.config.catalog import CATALOG
from heteroflow.config.plan import parse_plan
from heteroflow.config.reader import Problems
from heteroflow.errors import ConfigError, UserError
from heteroflow.runtime.metrics import MetricsWriter, StepRecord, header_record, read_metrics, read_step_records
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.calibration import (Calibration, DeviceFactors, load_calibration, save_calibration)
from heteroflow.stagemap.estimate import UNCALIBRATED

A100 = "nvidia-a100-80g"
JOB = {"cluster": {"inter_node_gb_per_s": 25, "nodes": [{"name": "n0", "device": A100, "count": 8},
                                                      {"name": "n1", "device": A100, "count": 8}]},
       "model": {"preset": "llama2-7b", "seq_length": 2048},
       "train": {"global_batch_size": 128, "micro_batch_size": 1}}
BOTH = ["n0", "n1"]
PLANS = {  # 16 devices, one device type: the configurations a user would try
    "tp1-dp16": {"micro_batch_size": 16, "stages": [{"devices": BOTH, "layers": 32, "tp": 1, "dp": 16, "zero": 1}]},
    "tp2-dp8": {"micro_batch_size": 8, "stages": [{"devices": BOTH, "layers": 32, "tp": 2, "dp": 8, "zero": 1}]},
    "tp4-dp4": {"micro_batch_size": 4, "stages": [{"devices": BOTH, "layers": 32, "tp": 4, "dp": 4}]},
    "tp8-dp2": {"micro_batch_size": 2, "stages": [{"devices": BOTH, "layers": 32, "tp": 8, "dp": 2}]},
    "pp2-tp2-dp4": {"micro_batch_size": 4, "stages": [{"devices": ["n0"], "layers": 16, "tp": 2, "dp": 4},
                                                      {"devices": ["n1"], "layers": 16, "tp": 2, "dp": 4}]},
    "pp2-tp8": {"micro_batch_size": 1, "stages": [{"devices": ["n0"], "layers": 16, "tp": 8, "dp": 1},
                                                  {"devices": ["n1"], "layers": 16, "tp": 8, "dp": 1}]},
    "pp2-tp4-dp2-recompute": {"micro_batch_size": 2, "schedule": "gpipe",
                              "stages": [{"devices": ["n0"], "layers": 16, "tp": 4, "dp": 2, "recompute": "full"},
                                         {"devices": ["n1"], "layers": 16, "tp": 4, "dp": 2, "recompute": "full"}]},
}
TRUTH = Calibration(factors={A100: DeviceFactors(gemm=0.6, memory=0.8, tp_comm=0.5, dp_comm=0.7)}, num_runs=1)
"""What the 'hardware' really does: a card well below the catalog's efficiency, slow collectives."""


@pytest.fixture(scope="module")
def job():
    return parse_job(JOB)


def plan_of(job, name):
    problems = Problems()
    plan = parse_plan(PLANS[name], problems, cluster=job.cluster, model=job.model, train=job.train)
    problems.raise_if_any()
    return plan


def synthetic_run(job, name, truth=TRUTH):
    """A 'measured' run: the plan priced with the true factors."""
    plan = plan_of(job, name)
    return Run(source=name, job=job, plan=plan, emulate=False,
               measured_step_time_s=evaluate_plan(job, plan, calibration=truth).step_time_s)


def test_factors_scale_the_cost_model(job):
    plan = plan_of(job, "tp8-dp2")
    base = evaluate_plan(job, plan, calibration=UNCALIBRATED)
    slower = evaluate_plan(job, plan, calibration=TRUTH)
    assert slower.step_time_s > 1.3 * base.step_time_s
    assert base.calibration is None and slower.calibration["applied"] and slower.calibration["num_runs"] == 1
    # Each factor alone moves the prediction the way its rate says.
    for factor in ("gemm", "memory", "tp_comm", "dp_comm", "overhead"):
        value = 2.0 if factor == "overhead" else 0.5
        one = Calibration(factors={A100: DeviceFactors(**{factor: value})}, num_runs=1)
        assert evaluate_plan(job, plan, calibration=one).step_time_s > base.step_time_s, factor


def test_fit_recovers_known_factors_and_residuals_go_to_one(job):
    truth = Calibration(factors={A100: DeviceFactors(gemm=0.6, tp_comm=0.5)}, num_runs=1)
    runs = [synthetic_run(job, name, truth) for name in PLANS]
    fit = fit_calibration(runs, factors=("gemm", "tp_comm", "dp_comm"))
    factors = fit.calibration.factors[A100]
    assert factors.gemm == pytest.approx(0.6, rel=0.03)
    assert factors.tp_comm == pytest.approx(0.5, rel=0.1)
    assert factors.dp_comm == pytest.approx(1.0, rel=0.1)
    for record in fit.calibration.runs:
        assert record["ratio_before"] < 0.8  # the catalog model is far too optimistic here
        assert record["ratio_after"] == pytest.approx(1.0, abs=0.01)
    assert fit.calibration.num_runs == len(PLANS) and not fit.calibration.emulate


def test_all_factors_fit_and_the_overhead_is_not_pinned_down(job):
    runs = [synthetic_run(job, name) for name in PLANS]
    fit = fit_calibration(runs)
    for record in fit.calibration.runs:
        assert record["ratio_after"] == pytest.approx(1.0, abs=0.02)
    # A 7B model's kernel launches are a fraction of a percent of a step: no run can tell their cost.
    assert f"{A100}.overhead" in fit.calibration.not_pinned_down
    assert f"{A100}.gemm" not in fit.calibration.not_pinned_down
    assert fit.calibration.factors[A100].gemm == pytest.approx(0.6, rel=0.1)


def test_a_factor_without_sensitivity_is_named_and_follows_the_pinned_ones_by_the_prior(job):
    runs = [synthetic_run(job, "tp1-dp16")]  # tp = 1: no tensor-parallel collective at all
    fit = fit_calibration(runs, factors=("gemm", "tp_comm"))
    assert fit.calibration.not_pinned_down == (f"{A100}.tp_comm",)
    assert fit.sensitivity[fit.params.index(f"{A100}.tp_comm")] == 0.0
    factors = fit.calibration.factors[A100]
    assert factors.gemm < 0.7  # the run shows a slow stack
    # The hierarchical prior: the unseen factor's log follows the seen one's by their prior correlation.
    share = COMMON_SHARE / (1 + COMMON_SHARE)
    assert math.log(factors.tp_comm) == pytest.approx(share * math.log(factors.gemm), rel=0.01)
    assert fit.calibration.runs[0]["ratio_after"] == pytest.approx(1.0, abs=0.01)


def test_an_unpinned_host_overhead_follows_a_slow_stack_up_not_down(job):
    runs = [synthetic_run(job, "tp1-dp16")]  # a 7B model: its kernel launches are a sliver of the step
    fit = fit_calibration(runs, factors=("gemm", "overhead"))
    assert fit.calibration.not_pinned_down == (f"{A100}.overhead",)
    factors = fit.calibration.factors[A100]
    # The overhead multiplies a time: the slow stack the run shows has a slower host too, by the same prior
    # correlation as a rate's, in the other direction.
    assert factors.gemm < 0.7 and factors.overhead > 1.0
    share = COMMON_SHARE / (1 + COMMON_SHARE)
    assert math.log(factors.overhead) == pytest.approx(-share * math.log(factors.gemm), rel=0.05)


def test_two_measured_configurations_predict_the_others(job, tmp_path):
    """From a measurements table alone (16 devices, one vendor): two configurations measured, the other
    configurations' throughputs within 20% and in the measured order."""
    measured = {name: synthetic_run(job, name).measured_step_time_s for name in PLANS}
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "a.yaml").write_text(yaml.safe_dump({"plan": PLANS["tp1-dp16"]}))
    tokens_per_step = JOB["train"]["global_batch_size"] * JOB["model"]["seq_length"]
    (tmp_path / "measured.yaml").write_text(yaml.safe_dump({"measurements": [
        {"plan": "plans/a.yaml", "step_time_s": measured["tp1-dp16"]},
        {"plan": PLANS["tp8-dp2"], "tokens_per_s": tokens_per_step / measured["tp8-dp2"]}]}))
    runs, notes = load_runs(job, [str(tmp_path / "measured.yaml")])
    assert len(runs) == 2 and not notes
    assert runs[1].measured_step_time_s == pytest.approx(measured["tp8-dp2"])
    calibration = fit_calibration(runs).calibration
    predicted = {name: evaluate_plan(job, plan_of(job, name), calibration=calibration).tokens_per_s
                 for name in PLANS}
    truth = {name: tokens_per_step / t for name, t in measured.items()}
    for name in PLANS:
        assert predicted[name] / truth[name] == pytest.approx(1.0, abs=0.2), name
    assert sorted(PLANS, key=predicted.get) == sorted(PLANS, key=truth.get)
    uncalibrated = {n: evaluate_plan(job, plan_of(job, n), calibration=UNCALIBRATED).tokens_per_s for n in PLANS}
    assert max(uncalibrated[n] / truth[n] for n in PLANS) > 1.4  # what calibration fixed


def test_calibration_file_round_trips_and_is_checked(job, tmp_path):
    fit = fit_calibration([synthetic_run(job, "tp4-dp4"), synthetic_run(job, "tp1-dp16")])
    path = tmp_path / "cal.yaml"
    save_calibration(fit.calibration, path)
    loaded = load_calibration(path, device_types=[*job.cluster.device_types, *CATALOG])
    assert loaded.num_runs == 2 and loaded.source == str(path)
    for name in ("gemm", "memory", "overhead", "tp_comm", "dp_comm"):
        assert getattr(loaded.factors[A100], name) == pytest.approx(getattr(fit.calibration.factors[A100], name),
                                                                    rel=1e-5)
    data = yaml.safe_load(path.read_text())
    data["device_types"]["nvidia-a10O"] = data["device_types"].pop(A100)
    data["device_types"]["nvidia-a10O"]["gemm"] = -1.0
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as error:
        load_calibration(path, device_types=list(CATALOG))
    lines = str(error.value).splitlines()
    assert any(line.startswith("device_types.nvidia-a10O: unknown device type") for line in lines)
    assert any(line.startswith("device_types.nvidia-a10O.gemm:") for line in lines)


def test_an_emulated_calibration_does_not_price_real_runs(job):
    plan = plan_of(job, "tp2-dp8")
    emulated = Calibration(factors={A100: DeviceFactors(gemm=0.5)}, num_runs=3, emulate=True)
    estimate = evaluate_plan(job, plan, calibration=emulated)
    assert estimate.step_time_s == evaluate_plan(job, plan, calibration=UNCALIBRATED).step_time_s
    assert estimate.calibration == {"file": "", "num_runs": 3, "emulate": True, "applied": False}


def test_metrics_header_is_written_and_skipped_by_readers(job, tmp_path):
    plan = plan_of(job, "tp2-dp8")
    path = tmp_path / "run.jsonl"
    for first, times in ((0, [9.0, 5.0, 4.0, 4.2, 3.8]), (5, [7.0, 6.0, 6.1, 5.9, 6.0])):  # then resumed
        header = header_record(job=job.to_dict(), plan=plan.to_dict(), emulate=False, predicted_step_time_s=4.8)
        writer = MetricsWriter(path, header=header)
        for k, t in enumerate(times):
            writer.write(StepRecord(step=first + k, loss=1.0, tokens_per_s=1.0, step_time_s=t, lr=1e-4,
                                    grad_norm=1.0))
        writer.close()
    lines = path.read_text().splitlines()
    assert '"header"' in lines[0] and '"header"' in lines[6] and len(lines) == 12
    assert [r["step"] for r in read_step_records(path)] == list(range(10))
    segments = read_metrics(path)
    assert len(segments) == 2 and segments[0][0]["version"] == 1 and segments[0][0]["plan"] == plan.to_dict()
    runs, _ = load_runs(job, [str(path)])
    # Each header is a run; the warm-up (2 steps, or 20%) is dropped, then the median.
    assert [r.measured_step_time_s for r in runs] == [4.0, 6.0]
    assert runs[0].plan == plan and runs[0].source.endswith("(run 1)")


def test_mixed_emulated_and_real_runs_are_refused(job):
    runs = [synthetic_run(job, "tp2-dp8"), synthetic_run(job, "tp4-dp4")]
    runs[1] = Run(source="b", job=job, plan=runs[1].plan, emulate=True, measured_step_time_s=1.0)
    with pytest.raises(UserError, match="mix emulated and real"):
        fit_calibration(runs)


def test_non_finite_measurements_are_refused(job, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"measurements": [{"plan": PLANS["tp2-dp8"], "step_time_s": -1.0},
                                                     {"plan": PLANS["tp2-dp8"], "tokens_per_s": math.inf}]}))
    with pytest.raises(ConfigError) as error:
        load_runs(job, [str(path)])
    text = str(error.value)
    assert "measurements[0].step_time_s" in text and "measurements[1].tokens_per_s" in text
