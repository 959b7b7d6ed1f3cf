"""One memory truth: every rank's measured bytes against the planner's figure, for fourteen layouts (two of
them mixture-of-experts under expert parallelism).

The training state (parameters, gradient buffer, master and moments) is what the planner prices, byte for byte,
on every rank of every layout whose state stays on the device; each rank's measured peak is within 10% of the
planner's figure without the reserve, less what CPU emulation cannot count (`unseen_on_cpu`).
"""

from __future__ import annotations

import pytest

from heteroflow.testing.memory_layouts import LAYOUTS, measure_layouts


@pytest.mark.slow
def test_every_layout_measures_what_the_planner_prices(tmp_path):
    rows = measure_layouts(list(LAYOUTS), str(tmp_path))
    assert {r.layout for r in rows} == set(LAYOUTS) and len(rows) == 4 * len(LAYOUTS)
    for r in rows:
        where = f"{r.layout} rank {r.rank}: measured {r.measured}, planned {r.planned}, unseen {r.unseen:.0f}"
        offloads = any(k in r.layout for k in ("optimizer-", "params-"))
        if not offloads:  # the state on the device is exactly the planner's
            assert [r.measured[k] for k in ("params", "grads", "optimizer")] == \
                [r.planned[k] for k in ("params", "grads", "optimizer")], where
        assert r.measured["activations"] > 0, where
        assert r.seen_ratio == pytest.approx(1.0, abs=0.10), where
        if r.unseen == 0:
            assert r.ratio == pytest.approx(1.0, abs=0.10), where
    zero0, zero1 = ({r.rank: r.measured for r in rows if r.layout == name} for name in ("dp2", "dp2-zero1"))
    for rank in zero0:  # ZeRO 1 halves the master and moments over dp 2
        assert zero1[rank]["optimizer"] * 2 == pytest.approx(zero0[rank]["optimizer"], rel=1e-3)
