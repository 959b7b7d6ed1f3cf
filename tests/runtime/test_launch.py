"""The elastic launcher: return values from every rank, and a failing rank's log shown."""

from __future__ import annotations

import pytest

from heteroflow.launcher.launch import LaunchSpec, TrainingFailed, launch


def _rank_times_ten(fail_rank: int) -> int:
    import os

    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"worker {rank} says hello", flush=True)
    if rank == fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()
    dist.destroy_process_group()
    return rank * 10 + int(os.environ["WORLD_SIZE"])


@pytest.mark.slow
def test_launch_returns_every_rank_value(tmp_path):
    assert launch(LaunchSpec(num_processes=3, log_dir=str(tmp_path)), _rank_times_ten, -1) == {0: 3, 1: 13, 2: 23}


@pytest.mark.slow
def test_failing_rank_log_is_shown_and_all_ranks_stop(tmp_path):
    with pytest.raises(TrainingFailed) as info:
        launch(LaunchSpec(num_processes=3, log_dir=str(tmp_path)), _rank_times_ten, 1)
    text = str(info.value)
    assert "rank 1 failed" in text
    assert "deliberate failure on rank 1" in text
    assert str(tmp_path) in text
