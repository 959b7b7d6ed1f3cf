"""End-to-end: `heteroflow plan` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.config import load_job, load_plan_file
from heteroflow.stagemap import evaluate_plan

QWEN = REPO / "configs" / "jobs" / "qwen2.5-7b-dcu.yaml"
EMULATED = REPO / "configs" / "jobs" / "emulated-three-vendor.yaml"


def heteroflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One search of the qwen job, writing JSON, a plan file and a Gantt chart."""
    out = tmp_path_factory.mktemp("plan")
    result = heteroflow("plan", str(QWEN), "--json", "-o", str(out / "plan.yaml"), "--gantt", str(out / "gantt.png"))
    return result, out


def test_plan_json_follows_the_contract(planned):
    result, _ = planned
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("feasible", "search_time_s", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "stages",
                "baselines"):
        assert key in data, key
    assert data["feasible"] is True and data["tokens_per_s"] > 0
    layers = 0
    for stage in data["stages"]:
        for key in ("devices", "device_type", "num_devices", "layers", "tp", "dp", "memory_peak_gib",
                    "memory_capacity_gib", "forward_s", "backward_s"):
            assert key in stage, key
        first, last = stage["layers"]
        assert first == layers and last > first
        layers = last
        assert stage["memory_peak_gib"] <= stage["memory_capacity_gib"]
    assert layers == 28
    for name in ("megatron_uniform", "best_single_type"):
        assert data["baselines"][name]["tokens_per_s"] <= data["tokens_per_s"]


def test_plan_file_loads_and_evaluates_to_the_same_prediction(planned):
    result, out = planned
    data = json.loads(result.stdout)
    job = load_job(QWEN)
    plan = load_plan_file(out / "plan.yaml", job)  # the strict loader accepts the planner's output as is
    assert evaluate_plan(job, plan).step_time_s == pytest.approx(data["step_time_s"], rel=1e-12)
    again = heteroflow("plan", str(QWEN), "--evaluate", str(out / "plan.yaml"), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["step_time_s"] == pytest.approx(data["step_time_s"], rel=1e-12)


def test_gantt_is_a_png(planned):
    _, out = planned
    assert (out / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_prints_tables_with_the_baselines():
    result = heteroflow("plan", str(EMULATED))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for word in ("stage", "device type", "layers", "mem GiB peak/cap", "fwd ms", "bwd ms", "bubble", "tokens/s",
                 "MFU", "megatron_uniform", "best_single_type"):
        assert word in text, word


def test_evaluate_the_jobs_own_plan_and_a_homogeneous_one(tmp_path):
    result = heteroflow("plan", str(QWEN), "--evaluate")
    assert result.returncode == 0 and "estimate of" in result.stdout
    uniform = tmp_path / "uniform.yaml"
    uniform.write_text("plan:\n  schedule: 1f1b\n  micro_batch_size: 8\n  stages:\n"
                       "    - {devices: [bw-0, bw-1], layers: 14, tp: 2, dp: 8, zero: 1}\n"
                       "    - {devices: [k100-0, k100-1], layers: 14, tp: 2, dp: 8, zero: 1}\n")
    result = heteroflow("plan", str(QWEN), "--evaluate", str(uniform), "--json")
    assert result.returncode == 0, result.stderr
    assert [s["layers"] for s in json.loads(result.stdout)["stages"]] == [[0, 14], [14, 28]]


def test_evaluate_reports_stages_that_do_not_fit(tmp_path):
    tight = tmp_path / "tight.yaml"
    tight.write_text("plan:\n  micro_batch_size: 32\n  stages:\n"
                     "    - {devices: [bw-0, bw-1], layers: 27, tp: 1, dp: 16}\n"
                     "    - {devices: [k100-0, k100-1], layers: 1, tp: 1, dp: 16}\n")
    result = heteroflow("plan", str(QWEN), "--evaluate", str(tight), "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["feasible"] is False and data["problems"][0].startswith("stage 0 (16 x hygon-bw1000")


def test_user_errors_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("plan:\n  stages:\n    - {devices: [nope], layers: 28}\n")
    result = heteroflow("plan", str(QWEN), "--evaluate", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown node 'nope'" in result.stderr


def test_emulated_estimate_prices_this_machine():
    result = heteroflow("plan", str(EMULATED), "--evaluate", "--emulate", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["emulate"] is True and data["step_time_s"] > 0.01  # CPU processes: orders slower than GPUs


def test_plan_searches_every_priced_layout_and_train_runs_it(tmp_path):
    job_path = REPO / "configs" / "jobs" / "llama3-70b-three-vendor.yaml"
    runnable = heteroflow("plan", str(job_path), "--json", "-o", str(tmp_path / "plan.yaml"))
    alias = heteroflow("plan", str(job_path), "--json", "--all-layouts")  # kept for old scripts: the same search
    assert runnable.returncode == 0 and alias.returncode == 0, runnable.stderr + alias.stderr
    ours, same = json.loads(runnable.stdout), json.loads(alias.stdout)
    load_plan_file(tmp_path / "plan.yaml", load_job(job_path))  # `train --plan` takes it as is (a bad plan raises)
    assert same["tokens_per_s"] == ours["tokens_per_s"] and same["stages"] == ours["stages"]
