"""End-to-end: `heteroflow train --emulate` with a rank frozen by SIGSTOP names that rank, not rank 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

JOB = """\
cluster: {nodes: [{name: a, device: cpu, count: 2}]}
model: {preset: micro-llama}
train: {global_batch_size: 4, steps: 4}
plan: {micro_batch_size: 2, stages: [{devices: ["a:0"], layers: 2}, {devices: ["a:1"], layers: 2}]}
"""


@pytest.mark.slow
def test_frozen_rank_is_named_by_the_rank_waiting_for_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache"), "HETEROFLOW_INJECT_FAULT": "freeze@1:1"}
    result = subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", "--timeout", "3",
                             "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=400,
                            cwd=REPO, env=env)
    assert result.returncode != 0, result.stdout + result.stderr
    # rank 0 notices (it waits for stage 1 in step 1) and names rank 1, which stopped as step 1 began (almost
    # always before its heartbeat could publish step 1, and on a quick step 0 sometimes before it published that)
    assert re.search(r"rank 0 failed \(exit code 3\): StepTimeout: heteroflow watchdog: rank 1 \(stage 1, dp 0 cp 0 "
                     r"tp 0, node a\) (did not reach step 1 \(it (is in step 0|has not started a step); its heartbeat "
                     r"stopped: frozen or dead\)"
                     r"|is in step 1 but its heartbeat stopped: frozen or dead); rank 0 \(stage 0, dp 0 cp 0 tp 0, "
                     r"node a\) has waited for it in step 1 for", result.stderr), result.stderr[-4000:]
