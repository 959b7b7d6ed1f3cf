"""A launch without `log_dir` removes its temporary `heteroflow-logs-*` directory after a success and keeps
it after a failure, whose message says where it is."""

from __future__ import annotations

import tempfile

import pytest

from heteroflow.launcher.launch import LOG_DIR_PREFIX, LaunchSpec, TrainingFailed, launch


def _rank_or_fail(fail_rank: int) -> int:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()
    dist.destroy_process_group()
    return rank


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """Where `tempfile` puts this test's temporary directories (not the shared /tmp)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.mark.slow
def test_temporary_log_dir_is_removed_after_a_success(temp_root):
    assert launch(LaunchSpec(num_processes=2), _rank_or_fail, -1) == {0: 0, 1: 1}
    assert list(temp_root.glob(f"{LOG_DIR_PREFIX}*")) == []


@pytest.mark.slow
def test_temporary_log_dir_is_kept_and_named_after_a_failure(temp_root):
    with pytest.raises(TrainingFailed) as info:
        launch(LaunchSpec(num_processes=2), _rank_or_fail, 1)
    kept = list(temp_root.glob(f"{LOG_DIR_PREFIX}*"))
    assert len(kept) == 1 and f"all rank logs: {kept[0]}" in str(info.value)
    assert "deliberate failure on rank 1" in "".join(p.read_text() for p in kept[0].rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_log_dir_given_by_the_user_is_kept(tmp_path, temp_root):
    launch(LaunchSpec(num_processes=1, log_dir=str(tmp_path / "logs")), _rank_or_fail, -1)
    assert list((tmp_path / "logs").rglob("*.log")) and list(temp_root.iterdir()) == []
