"""`heteroflow train` multi-node flags: misuse is a user error (exit 2, one clear line), before any launch."""

from __future__ import annotations

import pytest

from heteroflow.cli import main
from multinode_helpers import job_dict, write_job


@pytest.mark.parametrize("flags,message", [
    (["--node", "a"], "a multi-node run needs both --node NAME and --rdzv HOST:PORT"),
    (["--rdzv", "127.0.0.1:29400"], "a multi-node run needs both --node NAME and --rdzv HOST:PORT"),
    (["--replan-on-failure"], "--replan-on-failure applies to multi-node runs"),
    (["--max-restarts", "-1"], "--max-restarts: must be between 0 and 10000, got -1"),
    (["--join-timeout", "0"], "--join-timeout: must be between 1 and 2592000, got 0"),
    (["--node", "a", "--rdzv", "127.0.0.1"], "--rdzv expects HOST:PORT (for example 10.0.0.1:29400), got '127.0.0.1'"),
])
def test_train_multinode_flag_errors(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.setenv("HETEROFLOW_CACHE", str(tmp_path / "cache"))
    job = write_job(tmp_path / "job.yaml", job_dict())
    assert main(["train", str(job), "--emulate", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_multi_node_plan_without_emulate_or_node_says_how_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HETEROFLOW_CACHE", str(tmp_path / "cache"))
    job = write_job(tmp_path / "job.yaml", job_dict())
    assert main(["train", str(job)]) == 2
    assert "run `heteroflow train JOB --node NAME --rdzv HOST:PORT` on each of them" in capsys.readouterr().err
