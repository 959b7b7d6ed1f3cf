"""Every benchmark under `benchmarks/` runs in its quick mode (tiny sizes, one round), so that a refactor cannot break
one unnoticed. Each prints what it measures; the test checks the run ends cleanly and prints its result line (the
numbers of a quick run mean nothing). Benchmarks that launch several ranks or train are marked slow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

FAST = {  # script -> a piece of its result output
    "bench_calibration_published.py": "pairs: ",
    "bench_group_setup.py": "members",
    "bench_init_shard.py": "tp share 1/8, tiles",
    "bench_published_choice.py": "Kendall tau-b",
    "bench_indexed_data.py": "samples equal: yes",
    "bench_moe_layer.py": "",
    "bench_moe_router_options.py": "",
    "bench_offload_io.py": "",
    "bench_planner.py": "64 devices",
    "bench_moe_ep_plan.py": "| model | devices |",
    "bench_swap_checksum.py": "",
}
SLOW = {
    "bench_calibration.py": "whole run",
    "bench_compile.py": "ratio eager / compiled",
    "bench_context_parallel.py": "cp2 / cp1",
    "bench_fp16_scaling.py": "",
    "bench_memory.py": "ranks within 10% of the planner's figure",
    "bench_moe_ep.py": "",
    "bench_offload_capacity.py": "",
    "bench_offload_vs_deepspeed.py": "heteroflow",
    "bench_pipeline.py": "",
    "bench_predicted_vs_measured.py": "whole run",
    "bench_remap.py": "",
    "bench_stage_timing.py": "",
    "bench_zero3.py": "ratio",
    "bench_zero_offload.py": "",
    "tp_dtensor_vs_functions.py": "",
}
NO_DEEPSPEED_AIO = "DeepSpeed's async_io op (its NVMe offload) cannot build: libaio's headers are missing"
"""What bench_offload_vs_deepspeed says, exiting 2 after heteroflow's side, on a machine without libaio-dev."""


def test_every_benchmark_has_a_quick_mode_test():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    assert scripts == FAST.keys() | SLOW.keys()


def _run_quick(script: str, expected: str, tmp_path) -> None:
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache"), "HETEROFLOW_SWAP_DIR": str(tmp_path),
           "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick"], capture_output=True,
                            text=True, timeout=1200, cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    if script == "bench_offload_vs_deepspeed.py" and result.returncode == 2:
        assert NO_DEEPSPEED_AIO in result.stderr and "Traceback" not in output, output[-4000:]
        assert "round 1 heteroflow" in result.stdout, output[-4000:]  # heteroflow's side still ran
        return
    assert result.returncode == 0, output[-6000:]
    assert expected in result.stdout, output[-4000:]


@pytest.mark.parametrize("script", sorted(FAST))
def test_quick_mode_runs(script, tmp_path):
    _run_quick(script, FAST[script], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SLOW))
def test_quick_mode_runs_slow(script, tmp_path):
    _run_quick(script, SLOW[script], tmp_path)
