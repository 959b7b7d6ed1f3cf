"""Group setup of one rank of a large simulated world: torch's fake process group stands in for the others.

`three_vendor_groups_job(world_size)` is a plan of that many devices over NVIDIA, AMD and Ascend stages;
`measure_group_setup` joins a fake world as one of its ranks, builds that rank's groups and reports what it
cost: in all, in torch's `new_group` calls, and how many of those the rank made. It joins and leaves the world itself: call it in a process with no world of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from heteroflow.backends import RankMap
from heteroflow.backends.groups import build_process_groups
from heteroflow.config import JobConfig, parse_job

VENDOR_SHARES = (("nvidia-h100-sxm", 2, 4), ("amd-mi300x", 1, 2), ("ascend-910b2", 1, 2))
"""Device type, share of the world (out of 4) and layers (of tiny-llama's 8) of each stage of
`three_vendor_groups_job`."""


def three_vendor_groups_job(world_size: int) -> JobConfig:
    """A tiny model on `world_size` devices (a multiple of 64): an NVIDIA stage of half of them, then AMD and
    Ascend stages of a quarter each, all tp 8 and the rest dp."""
    if world_size % 64:
        raise ValueError(f"world_size {world_size} is not a multiple of 64")
    nodes, stages = [], []
    for device, share, layers in VENDOR_SHARES:
        names = [f"{device}-{i}" for i in range(world_size * share // 4 // 8)]
        nodes += [{"name": name, "device": device, "count": 8} for name in names]
        stages.append({"devices": names, "layers": layers, "tp": 8, "dp": world_size * share // 4 // 8})
    micro_batch = world_size // 16
    return parse_job({"cluster": {"nodes": nodes}, "model": {"preset": "tiny-llama"},
                      "train": {"global_batch_size": micro_batch, "micro_batch_size": micro_batch, "steps": 1},
                      "plan": {"micro_batch_size": micro_batch, "stages": stages}})


@dataclass(frozen=True, slots=True)
class GroupSetup:
    """What building one rank's groups cost."""

    world_size: int
    rank: int
    members_only: bool
    num_groups: int
    """Groups in the plan (`ProcessGroups.created`)."""
    num_own: int
    """Groups this rank belongs to."""
    num_new_group_calls: int
    total_s: float
    """`build_process_groups`, all of it."""
    new_group_s: float
    """The part spent in torch's `new_group` calls."""

    @property
    def listing_s(self) -> float:
        """The rest: listing the plan's groups (`plan_groups`, pure Python) and picking the rank's own."""
        return self.total_s - self.new_group_s


def measure_group_setup(rank_map: RankMap, rank: int, *, members_only: bool) -> GroupSetup:
    """Join a fake world of the plan's size as `rank`, build its groups, leave; see the module docstring."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=rank_map.world_size)
    calls: list[float] = []
    new_group = dist.new_group

    def timed_new_group(*args, **kwargs):
        started = time.perf_counter()
        try:
            return new_group(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - started)

    dist.new_group = timed_new_group  # build_process_groups calls it as `dist.new_group`
    try:
        started = time.perf_counter()
        groups = build_process_groups(rank_map, fake=True, members_only=members_only)
        total_s = time.perf_counter() - started
    finally:
        dist.new_group = new_group
        dist.destroy_process_group()
    return GroupSetup(world_size=rank_map.world_size, rank=rank, members_only=members_only,
                      num_groups=len(groups.created), num_own=sum(rank in ranks for _, ranks, _ in groups.created),
                      num_new_group_calls=len(calls), total_s=total_s, new_group_s=sum(calls))
