"""SIGTERM / SIGINT to `heteroflow train`: every rank stops after the same step, a checkpoint of that step is
written, one line says how to resume, the exit status is 128 + the signal, no traceback; `--resume` then
reproduces the uninterrupted losses. A second signal, or the grace period running out, stops at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

from heteroflow.launcher.launch import free_port
from heteroflow.runtime.metrics import read_step_records
from multinode_helpers import job_dict, outputs, start_nodes, stop_all, wait_nodes, write_job

pytestmark = pytest.mark.slow

FULL_STEPS = 2000
"""train.steps of the jobs: the learning-rate schedule's length; runs stop long before it."""
STEPS = 30
"""The uninterrupted reference and the resumed runs end here (`--steps`), on the schedule of FULL_STEPS."""

JOB = {"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 2}]},
       "model": {"preset": "micro-llama"},
       "train": {"global_batch_size": 4, "precision": "fp32", "steps": FULL_STEPS, "warmup_steps": 2,
                 "checkpoint": {"dir": "ckpt", "interval": 1000}},
       "plan": {"micro_batch_size": 2, "stages": [{"devices": ["a:0"], "layers": 2},
                                                  {"devices": ["a:1"], "layers": 2}]}}

_REFERENCE: dict[str, list[float]] = {}


def _env(tmp: Path, **extra: str) -> dict:
    return {**os.environ, "HETEROFLOW_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", **extra}


def _train(tmp: Path, job: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=_env(tmp))


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_step_records(path)}


def _reference(tmp: Path, data: dict, key: str) -> list[float]:
    """The uninterrupted run's losses of steps [0, STEPS) of job `data` (every rank here), once per job kind."""
    if key not in _REFERENCE:
        (tmp / "reference").mkdir()
        job = write_job(tmp / "reference" / "job.yaml", data)  # its checkpoints apart from the test's
        metrics = tmp / "reference" / "metrics.jsonl"
        result = _train(tmp, job, "--steps", str(STEPS), "--metrics", str(metrics))
        assert result.returncode == 0, result.stderr[-3000:]
        _REFERENCE[key] = [_losses(metrics)[s] for s in range(STEPS)]
    return _REFERENCE[key]


