"""End-to-end: the `heteroflow` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

EXAMPLE_JOBS = sorted((REPO / "configs" / "jobs").glob("*.yaml"))


def heteroflow(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.mark.parametrize("job", EXAMPLE_JOBS, ids=lambda p: p.name)
def test_example_jobs_validate(job):
    result = heteroflow("validate", str(job))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "cluster:" in result.stdout


def test_example_jobs_exist():
    assert len(EXAMPLE_JOBS) >= 4


def test_invalid_job_exits_2_with_paths_and_no_traceback(write_yaml):
    job = write_yaml("""
        cluster:
          nodes:
            - {name: a, device: nvidia-a100-80g, count: 4}
            - {name: b, device: a100, count: 0}
        model: {preset: llama2-7b, colour: red}
        train: {global_batch_size: 8}
        """)
    result = heteroflow("validate", str(job))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"{job}: 3 problems"
    assert any(line.startswith("cluster.nodes[1].device: unknown device type 'a100' (did you mean "
                               "'nvidia-a100-80g'") for line in lines), lines
    assert "cluster.nodes[1].count: must be between 1 and 1024, got 0" in lines
    assert "model.colour: unknown key" in lines


def test_yaml_syntax_error_exits_2(write_yaml):
    job = write_yaml("cluster: [\n")
    result = heteroflow("validate", str(job))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{job}:2:1: YAML error" in result.stderr


def test_missing_job_file_exits_2():
    result = heteroflow("validate", "no-such-job.yaml")
    assert result.returncode == 2 and "file not found" in result.stderr and "Traceback" not in result.stderr


def test_devices_shows_this_cpu():
    result = heteroflow("devices", "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert any(d["vendor"] == "cpu" for d in found), found


def test_catalog_json_lists_the_chips():
    result = heteroflow("devices", "--catalog", "--json")
    assert result.returncode == 0, result.stderr
    names = {d["name"] for d in json.loads(result.stdout)}
    assert {"nvidia-a100-80g", "ascend-910a", "hygon-bw1000", "amd-mi300x", "cpu"} <= names


def test_unknown_command_exits_2():
    result = heteroflow("frobnicate")
    assert result.returncode == 2 and "Traceback" not in result.stderr
