"""`PartTimer`: the seconds one rank spends in named parts of a step, timed with its device's events.

A part is timed between two events recorded on the device's current stream (`Device.new_event`): on an
accelerator they time the queued work without stopping the host, and the one synchronisation the step already
ends with makes them readable; on the CPU the stand-in events read the wall clock. Parts nest: a part's time
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
        assert not self._open, f"parts still open: {[i.part for i in self._open]}"
        totals: dict[str, float] = defaultdict(float)

        def add(interval: _Interval) -> float:
            elapsed = interval.start.elapsed_time(interval.end) / 1000.0
            totals[interval.part] += elapsed - sum(add(inner) for inner in interval.inner)
            return elapsed

        for interval in self._done:
            add(interval)
        self._done = []
        return dict(totals)