def _wait_for_steps(metrics: Path, count: int, procs: list[subprocess.Popen], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and len(read_step_records(metrics)) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {count} steps in {metrics} within {timeout_s} s")


def _start(tmp: Path, job: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`heteroflow train` in a session of its own (a terminal's process group), output to tmp/run.out."""
    out = open(tmp / "run.out", "w")
    return subprocess.Popen([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", *args],
                            cwd=REPO, env=env or _env(tmp), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _check_stopped(text: str, signum: int, root: Path) -> int:
    """The stop line's step, after checking that line, the checkpoint it names, and that nothing printed a
    traceback; returns the step the checkpoint resumes at."""
    name = signal.Signals(signum).name
    found = re.findall(rf"heteroflow train: stopped by {name} after step (\d+); checkpoint (\S+) \(step (\d+)\); "
                       r"resume with: heteroflow train .* --resume", text)
    assert len(found) == 1, text[-4000:]
    last, where, next_step = found[0]
    assert int(next_step) == int(last) + 1
    assert Path(where) == root / f"step-{int(next_step):06d}"
    assert (Path(where) / "heteroflow-checkpoint.json").exists(), "the checkpoint is not complete"
    assert "Traceback" not in text, text[-4000:]
    return int(next_step)


def _check_resume(tmp: Path, job: Path, step: int, reference: list[float]) -> None:
    assert 0 < step < STEPS, f"stopped at step {step}, not within the reference's {STEPS} steps"
    metrics = tmp / "resumed.jsonl"
    result = _train(tmp, job, "--resume", "--steps", str(STEPS), "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed at step {step}" in result.stdout, result.stdout[-2000:]
    resumed = _losses(metrics)
    assert sorted(resumed) == list(range(step, STEPS))
    assert [resumed[s] for s in range(step, STEPS)] == reference[step:]  # same plan: bit for bit


def _no_traceback_in_logs(log_dir: Path) -> None:
    for log in log_dir.rglob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log


@pytest.mark.parametrize("signum, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["sigterm-to-the-agent", "sigint-to-the-terminal-group"])
def test_signal_saves_a_checkpoint_and_resume_reproduces_the_losses(tmp_path, signum, to_group):
    job = write_job(tmp_path / "job.yaml", JOB)
    reference = _reference(tmp_path, JOB, "single")
    metrics = tmp_path / "metrics.jsonl"
    proc = _start(tmp_path, job, "--metrics", str(metrics), "--log-dir", str(tmp_path / "logs"))
    try:
        _wait_for_steps(metrics, 2, [proc])
        (os.killpg if to_group else os.kill)(proc.pid, signum)  # Ctrl-C reaches every process of the group
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "run.out").read_text()
    assert code == 128 + signum, text[-4000:]
    step = _check_stopped(text, signum, tmp_path / "ckpt")
    assert max(_losses(metrics)) == step - 1  # every step run was checkpointed
    _no_traceback_in_logs(tmp_path / "logs")
    _check_resume(tmp_path, job, step, reference)


@pytest.mark.parametrize("second", [True, False], ids=["second-signal", "grace-runs-out"])
def test_a_step_that_cannot_finish_is_abandoned(tmp_path, second):
    """Rank 1 hangs in step 3: the first signal cannot end the step; a second signal, or --stop-grace, ends
    the run at once with the documented status and no traceback."""
    job = write_job(tmp_path / "job.yaml", JOB)
    metrics = tmp_path / "metrics.jsonl"
    grace = 60 if second else 3  # the second signal comes long before the grace period ends
    proc = _start(tmp_path, job, "--metrics", str(metrics), "--stop-grace", str(grace),
                  env=_env(tmp_path, HETEROFLOW_INJECT_FAULT="hang@1:3"))
    try:
        # A step's record is written at the next step's read of its loss: two records mean both ranks took step 2's
        # stop flags (unset) before rank 1 hangs in step 3.
        _wait_for_steps(metrics, 2, [proc])
        time.sleep(0.5)
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        if second:
            time.sleep(0.5)
            os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "run.out").read_text()
    assert code == 143, text[-4000:]
    why = "a second SIGTERM" if second else "the ranks did not stop within --stop-grace 3 s of SIGTERM"
    assert f"heteroflow train: stopped at once after {why}: the step in flight and its checkpoint were abandoned; " \
           f"the newest complete checkpoint in {tmp_path / 'ckpt'} is kept; continue from it with: " in text, text[-3000:]
    assert "Traceback" not in text, text[-4000:]
    assert took < 30 and (second or took >= grace), took  # bounded: not the hung step, nor the collective timeout
    assert not list(tmp_path.glob("ckpt/step-*/heteroflow-checkpoint.json")), "no step was complete to save"


def test_signal_at_one_node_stops_every_node(tmp_path):
    """Two local node agents; SIGTERM to node b's agent only (not hosting the rendezvous, not holding rank 0)."""
    data = job_dict(steps=FULL_STEPS, checkpoint={"dir": "ckpt", "interval": 1000})
    job = write_job(tmp_path / "job.yaml", data)
    single = write_job(tmp_path / "single.yaml", data)  # the same job and plan, every rank here
    reference = _reference(tmp_path, data, "multi")
    metrics = tmp_path / "metrics.jsonl"
    nodes = start_nodes(tmp_path, job, ["a", "b"], free_port(), "--metrics", str(metrics), "--timeout", "120",
                        "--join-timeout", "120")
    try:
        _wait_for_steps(metrics, 2, [n.proc for n in nodes])
        os.kill(nodes[1].proc.pid, signal.SIGTERM)
        codes = wait_nodes(nodes, 180)
    finally:
        stop_all(nodes)
    assert codes == {"a": 143, "b": 143}, outputs(nodes)
    step = _check_stopped(nodes[0].output(), signal.SIGTERM, tmp_path / "ckpt")
    assert _check_stopped(nodes[1].output(), signal.SIGTERM, tmp_path / "ckpt") == step
    assert "SIGTERM received" in nodes[1].output() and "SIGTERM received" not in nodes[0].output()
    _no_traceback_in_logs(tmp_path / "logs")
    _check_resume(tmp_path, single, step, reference)


def test_ctrl_c_ends_tune_instead_of_the_next_trial_running(tmp_path):
    """`heteroflow tune` runs trials through the same launcher: Ctrl-C in a trial ends the whole tuning."""
    job = write_job(tmp_path / "job.yaml", {k: v for k, v in JOB.items() if k != "plan"})  # tune plans it
    metrics = tmp_path / "work" / "trial-1.jsonl"
    out = open(tmp_path / "run.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "heteroflow", "tune", str(job), "--emulate", "--top", "2",
                             "--steps", str(FULL_STEPS), "--work-dir", str(tmp_path / "work"), "-o",
                             str(tmp_path / "best.yaml")], cwd=REPO, env=_env(tmp_path), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_steps(metrics, 2, [proc])
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "run.out").read_text()
    assert code == 130, text[-4000:]
    assert "heteroflow tune: stopped by SIGINT during trial trial-1: tuning abandoned" in text, text[-3000:]
    assert "trial-2" not in text and "Traceback" not in text, text[-4000:]
