"""Pure checks of the pipeline action orders and the learning-rate schedule."""

from __future__ import annotations

import itertools
import math

import pytest

from heteroflow.config import TrainSpec
from heteroflow.runtime.lr import learning_rate
from heteroflow.runtime.schedule import BACKWARD, FORWARD, max_in_flight, stage_actions

SHAPES = list(itertools.product(["1f1b", "gpipe"], [1, 2, 3, 5], [1, 2, 4, 7]))


def runs_without_deadlock(schedule: str, num_stages: int, num_micro_batches: int) -> bool:
    """Execute every stage's list with blocking receives and non-blocking sends; True if all finish.

    F(m) on stage k needs F(m) done on k - 1; B(m) on stage k needs B(m) done on k + 1 (and its own F(m)).
    """
    lists = [stage_actions(schedule, num_stages, k, num_micro_batches) for k in range(num_stages)]
    position = [0] * num_stages
    done: set[tuple[str, int, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        for k in range(num_stages):
            if position[k] == len(lists[k]):
                continue
            action = lists[k][position[k]]
            m = action.micro_batch
            if action.kind == FORWARD:
                ready = k == 0 or (FORWARD, k - 1, m) in done
            else:
                ready = (FORWARD, k, m) in done and (k == num_stages - 1 or (BACKWARD, k + 1, m) in done)
            if ready:
                done.add((action.kind, k, m))
                position[k] += 1
                progressed = True
    return all(position[k] == len(lists[k]) for k in range(num_stages))


@pytest.mark.parametrize("schedule,num_stages,num_micro_batches", SHAPES)
def test_every_micro_batch_runs_once_forward_before_backward(schedule, num_stages, num_micro_batches):
    for k in range(num_stages):
        actions = stage_actions(schedule, num_stages, k, num_micro_batches)
        forwards = [a.micro_batch for a in actions if a.kind == FORWARD]
        backwards = [a.micro_batch for a in actions if a.kind == BACKWARD]
        assert sorted(forwards) == sorted(backwards) == list(range(num_micro_batches))
        for m in range(num_micro_batches):
            order = [str(a) for a in actions]
            assert order.index(f"F{m}") < order.index(f"B{m}")


@pytest.mark.parametrize("schedule,num_stages,num_micro_batches", SHAPES)
def test_schedules_cannot_deadlock(schedule, num_stages, num_micro_batches):
    assert runs_without_deadlock(schedule, num_stages, num_micro_batches)


def test_1f1b_bounds_micro_batches_in_flight():
    for k in range(4):
        assert max_in_flight(stage_actions("1f1b", 4, k, 8)) == 4 - k
        assert max_in_flight(stage_actions("gpipe", 4, k, 8)) == 8
    assert [str(a) for a in stage_actions("1f1b", 3, 0, 4)] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_learning_rate_warmup_then_cosine_to_min():
    train = TrainSpec(global_batch_size=8, steps=110, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert learning_rate(0, train) == pytest.approx(1e-4)
    assert learning_rate(9, train) == pytest.approx(1e-3)
    assert learning_rate(10, train) == pytest.approx(1e-3)
    assert learning_rate(60, train) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(110, train) == pytest.approx(1e-4)
    rates = [learning_rate(s, train) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
