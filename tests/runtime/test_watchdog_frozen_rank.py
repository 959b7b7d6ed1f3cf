"""A frozen rank (SIGSTOP) cannot report itself: the ranks waiting for it name it, from every rank's step
and heartbeat in the store, instead of blaming themselves."""

from __future__ import annotations

import re

import pytest

from heteroflow.runtime.progress import Progress, laggards, waiting_ranks
from heteroflow.runtime.watchdog import StepWatchdog
from heteroflow.testing import MultiprocError, run_ranks


def _where(rank: int) -> str:
    return f"stage {rank}, dp 0 cp 0 tp 0, node n{rank}"


def freeze_one_rank(rank: int, world_size: int, *, frozen_rank: int, after_step: int, limit_s: float) -> None:
    """Steps of one all-reduce each; `frozen_rank` stops itself (SIGSTOP) once `after_step` is done."""
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    from heteroflow.runtime.progress import world_progress_board

    board = world_progress_board(rank=rank, where=_where(rank), beat_s=0.2)
    dog = StepWatchdog(limit_s=limit_s, rank=rank, where=_where(rank), progress=board)
    for step in range(after_step + 10):
        dog.begin(step)
        dist.all_reduce(torch.ones(1))
        if rank == frozen_rank and step == after_step:
            time.sleep(1.0)  # a few heartbeats out first, so the board shows it at this step
            print(f"rank {rank} stops itself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
    dog.stop()


@pytest.mark.slow
def test_the_frozen_rank_is_named_not_rank_0():
    with pytest.raises(MultiprocError) as info:
        run_ranks(freeze_one_rank, 3, frozen_rank=2, after_step=1, limit_s=2.0, timeout_s=90)
    error = info.value
    assert "rank 2 stops itself after step 1" in error.outputs[2], str(error)
    reports = {rank: text for rank, text in error.outputs.items() if "heteroflow watchdog:" in text}
    assert set(reports) and set(reports) <= {0, 1}, str(error)
    assert re.search(r"exit code 3", error.summary), str(error)
    for rank, text in reports.items():
        line = text[text.index("heteroflow watchdog:"):].splitlines()[0]
        assert line.startswith("heteroflow watchdog: rank 2 (stage 2, dp 0 cp 0 tp 0, node n2) did not reach step 2 "
                               "(it is in step 1; its heartbeat stopped: frozen or dead); "
                               f"rank {rank} (stage {rank}, dp 0 cp 0 tp 0, node n{rank}) has waited for it in step 2 "
                               "for "), line
        assert "over the step limit of 2 s (--timeout); it is waiting for other ranks" in line
        assert "Traceback" not in text


def test_laggards_from_two_reads_of_the_board():
    before = {1: Progress(step=4, beat=10, where="stage 1"), 2: Progress(step=5, beat=7, where="stage 2"),
              3: Progress(step=5, beat=3, where="stage 3"), 4: None, 5: Progress(step=3, beat=2, where="stage 5")}
    after = {1: Progress(step=4, beat=10, where="stage 1"), 2: Progress(step=5, beat=7, where="stage 2"),
             3: Progress(step=5, beat=5, where="stage 3"), 4: None, 5: Progress(step=3, beat=4, where="stage 5"),
             6: Progress(step=-1, beat=9, where="stage 6")}
    assert laggards(before, after, step=5) == [
        "rank 1 (stage 1) did not reach step 5 (it is in step 4; its heartbeat stopped: frozen or dead)",
        "rank 2 (stage 2) is in step 5 but its heartbeat stopped: frozen or dead",
        "rank 4 has published no progress (not started, frozen or dead)",
        "rank 5 (stage 5) did not reach step 5 (it is in step 3)",  # alive: its own watchdog reports where it is
        "rank 6 (stage 6) did not reach step 5 (it has not started a step)",
    ]
    assert laggards(after, after | {3: Progress(step=5, beat=6, where="stage 3")}, step=5)[0].startswith("rank 1 ")
    # alive and in the step: waiting with the reader (rank 2's heartbeat stopped, 5 and 6 are behind)
    assert waiting_ranks(before, after, step=5) == [3]


class _SilentStore:
    """A board whose store does not answer (its host frozen)."""

    beat_s = 0.1

    def read(self):
        raise RuntimeError("timed out")

    def enter(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_unreadable_board_is_said_and_the_report_names_this_rank():
    dog = StepWatchdog(limit_s=1.0, rank=1, where="stage 1", progress=_SilentStore())
    try:
        held_up_by, note = dog._held_up_by(3)
        report = dog.report(3, 4.2, held_up_by, note)
    finally:
        dog.stop()
    assert held_up_by == []
    assert report.startswith("heteroflow watchdog: rank 1 (stage 1) has been in step 3 for 4.2 s")
    assert report.endswith("; the other ranks' progress could not be read from the store (RuntimeError); the rank "
                           "hosting it may be the one frozen")
