"""Remaps between activation layouts with load-balanced cp (shares of two parts) are exact permutations."""

from __future__ import annotations

import itertools

import pytest
import torch

from heteroflow.remap import TensorLayout, plan_transfer
from heteroflow.remap.local import apply_plan, reshard, shard, unshard

LAYOUTS = {  # (dp, cp, tp, sp) over a [4, 24, 3] activation
    "cp2": (1, 2, 1, False), "cp3-tp2": (1, 3, 2, False), "cp2-tp3-sp": (1, 2, 3, True),
    "dp2-cp2-tp2-sp": (2, 2, 2, True), "tp4": (1, 1, 4, False), "tp2-sp": (1, 1, 2, True), "dp2": (2, 1, 1, False),
}


def _layout(name: str, first_rank: int) -> TensorLayout:
    dp, cp, tp, sp = LAYOUTS[name]
    return TensorLayout.activation((4, 24, 3), ranks=range(first_rank, first_rank + dp * cp * tp), dp=dp, cp=cp,
                                   tp=tp, sp=sp)


@pytest.mark.parametrize("src_name,dst_name", list(itertools.permutations(LAYOUTS, 2)))
def test_activation_remaps_with_cp_are_exact_and_move_each_element_once(src_name, dst_name):
    src = _layout(src_name, 0)
    dst = _layout(dst_name, len(src.ranks))
    full = torch.randn(src.shape, generator=torch.Generator().manual_seed(0))
    out = reshard(shard(full, src), src, dst)
    for rank in dst.ranks:
        assert torch.equal(out[rank], shard(full, dst)[rank]), rank
    assert torch.equal(unshard(out, dst), full)
    plan = plan_transfer(src, dst)
    assert plan.boundary_bytes(4) == plan.min_boundary_bytes(4)


def test_partial_gradients_of_a_cp_stage_are_summed_before_crossing():
    src, dst = _layout("cp3-tp2", 0), _layout("cp2-tp3-sp", 6)
    full = torch.randn(src.shape, generator=torch.Generator().manual_seed(1))
    halves = {rank: t / 2 for rank, t in shard(full, src).items()}  # each tp replica holds half the sum
    out = apply_plan(plan_transfer(src, dst, source_replicas="partial"), halves)
    torch.testing.assert_close(unshard(out, dst), full)
