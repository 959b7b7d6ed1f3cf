"""tp / cp / dp groups priced on the node's links (`stagemap.topology`): a group gets the minimum cut of its
links, a stage the slowest of its groups, the planner the slowest slice; no topology, no change."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import parse_job
from heteroflow.config.catalog import CATALOG, DGX1_HYBRID_CUBE_MESH
from heteroflow.layout import ParallelLayout
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.costs import StageHardware, stage_costs
from heteroflow.stagemap.hardware import Hardware, device_model
from heteroflow.stagemap.topology import group_gb_per_s, min_cut_links, slices, stage_fractions

V100 = CATALOG["nvidia-v100-32g"]
HARDWARE = Hardware(models={}, inter_node_gb_per_s=12.5)


def test_a_group_gets_the_least_links_across_any_cut():
    links = DGX1_HYBRID_CUBE_MESH.links
    assert min_cut_links(links, (0, 1)) == 1 and min_cut_links(links, (0, 3)) == 2  # NV1 and NV2 pairs
    assert min_cut_links(links, (0, 1, 2, 3)) == 4  # a quad: each GPU has four links inside it
    assert min_cut_links(links, (0, 2, 4, 6)) == 2  # a strided dp group is a ring of single links (one double)
    assert min_cut_links(links, tuple(range(8))) == 6
    assert min_cut_links(links, (0, 5)) == 0  # no NVLink between them
    gbs = dict(host_gb_per_s=16.0, device_gb_per_s=150.0)
    assert group_gb_per_s(DGX1_HYBRID_CUBE_MESH, (0, 1), **gbs) == 25.0
    assert group_gb_per_s(DGX1_HYBRID_CUBE_MESH, (0, 5), **gbs) == 16.0  # through the host
    assert group_gb_per_s(DGX1_HYBRID_CUBE_MESH, tuple(range(8)), **gbs) == 150.0
    mesh = CATALOG["ascend-910a"].topology  # two 4-chip meshes
    assert group_gb_per_s(mesh, (0, 1, 2, 3), host_gb_per_s=32.0, device_gb_per_s=90.0) == 90.0
    assert group_gb_per_s(mesh, (0, 1, 4, 5), host_gb_per_s=32.0, device_gb_per_s=90.0) == 32.0


def test_a_stage_axis_is_as_fast_as_its_slowest_group_and_the_planner_takes_the_slowest_slice():
    gbs = dict(host_gb_per_s=16.0, device_gb_per_s=150.0)
    whole = slices(8, 8)
    assert whole == [tuple((0, i) for i in range(8))]
    tp, cp, dp = stage_fractions(DGX1_HYBRID_CUBE_MESH, ParallelLayout(tp=2, dp=4), whole, **gbs)
    assert (tp, cp, dp) == (25 / 150, 1.0, 50 / 150)  # pairs (0,1), (4,5) have one link; dp rings two
    assert stage_fractions(DGX1_HYBRID_CUBE_MESH, ParallelLayout(tp=8), whole, **gbs) == (1.0, 1.0, 1.0)
    pairs = slices(2, 8)
    assert pairs == [((0, 0), (0, 1)), ((0, 2), (0, 3)), ((0, 4), (0, 5)), ((0, 6), (0, 7))]
    assert stage_fractions(DGX1_HYBRID_CUBE_MESH, ParallelLayout(tp=2), pairs[1:2], **gbs)[0] == 50 / 150
    assert stage_fractions(DGX1_HYBRID_CUBE_MESH, ParallelLayout(tp=2), pairs, **gbs)[0] == 25 / 150


def test_tp_collectives_cost_what_the_links_carry():
    device = device_model(V100, "fp16")
    flat = replace(device, topology=None)
    layout = ParallelLayout(tp=2, dp=4)
    model = parse_job({"cluster": {"nodes": [{"name": "n", "device": "nvidia-v100-32g", "count": 8}]},
                       "model": {"preset": "llama2-7b"}, "train": {"global_batch_size": 8}}).model
    placed = StageHardware(device=device, num_devices=8, num_nodes=1, node_count=8,
                           placement=tuple((0, i) for i in range(8)))
    meshed = stage_costs(model, placed, layout, 8, HARDWARE).parts(4, False, False)
    plain = stage_costs(model, replace(placed, device=flat), layout, 8, HARDWARE).parts(4, False, False)
    latency = 2 * 2 * 4 * flat.intra_latency_s  # forward: 2 all-reduces per layer, 2 ring steps each, 4 layers
    assert meshed.forward_comm_s - latency == pytest.approx(6 * (plain.forward_comm_s - latency), rel=1e-6)
    assert meshed.dp_s > 2.9 * plain.dp_s  # the strided dp rings have 50 of 150 GB/s
    assert meshed.forward_s == plain.forward_s  # compute unchanged


def test_evaluate_prices_the_named_devices_and_emulation_ignores_links():
    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "nvidia-v100-32g", "count": 8}]},
                     "model": {"preset": "llama2-7b", "num_layers": 8},
                     "train": {"global_batch_size": 8, "precision": "fp16"},
                     "plan": {"micro_batch_size": 1, "stages": [{"devices": ["n:0-1"], "layers": 4, "tp": 2},
                                                                {"devices": ["n:2-3"], "layers": 4, "tp": 2}]}})
    estimate = evaluate_plan(job, job.plan)
    first, second = (s.times.collective_s for s in estimate.stages)
    assert first > 1.5 * second  # GPUs 0-1 share one NVLink, 2-3 two
    emulated = evaluate_plan(job, job.plan, emulate=True)
    assert emulated.stages[0].times.collective_s == pytest.approx(emulated.stages[1].times.collective_s, rel=0.05)
