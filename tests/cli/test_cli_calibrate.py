"""`heteroflow calibrate` end to end: metrics files and measurements files in, a calibration file out, which
`plan --calibration` and `cluster.calibration` then use; bad input is one `path: message` error, exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from heteroflow.cli import main
from heteroflow.config import load_job, load_plan_file
from heteroflow.runtime.metrics import MetricsWriter, StepRecord, header_record
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.calibration import Calibration, DeviceFactors

A100 = "nvidia-a100-80g"
CLUSTER = {"inter_node_gb_per_s": 25, "nodes": [{"name": "n0", "device": A100, "count": 8},
                                                {"name": "n1", "device": A100, "count": 8}]}
MODEL = {"preset": "llama2-7b", "seq_length": 2048}
TRAIN = {"global_batch_size": 128, "micro_batch_size": 1}
PLAN_A = {"micro_batch_size": 8, "stages": [{"devices": ["n0", "n1"], "layers": 32, "tp": 2, "dp": 8}]}
PLAN_B = {"micro_batch_size": 2, "stages": [{"devices": ["n0", "n1"], "layers": 32, "tp": 8, "dp": 2}]}
TRUTH = Calibration(factors={A100: DeviceFactors(gemm=0.55, tp_comm=0.6)}, num_runs=1)


@pytest.fixture
def files(tmp_path):
    """A job, two plan files and a metrics file of each plan, 'measured' with the true factors."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"cluster": CLUSTER, "model": MODEL, "train": TRAIN}))
    job = load_job(tmp_path / "job.yaml")
    for name, plan in (("a", PLAN_A), ("b", PLAN_B)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"plan": plan}))
        spec = load_plan_file(tmp_path / f"{name}.yaml", job)
        step = evaluate_plan(job, spec, calibration=TRUTH).step_time_s
        write_metrics(tmp_path / f"{name}.jsonl", job.to_dict(), spec.to_dict(), [3 * step, 2 * step] + [step] * 4)
    return tmp_path


def write_metrics(path, job: dict, plan: dict, times: list[float], emulate: bool = False) -> None:
    writer = MetricsWriter(path, header=header_record(job=job, plan=plan, emulate=emulate,
                                                      predicted_step_time_s=None))
    for k, t in enumerate(times):
        writer.write(StepRecord(step=k, loss=2.0, tokens_per_s=1.0, step_time_s=t, lr=1e-4, grad_norm=1.0))
    writer.close()


def run(capsys, *args: str) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def test_calibrate_from_metrics_files_then_plan_with_it(files, capsys):
    status, out, err = run(capsys, "calibrate", files / "job.yaml", files / "a.jsonl", files / "b.jsonl",
                           "-o", files / "cal.yaml")
    assert status == 0, err
    assert "calibrated from 2 real runs" in out and A100 in out and "not pinned down" in out
    cal = yaml.safe_load((files / "cal.yaml").read_text())
    assert cal["version"] == 1 and cal["num_runs"] == 2 and set(cal["device_types"]) == {A100}
    # Two runs pin the GEMM rate down only so far: the prior (a slow stack has a slow host too, and a slow memory)
    # takes some of it. The fit goes at least two thirds of the way (in log) from the uncalibrated 1.0 to the truth.
    fitted = cal["device_types"][A100]["gemm"]
    truth = TRUTH.factors[A100].gemm
    assert truth < fitted < 1.0 and math.log(fitted) < (2 / 3) * math.log(truth)
    assert all(r["ratio_after"] == pytest.approx(1.0, abs=0.02) for r in cal["runs"])

    status, plain, _ = run(capsys, "plan", files / "job.yaml", "--evaluate", files / "a.yaml", "--json")
    status, calibrated, _ = run(capsys, "plan", files / "job.yaml", "--evaluate", files / "a.yaml", "--json",
                                "--calibration", files / "cal.yaml")
    plain, calibrated = json.loads(plain), json.loads(calibrated)
    assert "calibration" not in plain
    assert calibrated["calibration"]["num_runs"] == 2 and calibrated["calibration"]["applied"]
    assert calibrated["step_time_s"] > 1.3 * plain["step_time_s"]
    status, text, _ = run(capsys, "plan", files / "job.yaml", "--evaluate", files / "a.yaml",
                          "--calibration", files / "cal.yaml")
    assert "calibrated from 2 runs" in text

    # The same through the job: cluster.calibration, relative to the job file; the search says so too.
    data = yaml.safe_load((files / "job.yaml").read_text())
    data["cluster"]["calibration"] = "cal.yaml"
    (files / "job-cal.yaml").write_text(yaml.safe_dump(data))
    status, text, _ = run(capsys, "plan", files / "job-cal.yaml", "--max-micro-batch-size", "4")
    assert status == 0 and "calibrated from 2 runs" in text
    status, text, _ = run(capsys, "plan", files / "job-cal.yaml", "--max-micro-batch-size", "4", "--json")
    assert json.loads(text)["calibration"]["num_runs"] == 2


