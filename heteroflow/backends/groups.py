"""Build every process group a plan needs, in one deterministic order, and hand each rank its own.

torch requires every rank to call `new_group` for every group, members or not, in the same order.
`build_process_groups` walks the plan the same way on all ranks: per stage (pipeline order) its
stage-wide group, tp groups, cp groups, dp groups, its cp x dp replica groups when cp > 1 (with cp 1
they are the dp groups), any fan-out group that is not already one of those, and for an expert layout
(`ep`, `etp`) its ep, etp and expert-dp groups (`RankMap.ep_groups` ...) where they are new; then per boundary
one group spanning both stages. The world (default group) is gloo: no single vendor backend reaches every
device of a mixed cluster.

Backends: a stage's groups use its vendor's backend (nccl for CUDA and ROCm, hccl for Ascend, gloo for
CPU); a boundary between two stages of one vendor uses that backend too (direct point-to-point),
any other boundary a gloo group (the host-staged bridge). With `emulate=True` every group is gloo,
but the vendor labels still pick direct or bridge, so CPU tests run the same code paths.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from heteroflow.backends.rankmap import RankMap
from heteroflow.backends.transport import DirectTransport, HostBridge
from heteroflow.backends.vendor import DIRECT
from heteroflow.devices.facade import Device
from heteroflow.remap.executor import Transport


@dataclass(frozen=True, slots=True)
class BoundaryLink:
    """The boundary between stage `src_stage` and the next one, seen from a rank on either side."""

    src_stage: int
    kind: str
    """`direct` or `bridge`."""
    backend: str
    """Backend of `group` (gloo for a bridge; in emulation, gloo for all)."""
    ranks: tuple[int, ...]
    group: dist.ProcessGroup
    transport: Transport


@dataclass(frozen=True, slots=True)
class ProcessGroups:
    """One rank's groups. Pass it explicitly; heteroflow keeps no module-level groups."""

    rank: int
    rank_map: RankMap
    emulate: bool
    backend: str
    """Backend of this rank's stage groups (gloo in emulation)."""
    world: dist.ProcessGroup
    stage: dist.ProcessGroup
    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    replicas: dist.ProcessGroup
    """This rank's cp x dp group: every rank of the stage holding the same weights (its dp group when cp is 1)."""
    fanout: dist.ProcessGroup | None
    """This rank's activation replica set (its tp group unless sp); None when it has no replicas."""
    ep: dist.ProcessGroup | None
    """This rank's expert-parallel group (tokens go to their experts by all-to-all in it); None when ep is 1."""
    etp: dist.ProcessGroup | None
    """This rank's expert tensor-parallel group (the tp group when etp = tp); None when etp is 1."""
    expert_dp: dist.ProcessGroup
    """The ranks holding the same expert slices (expert gradients are summed over it; the replicas when the stage
    sets no expert layout)."""
    prev: BoundaryLink | None
    """Link from the previous stage (None on the first stage)."""
    next: BoundaryLink | None
    """Link to the next stage (None on the last stage)."""
    created: tuple[tuple[str, tuple[int, ...], str], ...]
    """Every group created, `(name, ranks, backend)` in creation order (the same on all ranks)."""

    @property
    def stage_index(self) -> int:
        """This rank's stage."""
        return self.rank_map.info(self.rank).stage

    def member_groups(self) -> list[dist.ProcessGroup]:
        """Every group `build_process_groups` created that this rank belongs to (not the world), once each."""
        candidates = [self.stage, self.tp, self.cp, self.dp, self.replicas, self.fanout, self.ep, self.etp,
                      self.expert_dp,
                      *(link.group for link in (self.prev, self.next) if link is not None)]
        unique: dict[int, dist.ProcessGroup] = {}
        for group in candidates:
            if group is not None:
                unique.setdefault(id(group), group)
        return list(unique.values())

    def link(self, src_stage: int) -> BoundaryLink:
        """The link between `src_stage` and `src_stage + 1`; this rank must be on one side."""
        for link in (self.prev, self.next):
            if link is not None and link.src_stage == src_stage:
                return link
        raise ValueError(f"rank {self.rank} (stage {self.stage_index}) is on neither side of boundary "
                         f"{src_stage}->{src_stage + 1}")


def init_world(rank_map: RankMap, *, rank: int | None = None, timeout_s: float = 600.0) -> int:
    """Join the gloo world (torchrun's environment), or check the one already joined; returns the rank."""
    if not dist.is_initialized():
        kwargs = {} if rank is None else {"rank": rank, "world_size": rank_map.world_size}
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    if dist.get_world_size() != rank_map.world_size:
        raise ValueError(f"the plan has {rank_map.world_size} ranks but {dist.get_world_size()} processes were "
                         "launched; launch one process per device of the plan")
    return dist.get_rank()


