"""`PartTimer`: the seconds one rank spends in named parts of a step, timed with its device's events.

A part is timed between two events recorded on the device's current stream (`Device.new_event`): on an
accelerator they time the queued work without stopping the host, and they are read once the host has synchronised
past them (the worker reads a step's at the next step's one sync: `take`, then `seconds`); on the CPU the stand-in events read the wall clock. Parts nest: a part's time
excludes the parts timed inside it (a forward's tp collectives are counted as collective time, not forward).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass(slots=True)
class _Interval:
    part: str
    start: Any
    end: Any = None
    inner: list[_Interval] = field(default_factory=list)


class PartTimer:
    """Accumulates exclusive seconds per part until `collect`. `new_event` is `Device.new_event`."""

    def __init__(self, new_event: Callable[..., Any]):
        self._new_event = new_event
        self._open: list[_Interval] = []
        self._done: list[_Interval] = []

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the enclosed work as `name` (less whatever is timed inside it)."""
        start = self._new_event(enable_timing=True)
        start.record()
        interval = _Interval(name, start)
        # One stack for every thread: an accelerator's autograd runs the backward's collectives on its own
        # thread while the thread that opened the enclosing `backward` part waits for it.
        (self._open[-1].inner if self._open else self._done).append(interval)
        self._open.append(interval)
        try:
            yield
        finally:
            self._open.remove(interval)
            interval.end = self._new_event(enable_timing=True)
            interval.end.record()

    def collect(self) -> dict[str, float]:
        """Seconds per part since the last `collect`, then start afresh. Call with no part open, after the
        device was synchronised (an accelerator's events must have completed)."""
        return self.seconds(self.take())

    def take(self) -> list[_Interval]:
        """The parts timed since the last `take` or `collect`, unread (their events may still be pending: read
        them with `seconds` once the device has run past them), then start afresh. Call with no part open."""
        assert not self._open, f"parts still open: {[i.part for i in self._open]}"
        done, self._done = self._done, []
        return done

    @staticmethod
    def seconds(intervals: list[_Interval]) -> dict[str, float]:
        """Exclusive seconds per part of `take`'s intervals (their events must have completed)."""
        totals: dict[str, float] = defaultdict(float)

        def add(interval: _Interval) -> float:
            elapsed = interval.start.elapsed_time(interval.end) / 1000.0
            totals[interval.part] += elapsed - sum(add(inner) for inner in interval.inner)
            return elapsed

        for interval in intervals:
            add(interval)
        return dict(totals)