def test_calibrate_json_names_sensitivities(files, capsys):
    status, out, _ = run(capsys, "calibrate", files / "job.yaml", files / "a.jsonl", "--json")
    doc = json.loads(out)
    assert status == 0 and doc["num_runs"] == 1
    assert set(doc["sensitivity"]) == {f"{A100}.{f}" for f in ("gemm", "memory", "overhead", "tp_comm", "dp_comm")}
    assert len(doc["not_pinned_down"]) >= 4  # one run pins one direction at most


def bad(capsys, *args) -> str:
    status, _, err = run(capsys, *args)
    assert status == 2, err
    assert "Traceback" not in err
    return err


def test_bad_runs_exit_2_naming_the_file(files, capsys):
    job = files / "job.yaml"
    assert f"{files / 'missing.jsonl'}: file not found" in bad(capsys, "calibrate", job, files / "missing.jsonl")

    other = load_job(files / "job.yaml").to_dict()
    other["model"]["hidden_size"] = 2048
    write_metrics(files / "other-model.jsonl", other, PLAN_A, [1.0] * 5)
    err = bad(capsys, "calibrate", job, files / "other-model.jsonl")
    assert f"{files / 'other-model.jsonl'}: header.job.model: the run trained another model" in err
    assert "hidden_size" in err

    other = load_job(files / "job.yaml").to_dict()
    for node in other["cluster"]["nodes"]:
        node["device"] = "ascend-910b2"
    write_metrics(files / "other-cluster.jsonl", other, PLAN_A, [1.0] * 5)
    err = bad(capsys, "calibrate", job, files / "other-cluster.jsonl")
    assert f"{files / 'other-cluster.jsonl'}: header.job.cluster: the run's device types" in err

    write_metrics(files / "nan.jsonl", load_job(job).to_dict(), PLAN_A, [1.0, 1.0, float("inf"), 1.0])
    err = bad(capsys, "calibrate", job, files / "nan.jsonl")
    assert f"{files / 'nan.jsonl'}: step 2: step_time_s must be a positive finite number" in err

    (files / "old.jsonl").write_text('{"step": 0, "step_time_s": 1.0}\n')
    assert "without a header record" in bad(capsys, "calibrate", job, files / "old.jsonl")


def test_bad_measurements_exit_2_naming_the_path(files, capsys):
    job = files / "job.yaml"
    too_many_layers = {"micro_batch_size": 2, "stages": [{"devices": ["n0", "n1"], "layers": 40, "tp": 8, "dp": 2}]}
    (files / "m.yaml").write_text(yaml.safe_dump({"measurements": [
        {"plan": "a.yaml", "tokens_per_s": 0},
        {"plan": too_many_layers, "step_time_s": 2.0},
        {"plan": "nowhere.yaml", "step_time_s": 2.0}]}))
    err = bad(capsys, "calibrate", job, files / "m.yaml")
    assert f"{files / 'm.yaml'}: 3 problems" in err
    assert "measurements[0].tokens_per_s:" in err
    assert "measurements[1].plan" in err and "layers" in err
    assert "measurements[2].plan: plan file 'nowhere.yaml' not found" in err


def test_unknown_device_type_in_a_calibration_file(files, capsys):
    (files / "cal.yaml").write_text(yaml.safe_dump({"version": 1, "num_runs": 2,
                                                    "device_types": {"nvidia-a100-80gb": {"gemm": 0.5}}}))
    err = bad(capsys, "plan", files / "job.yaml", "--evaluate", files / "a.yaml", "--calibration", files / "cal.yaml")
    assert f"{files / 'cal.yaml'}: 1 problem" in err
    assert "device_types.nvidia-a100-80gb: unknown device type 'nvidia-a100-80gb'" in err


def test_calibrate_subprocess_exit_codes(files):
    """As a user runs it: a good run exits 0, a missing file exits 2 with one line and no traceback."""
    ok = subprocess.run([sys.executable, "-m", "heteroflow", "calibrate", str(files / "job.yaml"),
                         str(files / "a.jsonl"), "-o", str(files / "cal.yaml")],
                        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([sys.executable, "-m", "heteroflow", "calibrate", str(files / "job.yaml"),
                              str(files / "none.jsonl")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"{files / 'none.jsonl'}: file not found" in missing.stderr


def test_train_says_it_is_calibrated(files, capsys):
    """`train` reads the job's calibration before launching and prints where its prediction comes from."""
    from heteroflow.launcher.prepare import calibration_line
    assert run(capsys, "calibrate", files / "job.yaml", files / "a.jsonl", files / "b.jsonl", "-o",
               files / "cal.yaml")[0] == 0
    data = yaml.safe_load((files / "job.yaml").read_text())
    assert calibration_line(load_job(files / "job.yaml"), emulate=False) is None
    data["cluster"]["calibration"] = "cal.yaml"
    (files / "job-cal.yaml").write_text(yaml.safe_dump(data))
    job = load_job(files / "job-cal.yaml")
    assert calibration_line(job, emulate=False) == f"predicted step time calibrated from 2 runs ({files / 'cal.yaml'})"
    assert "not applied: it was fitted on real (not emulated) runs" in calibration_line(job, emulate=True)
