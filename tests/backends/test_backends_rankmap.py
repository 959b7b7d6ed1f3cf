"""RankMap: every rank's stage, dp/cp/tp index, node and device, and back; vendor -> backend rules."""

from __future__ import annotations

import pytest

from heteroflow.errors import UserError

from heteroflow.backends import BRIDGE, DIRECT, RankMap, boundary_kind, collective_backend
from heteroflow.config import load_job, parse_job
from heteroflow.remap import LayoutError

from conftest import REPO


def job(stages: list[dict], nodes: list[dict], micro_batch_size: int = 4):
    return parse_job({
        "cluster": {"nodes": nodes},
        "model": {"preset": "tiny-llama"},
        "train": {"global_batch_size": 16, "micro_batch_size": micro_batch_size, "precision": "fp32", "steps": 1},
        "plan": {"micro_batch_size": micro_batch_size, "stages": stages},
    })


def test_the_emulated_three_vendor_job_maps_every_rank():
    config = load_job(REPO / "configs/jobs/emulated-three-vendor.yaml")
    ranks = RankMap.from_plan(config.plan, config.cluster)
    assert ranks.world_size == 8 and ranks.num_stages == 3
    summary = [(i.stage, i.dp, i.tp, i.node, i.local_device, i.vendor) for i in map(ranks.info, range(8))]
    assert summary == [(0, 0, 0, "gpu-0", 0, "nvidia"), (0, 0, 1, "gpu-0", 1, "nvidia"),
                       (1, 0, 0, "npu-0", 0, "ascend"), (1, 1, 0, "npu-0", 1, "ascend"),
                       (2, 0, 0, "dcu-0", 0, "hygon"), (2, 0, 1, "dcu-0", 1, "hygon"),
                       (2, 1, 0, "dcu-0", 2, "hygon"), (2, 1, 1, "dcu-0", 3, "hygon")]
    for rank in range(8):  # and back
        info = ranks.info(rank)
        assert ranks.rank_of(info.stage, dp=info.dp, cp=info.cp, tp=info.tp) == rank
        assert ranks.rank_at(info.node, info.local_device) == rank
    assert [s.backend for s in ranks.stages] == ["nccl", "hccl", "nccl"]
    assert [ranks.boundary_kind(k) for k in (0, 1)] == [BRIDGE, BRIDGE]
    assert ranks.tp_groups(2) == [(4, 5), (6, 7)] and ranks.dp_groups(2) == [(4, 6), (5, 7)]
    assert ranks.fanout_groups(0) == [(0, 1)] and ranks.fanout_groups(1) == []
    assert "boundary 1->2: bridge" in ranks.describe()


def test_rank_order_follows_the_devices_list_with_tp_inside_cp_inside_dp():
    config = job([{"devices": ["gpu-0:4-7", "gpu-0:0-3"], "layers": 8, "tp": 2, "cp": 2, "dp": 2}],
                 [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 8}], micro_batch_size=2)
    ranks = RankMap.from_plan(config.plan, config.cluster)
    assert [ranks.info(r).local_device for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [(ranks.info(r).dp, ranks.info(r).cp, ranks.info(r).tp) for r in (0, 1, 2, 5)] == \
           [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1)]
    assert ranks.tp_groups(0) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert ranks.cp_groups(0) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert ranks.dp_groups(0) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert ranks.replica_groups(0) == [(0, 2, 4, 6), (1, 3, 5, 7)]  # cp x dp: what ZeRO-3 shards over
    assert ranks.rank_at("gpu-0", 0) == 4


def test_same_vendor_boundaries_are_direct_and_layouts_follow_the_stages():
    config = job([{"devices": ["a"], "layers": 4, "tp": 2}, {"devices": ["b"], "layers": 4, "dp": 2, "tp": 1}],
                 [{"name": "a", "device": "nvidia-a100-80g", "count": 2},
                  {"name": "b", "device": "nvidia-h100-sxm", "count": 2}])
    ranks = RankMap.from_plan(config.plan, config.cluster)
    assert ranks.boundary_kind(0) == DIRECT
    layout = ranks.activation_layout(1, (4, 128, 128))
    assert layout.ranks == (2, 3) and layout.box(3) == ((2, 4), (0, 128), (0, 128))
    with pytest.raises(LayoutError, match="cannot split batch"):
        ranks.activation_layout(1, (3, 128, 128))


