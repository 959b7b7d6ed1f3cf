"""`heteroflow tune` end to end on a tiny emulated job, and its bad input (`path: message`, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from heteroflow.cli import main
from heteroflow.config import load_job, load_plan_file
from heteroflow.runtime.metrics import read_metrics
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.calibration import load_calibration

JOB = """
cluster: {nodes: [{name: a, device: nvidia-a100-80g, count: 2}, {name: b, device: ascend-910b2, count: 2}]}
model: {preset: micro-llama}
train: {global_batch_size: 4, micro_batch_size: 2, precision: fp32, steps: 100,
        checkpoint: {dir: ckpt, interval: 1, keep: 1}}
"""


@pytest.mark.slow
def test_tune_emulated_runs_the_top_plans_calibrates_and_writes_the_best_measured(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "heteroflow", "tune", str(tmp_path / "job.yaml"), "--top", "2",
                             "--steps", "3", "--emulate", "-o", str(tmp_path / "best.yaml")],
                            capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    job = load_job(tmp_path / "job.yaml")
    work = tmp_path / "best.tune"
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("trial-")]
    assert [r[1:3] for r in rows[:2]] == [["top", "1"], ["top", "2"]] and len(rows) in (2, 3)
    measured = {}
    for row in rows:
        name = row[0].rstrip("*")
        plan = load_plan_file(work / f"{name}.yaml", job)
        (header, steps), = read_metrics(work / f"{name}.jsonl")  # each trial measured its own plan, in the work dir
        assert header["emulate"] is True and len(steps) == 3 and header["plan"] == plan.to_dict()
        assert header["job"]["train"].get("checkpoint") is None
        measured[name] = float(row[5])
    best = min(measured, key=measured.get)
    assert [r[0] for r in rows if r[0].endswith("*")] == [best + "*"]
    assert not (tmp_path / "ckpt").exists()  # trials never write into the user's checkpoint directory

    calibration = load_calibration(work / "calibration.yaml", device_types=job.cluster.device_types)
    assert calibration.emulate and calibration.num_runs == 2
    # One set of factors for every label: an emulated rank is the same CPU whatever its device type.
    assert len({f for f in calibration.factors.values()}) == 1 and set(calibration.factors) == {
        "nvidia-a100-80g", "ascend-910b2"}

    written = yaml.safe_load((tmp_path / "best.yaml").read_text())
    plan = load_plan_file(tmp_path / "best.yaml", job)  # reads back as `plan -o` output does
    assert plan.to_dict() == load_plan_file(work / f"{best}.yaml", job).to_dict()
    assert written["plan"]["measured"]["step_time_s"] == pytest.approx(measured[best], rel=1e-3)
    calibrated = evaluate_plan(job, plan, emulate=True, calibration=calibration).step_time_s
    assert written["plan"]["predicted"]["step_time_s"] == pytest.approx(calibrated, rel=1e-4)


def run(capsys, *args) -> tuple[int, str]:
    status = main([str(a) for a in args])
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, err


def test_tune_bad_input_exits_2_with_path_and_message(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "best.yaml"
    status, err = run(capsys, "tune", job, "--emulate", "--steps", "2", "-o", out)
    assert status == 2 and "--steps: at least 3" in err
    status, err = run(capsys, "tune", job, "--emulate", "--top", "0", "-o", out)
    assert status == 2 and "--top: must be between 1 and 64, got 0" in err
    status, err = run(capsys, "tune", tmp_path / "missing.yaml", "--emulate", "-o", out)
    assert status == 2 and f"{tmp_path / 'missing.yaml'}" in err
    status, err = run(capsys, "tune", job, "--emulate", "-o", tmp_path / "no" / "such" / "dir" / "best.yaml")
    assert status == 2 and err.startswith("-o: ")
    status, err = run(capsys, "tune", job, "--node", "a", "-o", out)
    assert status == 2 and "--rdzv" in err

    (tmp_path / "best.tune").mkdir()
    (tmp_path / "best.tune" / "trial-1.jsonl").write_text("{}\n")  # an earlier tune's files are never overwritten
    status, err = run(capsys, "tune", job, "--emulate", "-o", out)
    assert status == 2 and f"{tmp_path / 'best.tune'}: the tune work directory already holds files" in err
    assert (tmp_path / "best.tune" / "trial-1.jsonl").read_text() == "{}\n"

    big = tmp_path / "big.yaml"
    big.write_text("cluster: {nodes: [{name: a, device: nvidia-a100-80g, count: 1}]}\n"
                   "model: {preset: llama2-70b}\ntrain: {global_batch_size: 4}\n")
    status, err = run(capsys, "tune", big, "--emulate", "-o", out, "--work-dir", tmp_path / "w2")
    assert status == 2 and "no plan that fits" in err
