"""End-to-end: a rank frozen (SIGSTOP) in a run whose ranks wait for it inside C++ (a stage boundary's remap
and replica fan-out, a tp collective): the heartbeats name the frozen rank, whatever the waiting ranks' stacks
show, and the report says which ranks wait for it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO

JOB = """\
cluster: {nodes: [{name: a, device: cpu, count: 3}]}
model: {preset: micro-llama}
train: {global_batch_size: 4, steps: 4}
plan: {micro_batch_size: 2, stages: [{devices: ["a:0"], layers: 2}, {devices: ["a:1", "a:2"], layers: 2, tp: 2}]}
"""


@pytest.mark.slow
def test_a_frozen_tp_rank_is_named_by_its_peer_blocked_in_the_replica_fan_out(tmp_path):
    """Rank 1 (stage 1, tp 0) receives stage 0's activations and fans them out to rank 2 (tp 1), which then
    waits in `work.wait()` under `remap/executor.py _finish`; rank 0 waits for stage 1's gradients."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache"), "HETEROFLOW_INJECT_FAULT": "freeze@1:1"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", "--timeout", "5",
                             "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=400,
                            cwd=REPO, env=env)
    took = time.monotonic() - started
    assert result.returncode != 0, result.stdout + result.stderr
    failed = re.findall(r"rank (\d) failed \(exit code 3\): StepTimeout: heteroflow watchdog: (.*)", result.stderr)
    assert failed, result.stderr[-4000:]
    for rank, line in failed:  # every report blames rank 1, none its own rank
        assert rank in ("0", "2"), result.stderr[-4000:]
        assert re.match(r"rank 1 \(stage 1, dp 0 cp 0 tp 0, node a\) (did not reach step 1|is in step 1 but its "
                        r"heartbeat stopped)", line), line
        assert f"rank {rank} (stage {min(int(rank), 1)}, dp 0 cp 0 tp {int(rank) // 2}, node a) has waited for it in " \
            "step 1 for" in line, line
        assert "it is waiting for other ranks at" in line, line
        other = "2" if rank == "0" else "0"
        assert f"; rank {other} is in step 1 too, waiting" in line, line
    assert "computing or stuck" not in result.stderr, result.stderr[-4000:]
    assert took < 150, took  # the 5 s step limit, a few heartbeats, the start-up: not the collective timeouts
