"""The pipeline closed form against the discrete-event simulator, on randomized stage times."""

from __future__ import annotations

import random

import pytest

from heteroflow.stagemap.pipeline import in_flight, pipeline_time, simulate, stage_order


def _random_case(rng: random.Random):
    p = rng.randint(1, 8)
    m = rng.randint(1, 6 * p)
    compute_f = [rng.uniform(0.05, 3.0) for _ in range(p)]
    compute_b = [f * rng.uniform(0.8, 3.5) for f in compute_f]
    recv = [rng.uniform(0.0, 0.6) for _ in range(p - 1)]
    # The receiver pays each transfer: forward into stage k, backward into stage k from k + 1.
    F = [compute_f[k] + (recv[k - 1] if k else 0.0) for k in range(p)]
    B = [compute_b[k] + (recv[k] if k < p - 1 else 0.0) for k in range(p)]
    return compute_f, compute_b, recv, F, B, m


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_closed_form_matches_simulator_on_random_stage_times(schedule):
    rng = random.Random(20240607 + len(schedule))
    worst = 0.0
    for _ in range(1000):
        compute_f, compute_b, recv, F, B, m = _random_case(rng)
        simulated, _ = simulate(compute_f, compute_b, recv, m, schedule)
        worst = max(worst, abs(pipeline_time(F, B, m, schedule) - simulated) / simulated)
    assert worst < 0.01  # required: within 1%
    assert worst < 1e-9  # in fact exact: both describe the same dependency graph


def test_homogeneous_stages_give_the_textbook_formula():
    for p, m in [(1, 1), (1, 7), (4, 4), (4, 16), (8, 3), (6, 40)]:
        expected = (m + p - 1) * 3.0
        assert pipeline_time([1.0] * p, [2.0] * p, m, "1f1b") == pytest.approx(expected)
        assert pipeline_time([1.0] * p, [2.0] * p, m, "gpipe") == pytest.approx(expected)


def test_gpipe_never_beats_1f1b_on_the_same_stages():
    rng = random.Random(7)
    for _ in range(3000):
        _, _, _, F, B, m = _random_case(rng)
        assert pipeline_time(F, B, m, "gpipe") >= pipeline_time(F, B, m, "1f1b") * (1 - 1e-12)


def test_schedule_orders_and_in_flight_counts():
    assert stage_order(3, 0, 4, "1f1b")[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
    assert stage_order(3, 2, 4, "1f1b")[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert stage_order(2, 0, 3, "gpipe") == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert [in_flight("1f1b", 4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, k, 2) for k in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 4, k, 8) for k in range(4)] == [8] * 4


def test_simulator_events_cover_every_operation_once():
    compute_f, compute_b, recv, m = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.2, 0.3], 5
    makespan, events = simulate(compute_f, compute_b, recv, m, "1f1b")
    work = [(e.stage, e.kind, e.micro_batch) for e in events if e.kind in ("forward", "backward")]
    assert len(work) == len(set(work)) == 3 * 2 * m
    for k in range(3):  # a stage never runs two operations at once
        spans = sorted((e.start_s, e.end_s) for e in events if e.stage == k)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert makespan == max(e.end_s for e in events)
