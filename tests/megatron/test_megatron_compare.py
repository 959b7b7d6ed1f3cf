"""`import-megatron --compare`: the imported layout next to the planner's plan on the same cluster."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_compare_prices_both_plans_side_by_side(tmp_path):
    result = subprocess.run([sys.executable, "-m", "heteroflow", "import-megatron",
                             "tests/megatron/scripts/train_llama3_8b_h100_fp8.sh", "--cluster",
                             "configs/clusters/nvidia-ascend.yaml", "--nnodes", "1", "--nproc-per-node", "8",
                             "--compare", "-o", str(tmp_path / "job.yaml")],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Megatron layout vs heteroflow's plan" in out
    megatron = out[out.index("megatron (imported):"):out.index("heteroflow (planned):")]
    planned = out[out.index("heteroflow (planned):"):]
    assert megatron.count("stage ") == 2 and "tp2 dp2 sp" in megatron  # the script's tp 2 x pp 2 x dp 2
    assert "tokens/s" in planned and "heteroflow / megatron:" in planned
    ratio = float(planned.split("heteroflow / megatron:")[1].split("x")[0])
    assert ratio >= 1.0  # the planner may keep the Megatron layout, never do worse by its own model


def test_compare_needs_a_device_type():
    result = subprocess.run([sys.executable, "-m", "heteroflow", "import-megatron",
                             "tests/megatron/scripts/train_llama3_8b_h100_fp8.sh", "--compare"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2 and "--compare needs the cluster's device type" in result.stderr
    assert "Traceback" not in result.stderr
