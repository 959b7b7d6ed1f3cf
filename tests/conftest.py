"""Shared test helpers."""

from __future__ import annotations

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
