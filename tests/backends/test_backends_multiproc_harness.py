"""The multi-process harness: results by rank, fail fast with every rank's output, timeouts."""

from __future__ import annotations

import time

import pytest

from heteroflow.testing import MultiprocError, run_ranks


def report(rank: int, world_size: int, base: int, *, scale: int) -> dict:
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank + base])
    dist.all_reduce(value)
    print(f"rank {rank} says hello")
    return {"rank": rank, "world": world_size, "sum": int(value) * scale, "threads": torch.get_num_threads(),
            "backend": dist.get_backend()}


def fail_on_one(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    print(f"rank {rank} starting", flush=True)
    dist.barrier()  # both have printed before anyone fails, however loaded the machine is
    if rank == 1:
        raise ValueError("boom at rank 1")
    dist.barrier()  # would wait forever for rank 1: the harness must stop it


def sleep_forever(rank: int, world_size: int) -> None:
    print(f"rank {rank} sleeping", flush=True)
    time.sleep(600)


def test_results_come_back_by_rank():
    results = run_ranks(report, 3, 10, scale=2, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 2 * (10 + 11 + 12) for r in results)
    assert all(r["threads"] == 1 and r["backend"] == "gloo" for r in results)


@pytest.mark.slow  # spawn: each rank imports torch itself
def test_a_failing_rank_stops_the_run_and_every_output_is_shown():
    started = time.monotonic()
    with pytest.raises(MultiprocError) as info:
        run_ranks(fail_on_one, 2, timeout_s=120, start_method="spawn")
    assert time.monotonic() - started < 100  # failed fast, not at the timeout
    message = str(info.value)
    assert "rank 1 failed (exit code 1)" in message
    assert "ValueError: boom at rank 1" in message and "Traceback" in message
    assert "---- rank 0 output ----\nrank 0 starting" in message
    assert info.value.outputs[1].count("rank 1 starting") == 1


@pytest.mark.slow  # waits for its 8 s timeout
def test_a_hung_run_times_out_with_the_ranks_named():
    with pytest.raises(MultiprocError) as info:
        run_ranks(sleep_forever, 2, timeout_s=8)
    message = str(info.value)
    assert "timed out after 8 s with ranks [0, 1] still running" in message
    assert "rank 0 sleeping" in message and "rank 1 sleeping" in message


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(report, 0)
    with pytest.raises(ValueError, match="fork would copy"):
        run_ranks(report, 1, 0, scale=1, start_method="fork")
