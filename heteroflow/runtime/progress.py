"""Every rank's progress in the c10d store: the step it is in and a heartbeat, so that a rank waiting on
its peers past the step limit can name the ranks it waits for instead of blaming itself.

A rank frozen by SIGSTOP (or a dead device driver, a swapped-out host) reports nothing itself: its own
watchdog thread is frozen with it. Its peers see that it did not reach their step, or that its
heartbeat stopped between two reads. The heartbeat is written from its own thread through its own
store connection with a short timeout, so a store that does not answer (its host frozen) never holds up
the watchdog.
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass
from typing import Any

KEY_PREFIX = "heteroflow/progress/"


@dataclass(frozen=True, slots=True)
class Progress:
    """What a rank last published."""

    step: int
    """The step it is in (-1 before its first)."""
    beat: int
    """Heartbeats so far: it stops growing when the rank's process stops."""
    where: str
    """The rank's place in the plan (`stage 1, dp 0 cp 0 tp 0, node b`)."""


class ProgressBoard:
    """This rank's heartbeat thread, and the reads of every other rank's progress."""

    def __init__(self, store: Any, *, rank: int, world_size: int, where: str, beat_s: float = 1.0,
                 timeout_s: float = 2.0):
        self.rank, self.world_size, self.where = rank, world_size, where
        self.beat_s, self.timeout_s = beat_s, timeout_s
        self.step = -1
        self._beat = 0
        self._writer, self._reader = _connect(store, timeout_s), _connect(store, timeout_s)
        self._stop = threading.Event()
        self._publish()  # before the first step: a stale entry of an earlier run in this world goes now
        self._thread = threading.Thread(target=self._run, name="heteroflow-heartbeat", daemon=True)
        self._thread.start()

    def enter(self, step: int) -> None:
        """This rank starts `step` (published with the next heartbeat; no store access here)."""
        self.step = step

    def close(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()

    def read(self) -> dict[int, Progress | None]:
        """Every other rank's last published progress (None: nothing published yet). Each store access
        gives up after `timeout_s`, raising the store's error."""
        out: dict[int, Progress | None] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"{KEY_PREFIX}{rank}"
            if not self._reader.check([key]):
                out[rank] = None
                continue
            data = json.loads(self._reader.get(key))
            out[rank] = Progress(step=int(data["step"]), beat=int(data["beat"]), where=str(data["where"]))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            self._publish()

    def _publish(self) -> None:
        self._beat += 1
        value = json.dumps({"step": self.step, "beat": self._beat, "where": self.where})
        try:
            self._writer.set(f"{KEY_PREFIX}{self.rank}", value)
        except RuntimeError:  # the store did not answer (DistStoreError is one): try again at the next beat
            pass


def world_progress_board(*, rank: int, where: str, **options: float) -> ProgressBoard | None:
    """A board on the store of the default process group (the world), or None when there is none."""
    import torch.distributed as dist
    try:  # no public accessor: the store the world was created with
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return ProgressBoard(store, rank=rank, world_size=dist.get_world_size(), where=where, **options)


def _connect(store: Any, timeout_s: float) -> Any:
    """A connection of its own to `store` (threads do not queue behind each other), with a short timeout."""
    try:
        own = store.clone()
    except (AttributeError, RuntimeError):  # a store type without clone: share it
        return store
    own.set_timeout(datetime.timedelta(seconds=timeout_s))
    return own


def laggards(before: dict[int, Progress | None], after: dict[int, Progress | None], *, step: int) -> list[str]:
    """The ranks that hold up `step`, one phrase each, from two reads of the board a few heartbeats apart:
    those not in `step` yet, and those whose heartbeat stopped between the reads (frozen or dead)."""
    out = []
    for rank in sorted(after):
        now, then = after[rank], before.get(rank)
        if now is None:
            out.append(f"rank {rank} has published no progress (not started, frozen or dead)")
            continue
        stopped = then is not None and then.beat == now.beat
        heartbeat = "; its heartbeat stopped: frozen or dead" if stopped else ""
        if now.step < step:
            state = "has not started a step" if now.step < 0 else f"is in step {now.step}"
            out.append(f"rank {rank} ({now.where}) did not reach step {step} (it {state}{heartbeat})")
        elif stopped:
            out.append(f"rank {rank} ({now.where}) is in step {now.step} but its heartbeat stopped: frozen or dead")
    return out


def waiting_ranks(before: dict[int, Progress | None], after: dict[int, Progress | None], *, step: int) -> list[int]:
    """The ranks in `step` (or past it) whose heartbeat went on between the two reads: alive, and waiting
    with the reader for the ranks `laggards` names."""
    return [rank for rank in sorted(after)
            if (now := after[rank]) is not None and now.step >= step
            and (then := before.get(rank)) is not None and then.beat != now.beat]
