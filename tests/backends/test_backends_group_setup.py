"""Group creation that costs a rank its own groups: the same groups, under the same names, as when every rank
creates every group; torch calls per rank independent of the world size (fake worlds of 64 to 4,096 ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from heteroflow.backends import RankMap, build_process_groups
from heteroflow.backends.groups import local_creation_supported, plan_groups
from heteroflow.config import parse_job
from heteroflow.testing import run_ranks
from heteroflow.testing.group_setup import measure_group_setup, three_vendor_groups_job


def chain_job():
    """Three stages of different layouts: a boundary group's members hold different numbers of groups before
    it (what defeats torch's `use_local_synchronization`, which names groups by that number)."""
    return parse_job({
        "cluster": {"nodes": [{"name": "gpu", "device": "nvidia-a100-80g", "count": 2},
                              {"name": "npu", "device": "ascend-910b2", "count": 4},
                              {"name": "dcu", "device": "hygon-k100", "count": 2}]},
        "model": {"preset": "tiny-llama"},
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": 1},
        "plan": {"micro_batch_size": 4, "stages": [
            {"devices": ["gpu"], "layers": 3, "tp": 2},
            {"devices": ["npu"], "layers": 3, "tp": 2, "cp": 2},
            {"devices": ["dcu"], "layers": 2, "dp": 2}]},
    })


def names_worker(rank: int, world_size: int) -> dict:
    config = chain_job()
    rank_map = RankMap.from_plan(config.plan, config.cluster)
    order = plan_groups(rank_map, emulate=True)
    out = {"supported": local_creation_supported(),
           "own": [i for i, spec in enumerate(order) if rank in spec.ranks]}
    for members_only in (True, False):
        base = dist.distributed_c10d._world.group_count
        groups = build_process_groups(rank_map, emulate=True, members_only=members_only)
        own = groups.member_groups()
        for group in own:  # every group works: a sum over its members
            value = torch.ones(1)
            dist.all_reduce(value, group=group)
            assert int(value) == dist.get_world_size(group)
        # torch names a group by its place among all created: here, its index in the one order
        out[members_only] = sorted(int(group.group_name) - base for group in own)
        for group in own:
            dist.destroy_process_group(group)
    return out


def test_members_only_creation_gives_the_groups_and_names_of_a_full_creation():
    results = run_ranks(names_worker, 8, timeout_s=180)
    assert all(r["supported"] for r in results)
    for r in results:
        assert r[True] == r[False] == r["own"]


def test_group_setup_grows_with_the_ranks_own_groups_not_the_world():
    curve = []
    for world_size in (64, 512, 4096):
        config = three_vendor_groups_job(world_size)
        rank_map = RankMap.from_plan(config.plan, config.cluster)
        rank = world_size // 2 + 5  # in the middle (AMD) stage
        best = min((measure_group_setup(rank_map, rank, members_only=True) for _ in range(3)),
                   key=lambda m: m.new_group_s)
        curve.append(best)
    assert [m.num_groups for m in curve] == sorted({m.num_groups for m in curve})  # the world's groups grow
    for m in curve:
        assert m.num_new_group_calls == m.num_own == 6  # stage, tp, cp, dp, two boundaries
    # torch's part: per own group, at most a few times the 64-rank figure (1 ms of slack for a loaded machine)
    per_group = [m.new_group_s / m.num_own for m in curve]
    assert per_group[-1] <= 3 * per_group[0] + 1e-3, per_group
    # the listing of the plan's groups is pure Python over the world: well under a second at 4,096 ranks
    assert curve[-1].total_s < 1.0, curve[-1]
    everyone = measure_group_setup(rank_map, rank, members_only=False)
    assert everyone.num_new_group_calls == everyone.num_groups == curve[-1].num_groups