def test_lookups_out_of_range_say_so():
    config = load_job(REPO / "configs/jobs/emulated-three-vendor.yaml")
    ranks = RankMap.from_plan(config.plan, config.cluster)
    with pytest.raises(IndexError, match="rank 8 out of range 0..7"):
        ranks.info(8)
    with pytest.raises(IndexError, match="stage 1: dp index 2 out of range 0..1"):
        ranks.rank_of(1, dp=2)
    with pytest.raises(KeyError, match="no rank of this plan runs on npu-0:7"):
        ranks.rank_at("npu-0", 7)


def test_vendor_backends_and_boundary_kinds():
    assert [collective_backend(v) for v in ("nvidia", "amd", "hygon", "ascend", "cpu")] == \
           ["nccl", "nccl", "nccl", "hccl", "gloo"]
    with pytest.raises(UserError, match="unknown vendor 'intel'"):
        collective_backend("intel")
    assert boundary_kind("nvidia", "nvidia") == boundary_kind("ascend", "ascend") == DIRECT
    # Different vendors, a CPU side, and AMD vs Hygon (different RCCL builds) all go through the bridge.
    assert {boundary_kind(*pair) for pair in [("nvidia", "ascend"), ("ascend", "hygon"), ("cpu", "cpu"),
                                              ("nvidia", "cpu"), ("amd", "hygon")]} == {BRIDGE}


def test_planning_side_imports_need_no_torch():
    import subprocess
    import sys

    code = ("import sys, heteroflow.remap, heteroflow.backends; from heteroflow.backends import RankMap; "
            "from heteroflow.remap import plan_transfer; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def _megatron_expert_groups(world: int, etp: int, ep: int) -> dict[str, list[tuple[int, ...]]]:
    """Megatron-core's expert groups for one pipeline stage, written out from its rule: ranks decompose as
    (expert_dp, ep, etp) with etp varying fastest (order tp-ep-dp); a group varies one index, the others fixed."""
    edp = world // (etp * ep)
    at = lambda d, e, t: (d * ep + e) * etp + t  # noqa: E731
    return {"ep": [tuple(at(d, e, t) for e in range(ep)) for d in range(edp) for t in range(etp)],
            "etp": [tuple(at(d, e, t) for t in range(etp)) for d in range(edp) for e in range(ep)],
            "expert_dp": [tuple(at(d, e, t) for d in range(edp)) for e in range(ep) for t in range(etp)]}


@pytest.mark.parametrize("layout,etp,ep", [({"tp": 2, "dp": 4, "ep": 4, "etp": 1}, 1, 4),
                                            ({"tp": 2, "dp": 4, "ep": 2}, 2, 2),
                                            ({"tp": 2, "cp": 2, "dp": 2, "ep": 4, "etp": 1}, 1, 4)])
def test_expert_groups_fold_over_the_stage_as_megatron_core(layout, etp, ep):
    """A MoE stage's ep / etp / expert-dp groups fold over its tp x cp x dp ranks as Megatron-core's expert rank
    generator does, offset by the stage's first rank; every rank's expert indices lead back to it."""
    config = parse_job({
        "cluster": {"nodes": [{"name": "a", "device": "nvidia-a100-80g", "count": 1},
                              {"name": "b", "device": "nvidia-a100-80g", "count": 8}]},
        "model": {"preset": "micro-llama", "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 32}},
        "train": {"global_batch_size": 16, "micro_batch_size": 4, "precision": "fp32", "steps": 1},
        "plan": {"micro_batch_size": 4, "stages": [{"devices": ["a"], "layers": 2}, {"devices": ["b"], "layers": 2,
                                                                                      **layout}]}})
    ranks = RankMap.from_plan(config.plan, config.cluster)
    want = {name: [tuple(1 + r for r in group) for group in groups]
            for name, groups in _megatron_expert_groups(8, etp, ep).items()}
    assert ranks.ep_groups(1) == want["ep"] and ranks.etp_groups(1) == want["etp"]
    assert ranks.expert_dp_groups(1) == want["expert_dp"]
    stage = ranks.stages[1]
    for rank in stage.ranks:
        info = ranks.info(rank)
        assert stage.expert_rank(expert_dp=info.expert_dp, ep=info.ep, etp=info.etp) == rank
    assert ranks.ep_groups(0) == [(0,)] and ranks.expert_dp_groups(0) == [(0,)]  # a stage without expert layout
