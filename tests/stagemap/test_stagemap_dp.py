"""The planner's dynamic program is exact for the closed form: checked against brute force."""

from __future__ import annotations

import itertools
import random

import numpy as np

from heteroflow.stagemap.dp import DictTable, Option, fill_bound, greedy, solve
from heteroflow.stagemap.pipeline import pipeline_time


def _value(choice, m, schedule):
    return (pipeline_time([o.forward_s for o in choice], [o.backward_s for o in choice], m, schedule)
            + max(o.tail_s for o in choice))


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
