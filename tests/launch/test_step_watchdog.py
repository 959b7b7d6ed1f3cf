"""The per-rank step watchdog (in a child process, since it ends the process) and the fault hook."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from heteroflow.runtime.watchdog import EXIT_STUCK, collective_timeout_s, parse_fault

CHILD = textwrap.dedent("""
    import sys, time
    from heteroflow.runtime.watchdog import StepWatchdog

    def slow_forward():
        time.sleep(60)

    dog = StepWatchdog(limit_s=0.5, rank=5, where="stage 2, dp 1 cp 0 tp 0, node npu-0")
    dog.begin(0)
    dog.begin(1)
    slow_forward()
""")


def test_stuck_step_is_reported_with_rank_stage_step_and_place(tmp_path):
    error_file = tmp_path / "error.json"
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                 "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert result.returncode == EXIT_STUCK, result.stderr
    assert ("heteroflow watchdog: rank 5 (stage 2, dp 1 cp 0 tp 0, node npu-0) has been in step 1 for"
            in result.stderr)
    assert "over the step limit of 0.5 s (--timeout); it is computing or stuck at <string>:6 slow_forward" \
        in result.stderr
    payload = json.loads(error_file.read_text())  # where the elastic agent looks for a rank's error
    assert payload["message"]["message"].startswith("StepTimeout: heteroflow watchdog: rank 5")
    assert "slow_forward" in payload["message"]["extraInfo"]["py_callstack"]


def test_collectives_wait_longer_than_the_step_limit():
    assert collective_timeout_s(600) == 660 and collective_timeout_s(10) == 15


def test_fault_hook_syntax():
    assert parse_fault("kill@3:2") == ("kill", 3, 2) and parse_fault("hang@0:0") == ("hang", 0, 0)
    assert parse_fault("freeze@1:4") == ("freeze", 1, 4)
    for bad in ("kill", "explode@1:1", "kill@x:1", "hang@1"):
        with pytest.raises(ValueError, match="expected KIND@RANK:STEP with KIND one of kill, hang, freeze"):
            parse_fault(bad)
