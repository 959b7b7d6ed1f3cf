"""The planner's dynamic program is exact for the closed form: checked against brute force."""

from __future__ import annotations

import itertools
import random

import numpy as np

from heteroflow.stagemap.dp import (NEG, DictTable, Option, _Entry, _extend_1f1b, _insert, _lower_bound, _step_1f1b,
                                   fill_bound, greedy, solve)
from heteroflow.stagemap.pipeline import one_f_one_b_closed_form, pipeline_time


def _value(choice, m, schedule):
    """The DP's objective: the closed forms (for 1F1B a lower bound on the makespan where a stage's backward is
    faster than its forward, which these tables sometimes draw)."""
    F, B = [o.forward_s for o in choice], [o.backward_s for o in choice]
    pipe = one_f_one_b_closed_form(F, B, m) if schedule == "1f1b" else pipeline_time(F, B, m, schedule)
    return pipe + max(o.tail_s for o in choice)


def _brute(tables, num_layers, m, schedule):
    best = float("inf")
    for split in itertools.product(*[list(t) for t in tables]):
        if sum(split) != num_layers:
            continue
        for choice in itertools.product(*[tables[k][split[k]] for k in range(len(tables))]):
            best = min(best, _value(choice, m, schedule))
    return best


def _random_tables(rng, p, num_layers):
    tables = []
    for _ in range(p):
        table = {}
        for layers in range(1, num_layers - p + 2):
            if rng.random() < 0.15:
                continue
            table[layers] = [Option(layers, layers * rng.uniform(0.5, 1.5) + rng.uniform(0, 0.4),
                                    layers * rng.uniform(1.0, 3.0) + rng.uniform(0, 0.4), rng.uniform(0, 2.0), None)
                             for _ in range(rng.randint(1, 3))]
        tables.append(table)
    return tables


def test_dp_matches_brute_force_on_random_option_tables():
    rng = random.Random(11)
    for _ in range(250):
        p = rng.randint(1, 4)
        num_layers = rng.randint(p, p + 4)
        m = rng.randint(1, 3 * p + 2)
        tables = _random_tables(rng, p, num_layers)
        for schedule in ("1f1b", "gpipe"):
            expected = _brute(tables, num_layers, m, schedule)
            wrapped = [DictTable(t, num_layers - p + 1) for t in tables]
            got = solve(wrapped, num_layers, m, schedule)
            if expected == float("inf"):
                assert got is None
                continue
            assert abs(got[0] - expected) <= 1e-9 * expected
            assert abs(_value(got[1], m, schedule) - got[0]) <= 1e-9 * expected
            assert sum(o.layers for o in got[1]) == num_layers


def test_dp_honours_the_incumbent_and_the_fill_bound():
    rng = random.Random(5)
    for _ in range(100):
        p, num_layers, m = rng.randint(2, 4), 7, rng.randint(2, 12)
        tables = _random_tables(rng, p, num_layers)
        wrapped = [DictTable(t, num_layers - p + 1) for t in tables]
        best = solve(wrapped, num_layers, m, "1f1b")
        if best is None:
            continue
        least = [w.least for w in wrapped]
        own = [m * w.least + min((o.tail_s for opts in t.values() for o in opts), default=0.0)
               for w, t in zip(wrapped, tables)]
        G = fill_bound(least, num_layers, m, own)
        assert G[0, num_layers] <= best[0] * (1 + 1e-12)  # a lower bound
        assert solve(wrapped, num_layers, m, "1f1b", incumbent=best[0]) is None
        again = solve(wrapped, num_layers, m, "1f1b", incumbent=best[0] * 1.0001, fill=G)
        assert again is not None and abs(again[0] - best[0]) <= 1e-12 * best[0]
        start = greedy(wrapped, num_layers, m, "1f1b")
        assert start is None or start[0] >= best[0] * (1 - 1e-12)


def test_fill_bound_of_equal_stages():
    least = [np.array([1.0 * layers for layers in range(1, 5)])] * 4
    G = fill_bound(least, 4, 10)
    # one layer each: max_k (k + 10) over k = 0..3 -> 13
    assert G[0, 4] == 13.0


def test_the_vectorised_1f1b_step_gives_the_same_floats_and_pruning_as_the_scalar_one():
    rng = random.Random(7)
    for _ in range(300):
        m = rng.randint(1, 12)
        u, n = rng.randint(0, m - 1), rng.randint(-1, 4)
        front = [_Entry(start, None, None) for start in
                 [(0.0, 0.0, 0.0, NEG, NEG, NEG, 0.0, 0.0, 0.0)] + [
                     tuple(rng.uniform(0, 5) for _ in range(9)) for _ in range(rng.randint(0, 5))]]
        opts = [Option(1, rng.uniform(0.1, 2), rng.uniform(0.1, 2), rng.uniform(0, 1), None)
                for _ in range(rng.randint(1, 5))]
        ahead, rem, last = rng.choice([-np.inf, rng.uniform(0, 3)]), rng.uniform(0, 3), rng.random() < 0.3
        incumbent = rng.uniform(5, 40)
        expected = []
        for entry in front:
            for o in opts:
                vec = _step_1f1b(entry.vec, o, u, n, m)
                if vec[0] + ahead < incumbent and _lower_bound(vec, rem, False, m, last) < incumbent:
                    _insert(expected, _Entry(vec, entry, o))
        got = []
        columns = tuple(np.array([getattr(o, f) for o in opts]) for f in ("forward_s", "backward_s", "tail_s"))
        _extend_1f1b(got, front, np.array([e.vec for e in front]), opts, columns, u, n, m, ahead, rem, last, incumbent)
        assert [(e.vec, id(e.parent), id(e.option)) for e in got] == [
            (e.vec, id(e.parent), id(e.option)) for e in expected]


def test_fill_bound_sums_are_the_least_sums_of_stage_times():
    rng = np.random.default_rng(2)
    for _ in range(50):
        p = int(rng.integers(1, 5))
        num_layers = int(rng.integers(p, p + 6))
        least = [np.cumsum(rng.uniform(0.1, 1.0, num_layers - p + 1)) for _ in range(p)]
        _, S = fill_bound(least, num_layers, 4, sums=True)
        for k in range(p):
            for rest in range(p - k, num_layers - k + 1):
                brute = min((sum(least[k + i][c - 1] for i, c in enumerate(split))
                             for split in itertools.product(range(1, num_layers + 1), repeat=p - k)
                             if sum(split) == rest), default=np.inf)
                assert abs(S[k, rest] - brute) <= 1e-12 * max(1.0, brute)