def build_process_groups(rank_map: RankMap, *, emulate: bool = False, bridge_chunk_bytes: int = 4 << 20,
                         stage_host_tensors: bool = False, timeout_s: float | None = None) -> ProcessGroups:
    """Create every group of the plan (collective: all ranks call it) and return this rank's.

    `emulate`: every group on gloo (CPU processes standing in for devices). `stage_host_tensors`: make
    bridges copy CPU tensors through their staging buffers anyway (tests, benchmarks).
    Outside emulation, make each rank's device current (`Device.set_current`) first.
    """
    if not dist.is_initialized():
        raise RuntimeError("join the world first: heteroflow.backends.init_world(rank_map)")
    rank = dist.get_rank()
    if dist.get_world_size() != rank_map.world_size:
        raise ValueError(f"world has {dist.get_world_size()} ranks, plan {rank_map.world_size}")
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    created: list[tuple[str, tuple[int, ...], str]] = []
    mine: dict[str, dist.ProcessGroup] = {}

    def new_group(name: str, ranks: Sequence[int], backend: str) -> dist.ProcessGroup | None:
        # Every rank calls new_group for every group, in this one order; members keep theirs.
        created.append((name, tuple(ranks), backend))
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        return group if rank in ranks else None

    me = rank_map.info(rank)
    for s in rank_map.stages:
        backend = "gloo" if emulate else s.backend
        groups_by_ranks: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for name, sets in (("stage", [s.ranks]), ("tp", rank_map.tp_groups(s.index)),
                           ("cp", rank_map.cp_groups(s.index)), ("dp", rank_map.dp_groups(s.index))):
            for ranks in sets:
                group = new_group(f"stage{s.index}.{name}", ranks, backend)
                groups_by_ranks.setdefault(ranks, group)
                if group is not None:
                    mine[name] = group
        for ranks in rank_map.replica_groups(s.index):
            if ranks not in groups_by_ranks:  # with cp 1 the dp group: reuse it
                groups_by_ranks[ranks] = new_group(f"stage{s.index}.replicas", ranks, backend)
            if rank in ranks:
                mine["replicas"] = groups_by_ranks[ranks]
        for name, sets in (("fanout", rank_map.fanout_groups(s.index)), ("ep", rank_map.ep_groups(s.index)),
                           ("etp", rank_map.etp_groups(s.index)), ("expert_dp", rank_map.expert_dp_groups(s.index))):
            for ranks in sets:
                if len(ranks) == 1 and name != "expert_dp":
                    continue  # no fan-out, ep or etp to do
                if ranks not in groups_by_ranks:  # often an existing group (tp, dp, replicas): reuse it
                    groups_by_ranks[ranks] = new_group(f"stage{s.index}.{name}", ranks, backend)
                if rank in ranks:
                    mine[name] = groups_by_ranks[ranks]

    links: dict[int, BoundaryLink] = {}
    for k in range(rank_map.num_stages - 1):
        src, dst = rank_map.stages[k], rank_map.stages[k + 1]
        kind = rank_map.boundary_kind(k)
        backend = "gloo" if emulate or kind != DIRECT else src.backend
        ranks = src.ranks + dst.ranks
        group = new_group(f"boundary{k}.{kind}", ranks, backend)
        if group is not None:
            transport = (DirectTransport(group) if kind == DIRECT else
                         HostBridge(group, chunk_bytes=bridge_chunk_bytes, stage_host_tensors=stage_host_tensors))
            links[k] = BoundaryLink(src_stage=k, kind=kind, backend=backend, ranks=ranks, group=group,
                                    transport=transport)
    # NCCL and HCCL require the first point-to-point call on a group to involve all of its ranks, which
    # a remap need not; a barrier per direct link, in boundary order (no cycles), sets them up.
    for k in sorted(links):
        if links[k].kind == DIRECT:
            dist.barrier(group=links[k].group, **_barrier_device(links[k].backend, Device.for_vendor(me.vendor, me.local_device)))
    return ProcessGroups(rank=rank, rank_map=rank_map, emulate=emulate,
                         backend="gloo" if emulate else rank_map.stages[me.stage].backend,
                         world=dist.group.WORLD, stage=mine["stage"], tp=mine["tp"], cp=mine["cp"], dp=mine["dp"],
                         replicas=mine["replicas"], fanout=mine.get("fanout"), ep=mine.get("ep"), etp=mine.get("etp"),
                         expert_dp=mine["expert_dp"], prev=links.get(me.stage - 1),
                         next=links.get(me.stage), created=tuple(created))


def _barrier_device(backend: str, device: Device) -> dict:
    """NCCL barriers want to know the device (where it is here); other backends take no argument."""
    return {"device_ids": [device.index]} if backend == "nccl" and device.available else {}
