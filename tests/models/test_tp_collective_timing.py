"""`tp_ops.timing_collectives`: a stage's timer is installed for one process group inside a block only."""

from __future__ import annotations

import pytest

from heteroflow.devices.facade import Device
from heteroflow.devices.timing import PartTimer
from heteroflow.models import tp_ops


def test_a_timer_is_installed_for_its_group_inside_the_block_only():
    group, other = object(), object()  # stand-ins: installing touches no collective
    timer = PartTimer(Device.cpu().new_event)
    with tp_ops.timing_collectives(group, timer):
        with tp_ops._timed(group):
            pass
        with tp_ops._timed(other):  # not this stage's group: untimed
            pass
        with pytest.raises(RuntimeError, match="already being timed"):
            with tp_ops.timing_collectives(group, timer):
                pass
    assert set(timer.collect()) == {tp_ops.COLLECTIVE}
    with tp_ops._timed(group):
        pass
    assert timer.collect() == {}
    with pytest.raises(KeyError):
        with tp_ops.timing_collectives(group, timer):
            raise KeyError("the step failed")
    assert not tp_ops._TIMERS
    with tp_ops.timing_collectives(None, timer):  # a stage without tp
        assert not tp_ops._TIMERS
