"""A worker's user error and a diverged run reach the user as one clear message and exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.errors import UserError
from heteroflow.runtime.metrics import StepRecord, read_step_records
from heteroflow.runtime.user_errors import (ENV_ERROR_DIR, clear_user_error, error_dir, read_user_errors,
                                            record_user_error, user_error_message)


def test_recorded_errors_are_read_back_by_rank_and_summarised(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ERROR_DIR, str(error_dir(tmp_path)))
    record_user_error(UserError("swap directory /x is read-only"), 3)
    record_user_error(UserError("swap directory /x is read-only"), 1)
    record_user_error(UserError("disk full"), 2)
    errors = read_user_errors(error_dir(tmp_path))
    assert [rank for rank, _ in errors] == [1, 2, 3]
    message = user_error_message(errors)
    assert message.splitlines() == ["swap directory /x is read-only (rank 1 and 2 more ranks)", "also: disk full"]
    assert user_error_message(errors[:1]) == "swap directory /x is read-only (rank 1)"


def test_a_restarted_rank_clears_what_it_left_in_an_earlier_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ERROR_DIR, str(error_dir(tmp_path)))
    record_user_error(UserError("swap block 3 fails its checksum"), 1)
    record_user_error(UserError("disk full"), 2)
    clear_user_error(1)  # rank 1 starts again after an elastic restart
    clear_user_error(5)  # nothing to clear
    assert read_user_errors(error_dir(tmp_path)) == [(2, "disk full")]


def test_outside_a_launched_run_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ERROR_DIR, raising=False)
    record_user_error(UserError("x"), 0)
    assert read_user_errors(error_dir(tmp_path)) == []


def test_metrics_lines_are_strict_json_even_for_non_finite_figures():
    record = StepRecord(step=0, loss=math.nan, tokens_per_s=math.inf, step_time_s=1.0, lr=1e-3, grad_norm=-math.inf)
    data = json.loads(record.to_json())  # json.loads would accept NaN; the writer must not produce it
    assert "NaN" not in record.to_json() and "Infinity" not in record.to_json()
    assert data["loss"] is None and data["tokens_per_s"] is None and data["grad_norm"] is None


DIVERGING_JOB = """
    cluster: {nodes: [{name: a, device: cpu, count: 2}]}
    model: {preset: micro-llama}
    train: {global_batch_size: 4, steps: 10, lr: 10, warmup_steps: 0, grad_clip: 0, %s}
    plan:
      micro_batch_size: 2
      stages:
        - {devices: ["a:0"], layers: 2}
        - {devices: ["a:1"], layers: 2}
    """


@pytest.mark.slow
def test_a_diverging_run_stops_before_applying_the_bad_step_and_exits_2(tmp_path, write_yaml):
    job = write_yaml(DIVERGING_JOB % "checkpoint: {dir: ckpt, interval: 1, keep: 10}")
    metrics = tmp_path / "metrics.jsonl"
    result = subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", "--metrics",
                             str(metrics), "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "training diverged" in result.stderr and "that step was not applied" in result.stderr
    assert str(tmp_path / "logs") in result.stderr  # where the ranks' logs (and elastic's tracebacks) are
    records = read_step_records(metrics)
    assert records and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    diverged_at = len(records)  # the step that saw the non-finite figures wrote no record and no checkpoint
    assert f"at step {diverged_at}" in result.stderr
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert saved[-1] == f"step-{diverged_at:06d}"
