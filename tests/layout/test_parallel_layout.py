"""The layout core's one definition of a valid layout, of what a rank holds and of which copy counts once."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from heteroflow.config import PRESETS
from heteroflow.layout import (OffloadSpec, ParallelLayout, counted_once, kv_heads_per_rank, layer_params_per_rank,
                               replicates_kv_heads, tp_valid)

LLAMA3_8B = PRESETS["llama3-8b"]  # 32 heads, 8 kv heads, ffn 14336


def _keys(layout: ParallelLayout, model=LLAMA3_8B, **kw) -> list[str]:
    return [p.key for p in layout.validate(model, **kw)]


def test_a_valid_layout_has_no_problems():
    assert ParallelLayout(tp=8, dp=2, sp=True, zero=1, recompute="full").validate(
        LLAMA3_8B, num_devices=16, micro_batch_size=4) == []


def test_tp_must_split_heads_and_mlp_and_divide_the_kv_heads_either_way():
    assert tp_valid(LLAMA3_8B, 16)  # 16 > 8 kv heads: kv replicated
    assert not tp_valid(LLAMA3_8B, 3)
    odd_kv = replace(LLAMA3_8B, num_kv_heads=6, num_attention_heads=24, hidden_size=3072)
    problems = ParallelLayout(tp=4).validate(odd_kv)
    assert [p.message for p in problems] == ["tp 4 and num_kv_heads 6 must divide one another"]
    assert _keys(ParallelLayout(tp=3, dp=1)) == ["tp", "tp"]  # heads and ffn


def test_device_count_micro_batch_and_sequence_rules_name_their_key():
    assert _keys(ParallelLayout(tp=2, dp=2), num_devices=8) == ["devices"]
    assert _keys(ParallelLayout(dp=3), micro_batch_size=4) == ["dp"]
    assert _keys(ParallelLayout(tp=2, sp=True), replace(LLAMA3_8B, seq_length=4097)) == ["sp"]


def test_out_of_range_values_are_problems_not_crashes():
    assert _keys(ParallelLayout(tp=0)) == ["tp"]
    assert _keys(ParallelLayout(zero=4)) == ["zero"]
    assert _keys(ParallelLayout(recompute="most")) == ["recompute"]
    assert _keys(ParallelLayout(offload=OffloadSpec(activations="ssd"))) == ["offload"]
    assert _keys(ParallelLayout(precision="fp8")) == ["precision"]


def test_kv_heads_per_rank_split_or_replicated():
    assert [kv_heads_per_rank(LLAMA3_8B, tp) for tp in (1, 2, 8, 16, 32)] == [8, 4, 1, 1, 1]
    assert [replicates_kv_heads(LLAMA3_8B, tp) for tp in (8, 16)] == [False, True]


def test_layer_parameters_per_rank_add_up_to_the_model():
    model = LLAMA3_8B
    per_layer = (model.num_params() - 2 * model.vocab_size * model.hidden_size - model.hidden_size) / model.num_layers
    assert layer_params_per_rank(model, 1) == pytest.approx(per_layer)
    # tp 8 splits everything but the norms
    norms = 2 * model.hidden_size
    assert layer_params_per_rank(model, 8) == pytest.approx((per_layer - norms) / 8 + norms)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_every_value_counts_once_over_the_world(tp, dp):
    for split_over_tp in (False, True):
        for split_over_dp in (False, True):
            counts = sum(counted_once(split_over_tp=split_over_tp, tp_rank=t, dp_rank=d, split_over_dp=split_over_dp)
                         for t in range(tp) for d in range(dp))
            # a split value has one part per rank of its split axes; each part counts once
            assert counts == (tp if split_over_tp else 1) * (dp if split_over_dp else 1)
    assert not counted_once(split_over_tp=True, tp_rank=0, tied_head_copy=True)


def test_describe_and_plan_keys():
    lay = ParallelLayout(tp=4, dp=2, sp=True, zero=1, recompute="full", offload=OffloadSpec(optimizer="cpu"))
    assert lay.describe() == "tp4 dp2 sp zero1 rc=full off=opt:cpu"
    assert lay.to_dict() == {"tp": 4, "dp": 2, "sp": True, "zero": 1, "recompute": "full",
                             "offload": {"optimizer": "cpu"}}
    assert ParallelLayout().to_dict() == {"tp": 1, "dp": 1}
    assert ParallelLayout(precision="fp16").to_dict() == {"tp": 1, "dp": 1, "precision": "fp16"}
    assert ParallelLayout(precision="fp16").compute_precision("bf16") == "fp16"
    assert ParallelLayout().compute_precision("bf16") == "bf16"


def test_the_layout_core_imports_no_torch():
    code = "import sys, heteroflow.layout; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


MIXTRAL = PRESETS["mixtral-8x7b"]  # 8 experts, expert ffn 14336


def test_expert_layout_folds_over_the_stage_ranks():
    lay = ParallelLayout(tp=2, dp=4, ep=4, etp=1)
    assert lay.validate(MIXTRAL, num_devices=8, micro_batch_size=4) == []
    assert (lay.expert_tp, lay.expert_dp) == (1, 2)  # 8 ranks = etp 1 x ep 4 x expert-dp 2
    assert ParallelLayout(tp=2, dp=2, ep=2).expert_dp == 1  # etp defaults to tp
    assert lay.to_dict() == {"tp": 2, "dp": 4, "ep": 4, "etp": 1} and "ep4 etp1" in lay.describe()


def test_expert_layout_rules_name_their_key():
    assert _keys(ParallelLayout(dp=3, ep=3), MIXTRAL) == ["ep"]  # 3 does not divide 8 experts
    assert _keys(ParallelLayout(tp=2, dp=2, ep=4), MIXTRAL) == ["ep"]  # etp 2 x ep 4 > 4 ranks
    assert _keys(ParallelLayout(dp=2, ep=2), LLAMA3_8B) == ["ep"]  # a dense model has no experts
    assert _keys(ParallelLayout(ep=0), MIXTRAL) == ["ep"]
    odd = replace(MIXTRAL, moe=replace(MIXTRAL.moe, ffn_hidden_size=1001))
    assert "etp" in _keys(ParallelLayout(tp=1, dp=4, ep=2, etp=2), odd)
