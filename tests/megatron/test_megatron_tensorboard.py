"""Megatron's --tensorboard-dir / --tensorboard-log-interval -> train.tensorboard_dir / tensorboard_log_interval."""

from __future__ import annotations

from megatron_helpers import import_args


def test_megatron_tensorboard_flags_are_mapped(tmp_path):
    result = import_args(tmp_path, "--tensorboard-dir /runs/tb --tensorboard-log-interval 5")
    assert result.job.train.tensorboard_dir == "/runs/tb" and result.job.train.tensorboard_log_interval == 5
    decided = {e.key: e.disposition for e in result.report.entries}
    assert decided["--tensorboard-dir"] == "mapped" and decided["--tensorboard-log-interval"] == "mapped"
    alone = import_args(tmp_path, "--tensorboard-log-interval 5")
    assert alone.job.train.tensorboard_dir is None
    assert {e.key: e.disposition for e in alone.report.entries}["--tensorboard-log-interval"] == "ignored"
