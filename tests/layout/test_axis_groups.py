"""`ParallelLayout.axis_groups` (what the planner prices a stage's links by) names the ranks that the runtime's
process groups hold (`RankMap`: tp innermost, then cp, then dp)."""

from __future__ import annotations

import itertools

import pytest

from heteroflow.backends import RankMap
from heteroflow.config import parse_job
from heteroflow.layout import ParallelLayout


@pytest.mark.parametrize("tp,cp,dp", [(2, 1, 4), (2, 2, 2), (1, 2, 4), (4, 1, 2), (8, 1, 1)])
def test_axis_groups_are_the_runtime_groups(tp, cp, dp):
    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "nvidia-a100-80g", "count": 8}]},
                     "model": {"preset": "llama2-7b", "num_attention_heads": 32, "seq_length": 4096},
                     "train": {"global_batch_size": 8},
                     "plan": {"micro_batch_size": dp, "stages": [{"devices": ["n"], "layers": 32, "tp": tp, "cp": cp,
                                                                  "dp": dp}]}})
    stage = RankMap.from_plan(job.plan, job.cluster).stages[0]
    layout = ParallelLayout(tp=tp, cp=cp, dp=dp)
    index = list(itertools.product(range(dp), range(cp), range(tp)))
    for axis, position in (("dp", 0), ("cp", 1), ("tp", 2)):
        groups: dict[tuple, list[int]] = {}  # the ranks whose other two indices agree, in index order
        for d, c, t in index:
            others = (d, c, t)[:position] + (d, c, t)[position + 1:]
            groups.setdefault(others, []).append(stage.rank(dp=d, cp=c, tp=t))
        assert set(layout.axis_groups(axis)) == {tuple(g) for g in groups.values()}, axis
        assert sorted(r for g in layout.axis_groups(axis) for r in g) == list(range(tp * cp * dp))
