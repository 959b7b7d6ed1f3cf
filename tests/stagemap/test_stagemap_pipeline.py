"""The pipeline closed form against the discrete-event simulator, on randomized stage times."""

from __future__ import annotations

import random

import pytest

from heteroflow.stagemap.pipeline import (in_flight, one_f_one_b_closed_form, pipeline_time, shared_makespan, simulate,
                                         simulate_shared)


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


def test_1f1b_matches_the_simulator_with_backward_drawn_apart_from_forward():
    """Backward much faster than forward on some stages: the closed form alone missed the simulator by up to 6%
    (a longest path that zigzags between stages); `pipeline_time` times the action lists there."""
    rng = random.Random(29)
    worst = closed_worst = 0.0
    for _ in range(1500):
        p = rng.randint(1, 7)
        m = rng.randint(1, 5 * p)
        compute_f = [rng.uniform(0.05, 3.0) for _ in range(p)]
        compute_b = [rng.uniform(0.05, 3.0) for _ in range(p)]  # independent of forward
        recv = [rng.choice([0.0, rng.uniform(0.0, 0.6)]) for _ in range(p - 1)]
        F = [compute_f[k] + (recv[k - 1] if k else 0.0) for k in range(p)]
        B = [compute_b[k] + (recv[k] if k < p - 1 else 0.0) for k in range(p)]
        simulated, _ = simulate(compute_f, compute_b, recv, m, "1f1b")
        worst = max(worst, abs(pipeline_time(F, B, m, "1f1b") - simulated) / simulated)
        closed = one_f_one_b_closed_form(F, B, m)
        assert closed <= simulated * (1 + 1e-12)  # a lower bound everywhere (the DP's objective)
        if all(b >= f for f, b in zip(F, B)):
            assert closed == pytest.approx(simulated, rel=1e-9)
        closed_worst = max(closed_worst, (simulated - closed) / simulated)
    assert worst < 1e-9
    assert closed_worst > 0.01  # the cases the closed form alone gets wrong are drawn


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


def test_in_flight_counts():
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


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_shared_cores_with_a_core_per_thread_give_the_closed_form(schedule):
    rng = random.Random(7 + len(schedule))
    for _ in range(300):
        _, _, _, F, B, m = _random_case(rng)
        threads = [rng.randint(1, 4) for _ in F]
        shared = simulate_shared(F, B, m, schedule, threads=threads, cores=sum(threads))
        assert shared == pytest.approx(pipeline_time(F, B, m, schedule), rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_shared_cores_bound_the_step_by_the_work_and_more_cores_never_hurt(schedule):
    rng = random.Random(11 + len(schedule))
    for _ in range(200):
        _, _, _, F, B, m = _random_case(rng)
        threads = [rng.randint(1, 3) for _ in F]
        work = sum(t * m * (f + b) for t, f, b in zip(threads, F, B))
        alone = pipeline_time(F, B, m, schedule)
        previous = float("inf")
        for cores in range(1, sum(threads) + 1):
            shared = simulate_shared(F, B, m, schedule, threads=threads, cores=cores)
            assert shared >= max(alone, work / cores) * (1 - 1e-9)
            assert shared <= previous * (1 + 1e-9)
            previous = shared


def test_one_thread_per_stage_on_one_core_runs_the_whole_work_back_to_back():
    # Some operation is always ready until the step ends, so a single core never idles.
    F, B, m = [1.0, 2.0, 0.5], [2.0, 3.0, 1.5], 4
    for schedule in ("1f1b", "gpipe"):
        assert simulate_shared(F, B, m, schedule, threads=[1, 1, 1], cores=1) == pytest.approx(m * (sum(F) + sum(B)))


def test_one_oversubscribed_stage_runs_at_cores_over_threads():
    assert simulate_shared([1.0], [2.0], 3, "1f1b", threads=[4], cores=2) == pytest.approx(3 * 3.0 * 2)


def test_shared_makespan_by_hand():
    assert shared_makespan([1.0, 2.0], threads=[1, 1], cores=1) == pytest.approx(3.0)
    assert shared_makespan([1.0, 2.0], threads=[1, 1], cores=2) == pytest.approx(2.0)
    # 3 threads on 2 cores run at 2/3 until the first job's second of work is done (t = 1.5), then the last
    # second of the other job runs alone at full speed.
    assert shared_makespan([1.0, 2.0], threads=[2, 1], cores=2) == pytest.approx(2.5)
    assert shared_makespan([0.0, 0.0], threads=[1, 1], cores=1) == 0.0
