"""`PartTimer`: exclusive seconds per named part, from the device's timing events (wall clock on the CPU)."""

from __future__ import annotations

import time

import pytest

from heteroflow.devices.facade import Device
from heteroflow.devices.timing import PartTimer


def test_nested_parts_are_excluded_from_the_enclosing_part_and_collect_starts_afresh():
    timer = PartTimer(Device.cpu().new_event)
    started = time.perf_counter()
    with timer.part("forward"):
        time.sleep(0.02)
        with timer.part("collective"):
            time.sleep(0.03)
    with timer.part("forward"):
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    totals = timer.collect()
    assert set(totals) == {"forward", "collective"}
    assert totals["collective"] >= 0.03
    assert totals["forward"] >= 0.03 and totals["forward"] < 0.03 + (elapsed - 0.06) + 1e-9
    assert totals["forward"] + totals["collective"] <= elapsed
    assert timer.collect() == {}


def test_a_part_that_raises_is_still_closed():
    timer = PartTimer(Device.cpu().new_event)
    with pytest.raises(ValueError):
        with timer.part("backward"):
            raise ValueError("boom")
    assert set(timer.collect()) == {"backward"}
