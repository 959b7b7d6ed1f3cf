"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def problems(data: dict) -> list[str]:
    """The `path: message` lines the strict loader reports for job `data`, or [] when it is valid."""
    from heteroflow.config import parse_job
    from heteroflow.errors import ConfigError

    try:
        parse_job(data)
    except ConfigError as error:
        return [str(p) for p in error.problems]
    return []


@pytest.fixture
def write_yaml(tmp_path):
    """Write dedented YAML text to a file in tmp_path and return its path."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


def run_heteroflow(*args: str, env: dict | None = None, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python -m heteroflow ARGS` from the repository root, output captured."""
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env=env)


@pytest.fixture
def cache_env(tmp_path) -> dict:
    """The environment with heteroflow's cache in this test's directory."""
    return {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
