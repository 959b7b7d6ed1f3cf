"""Expert parallelism in the planner: what a rank holds under ep / etp (checked against the model's own parameters),
the all-to-all bytes (checked against a brute-force count over a uniform routing table), memory and time per
rank, the ep group's links, and the search choosing ep per stage."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from heteroflow.config import PRESETS, parse_job
from heteroflow.config.catalog import CATALOG
from heteroflow.config.moe import MoESpec
from heteroflow.layout import OffloadSpec, ParallelLayout
from heteroflow.layout.routing import alltoall_bytes_per_rank, load_allowance, routed_pairs_per_rank
from heteroflow.layout.shards import (expert_params_per_rank, layer_params_per_rank, local_experts,
                                      routed_expert_params_per_rank)
from heteroflow.models.llama import build_stage_model
from heteroflow.stagemap.api import search_plan
from heteroflow.stagemap.comm import ep_alltoall_s
from heteroflow.stagemap.compute import ffn_gemm_s
from heteroflow.stagemap.hardware import Hardware, device_model
from heteroflow.stagemap.layout import expert_choices, search_layouts
from heteroflow.stagemap.memory import memory_model
from heteroflow.stagemap.space import SearchOptions

A100 = device_model(CATALOG["nvidia-a100-80g"], "bf16")
MOE = MoESpec(num_experts=8, top_k=2, ffn_hidden_size=96, shared_expert_ffn_hidden_size=64, shared_expert_gate=True)
SPARSE = replace(PRESETS["micro-llama"], num_layers=1, moe=MOE)
MIXTRAL = PRESETS["mixtral-8x7b"]
HW = Hardware(models={}, inter_node_gb_per_s=25.0, inter_latency_s=2e-5)


def test_local_experts_split_the_experts_evenly_in_order():
    for ep in (1, 2, 4, 8):
        held = [list(local_experts(8, ep, r)) for r in range(ep)]
        assert sum(held, []) == list(range(8)) and {len(h) for h in held} == {8 // ep}


@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 2), (2, 1)])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_a_rank_holds_its_local_experts_split_over_etp(tp, etp, ep):
    model = build_stage_model(SPARSE, first_layer=0, last_layer=1, is_first=False, is_last=False)
    routed = {name: p.numel() for name, p in model.named_parameters() if ".experts." in name}
    for rank in range(ep):  # the parameters of the experts this ep rank holds, as the model names them
        mine = sum(n for name, n in routed.items() if int(name.split(".experts.")[1].split(".")[0])
                   in local_experts(MOE.num_experts, ep, rank))
        assert routed_expert_params_per_rank(SPARSE, ep=ep, etp=etp) == pytest.approx(mine / etp)
    assert expert_params_per_rank(SPARSE, tp, ep=ep, etp=etp) == pytest.approx(sum(routed.values()) / ep / etp)
    # Outside the routed experts, a rank holds what tp gives it (router and shared expert as before).
    assert layer_params_per_rank(SPARSE, tp, ep=ep, etp=etp) == pytest.approx(
        layer_params_per_rank(SPARSE, tp) - sum(routed.values()) / tp + sum(routed.values()) / ep / etp)


def test_dense_models_hold_no_experts_and_search_no_ep():
    dense = PRESETS["micro-llama"]
    assert expert_params_per_rank(dense, 2, ep=1) == 0.0
    assert expert_choices(dense, tp=2, num_devices=8) == [(1, None)]
    assert {(lay.ep, lay.etp) for lay in search_layouts(dense, num_devices=8, node_count=8,
                                                         micro_batch_size=8)} == {(1, None)}


def test_moe_stages_search_every_ep_and_etp_one_or_tp():
    choices = expert_choices(MIXTRAL, tp=2, num_devices=8)
    assert set(choices) == {(1, None), (2, None), (4, None), (1, 1), (2, 1), (4, 1), (8, 1)}
    assert set(expert_choices(MIXTRAL, tp=2, num_devices=8, ep=(2,))) == {(2, None), (2, 1)}
    found = {(lay.ep, lay.etp) for lay in search_layouts(MIXTRAL, num_devices=8, node_count=8, micro_batch_size=8)}
    assert (8, 1) in found and (4, None) in found and (1, None) in found


@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_alltoall_bytes_match_a_uniform_routing_table(tp, etp, ep):
    """Every ep rank routes each of its tokens to a top-2 subset of the 8 experts, the subsets in equal numbers
    (uniform routing); pairs whose expert lives on another ep rank are sent there once."""
    subsets = list(itertools.combinations(range(MOE.num_experts), MOE.top_k))
    tokens_per_rank = 3 * len(subsets)  # each subset three times
    sent = [0] * ep
    received = [0] * ep
    computed = [0] * ep
    for rank in range(ep):
        for experts in subsets * 3:
            for e in experts:
                owner = next(r for r in range(ep) if e in local_experts(MOE.num_experts, ep, r))
                computed[owner] += 1
                if owner != rank:
                    sent[rank] += 1
                    received[owner] += 1
    assert len(set(sent)) == 1 and sent == received  # the same on every rank, and what leaves arrives
    h, dtype_bytes = SPARSE.hidden_size, 2
    tokens = tokens_per_rank * tp / etp  # the tp group's tokens, shared out over its tp / etp expert-tp groups
    assert alltoall_bytes_per_rank(SPARSE, tokens, tp=tp, ep=ep, etp=etp, dtype_bytes=dtype_bytes) == \
        pytest.approx(sent[0] * h * dtype_bytes)
    assert routed_pairs_per_rank(SPARSE, tokens, tp=tp, etp=etp) == pytest.approx(computed[0])
    assert len(set(computed)) == 1


def test_load_allowance():
    assert load_allowance(MOE, 1) == 1.0  # one rank computes every pair whatever the balance
    assert load_allowance(MOE, 4) == MOE.load_imbalance == 1.1
    assert load_allowance(replace(MOE, load_imbalance=1.6, capacity_factor=1.25), 4) == 1.25  # drops the excess
    flat = replace(A100, eff_half_dim=0.0, hbm_gb_per_s=1e9)  # a shape-independent rate: only FLOPs count
    even = replace(SPARSE, moe=replace(MOE, load_imbalance=1.0))
    slow = replace(SPARSE, moe=replace(MOE, load_imbalance=2.0))
    tokens, h = 4096, SPARSE.hidden_size
    at = {ep: ffn_gemm_s(even, flat, tokens=tokens, tp=1, dtype_bytes=2, ep=ep) for ep in (1, 2, 4)}
    assert at[2] == pytest.approx(at[1]) and at[4] == pytest.approx(at[1])  # ep moves the pairs, adds no work
    routed_flops = 2 * 3 * h * MOE.ffn_hidden_size * tokens * MOE.top_k
    extra = ffn_gemm_s(slow, flat, tokens=tokens, tp=1, dtype_bytes=2, ep=2) - at[2]
    assert extra == pytest.approx(routed_flops / (flat.peak_tflops * flat.eff_max * 1e12))  # twice the pairs


def test_more_ep_gives_each_local_expert_more_tokens():
    even = replace(MIXTRAL, moe=replace(MIXTRAL.moe, load_imbalance=1.0))
    times = [ffn_gemm_s(even, A100, tokens=512, tp=1, dtype_bytes=2, ep=ep) for ep in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0]


def test_memory_falls_with_ep_and_zero_shards_experts_over_expert_dp():
    totals = []
    for ep in (1, 2, 4, 8):
        lay = ParallelLayout(tp=1, dp=8, ep=ep, zero=1)
        mem = memory_model(MIXTRAL, lay, tokens=4096, precision="bf16", capacity_gib=80)
        totals.append(mem.total().per_layer)
        p_layer = layer_params_per_rank(MIXTRAL, 1, ep=ep)
        p_expert = expert_params_per_rank(MIXTRAL, 1, ep=ep)
        # ZeRO-1: the experts' optimizer state is split over expert-dp (8 / ep ranks), the rest over dp
        assert mem.optimizer.per_layer == pytest.approx(12 * ((p_layer - p_expert) / 8 + p_expert / (8 // ep)))
        assert mem.weights.per_layer == pytest.approx(2 * p_layer)
    assert all(a > b for a, b in zip(totals, totals[1:]))


def test_alltoall_runs_on_the_links_the_ep_group_spans():
    inside = ep_alltoall_s(1e9, A100, HW, ep=8, etp=1, node_count=8, single_node=False)
    assert inside == pytest.approx(1e9 / (A100.intra_node_gb_per_s * 1e9) + 7 * A100.intra_latency_s)
    # ep 16 over two 8-device nodes: 8 of the 15 peers are on the other node, through the NIC its 8 ranks share
    across = ep_alltoall_s(1e9, A100, HW, ep=16, etp=1, node_count=8, single_node=False)
    off = 1e9 * 8 / 15
    assert across == pytest.approx((1e9 - off) / (A100.intra_node_gb_per_s * 1e9) + off / (25e9 / 8)
                                   + 7 * A100.intra_latency_s + 8 * 2e-5)
    assert across > 10 * inside
    assert ep_alltoall_s(1e9, A100, HW, ep=1, etp=1, node_count=8, single_node=True) == 0.0


def _two_node_job(poor_gib: float):
    """Two equally fast 4-device nodes, one short of memory; heads that only tp 1 splits (so ep is the lever)."""
    return parse_job({
        "cluster": {"inter_node_gb_per_s": 25, "device_types": {
            "big-gpu": {"vendor": "nvidia", "memory_gib": 80, "tflops_bf16": 312, "intra_node_gb_per_s": 300},
            "small-gpu": {"vendor": "nvidia", "memory_gib": poor_gib, "tflops_bf16": 312,
                          "intra_node_gb_per_s": 300}},
            "nodes": [{"name": "rich", "device": "big-gpu", "count": 4},
                      {"name": "poor", "device": "small-gpu", "count": 4}]},
        "model": {"num_layers": 8, "hidden_size": 640, "ffn_hidden_size": 2048, "num_attention_heads": 5,
                  "num_kv_heads": 5, "vocab_size": 32000, "seq_length": 2048,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 4096, "load_imbalance": 1.5}},
        "train": {"global_batch_size": 512, "precision": "bf16"}})


def test_search_gives_the_memory_poor_stage_the_larger_ep():
    narrow = SearchOptions(zero=(0,), offload=(OffloadSpec(),))
    report = search_plan(_two_node_job(6.5), options=narrow)
    by_type = {s.device_type: s for s in report.estimate.stages}
    assert by_type["big-gpu"].layout.ep == 1 and by_type["small-gpu"].layout.ep > 1
    # Without ep the poor node holds fewer layers, and the plan is slower.
    pinned = search_plan(_two_node_job(6.5), options=replace(narrow, ep=(1,)))
    assert pinned.estimate.step_time_s > report.estimate.step_time_s
    # With memory to spare, the same node keeps every expert (the load allowance makes ep cost time here).
    roomy = search_plan(_two_node_job(80.0), options=narrow)
    assert {s.layout.ep for s in roomy.estimate.stages} == {1}
