"""Build every process group a plan needs, in one deterministic order, and hand each rank its own.

`plan_groups` lists every group of the plan in one order, the same on all ranks (pure, no torch calls):
per stage (pipeline order) its
stage-wide group, tp groups, cp groups, dp groups, its cp x dp replica groups when cp > 1 (with cp 1
they are the dp groups), any fan-out group that is not already one of those, and for an expert layout
(`ep`, `etp`) its ep, etp and expert-dp groups (`RankMap.ep_groups` ...) where they are new; then per boundary
one group spanning both stages. The world (default group) is gloo: no single vendor backend reaches every
device of a mixed cluster.

Backends: a stage's groups use its vendor's backend (nccl for CUDA and ROCm, hccl for Ascend, gloo for
CPU); a boundary between two stages of one vendor uses that backend too (direct point-to-point),
any other boundary a gloo group (the host-staged bridge). With `emulate=True` every group is gloo,
but the vendor labels still pick direct or bridge, so CPU tests run the same code paths.

Creation costs a rank its own groups, not the world's. torch's rule is that every rank calls `new_group` for
every group in one order; in torch 2.13 a non-member's call does nothing but take the next group name (a
counter, `str(count)`) unless `TORCH_DIST_INIT_BARRIER=1` (then each creation waits on a world-wide store
barrier), TorchComms is on (creation becomes a split of the world) or the world is bound to a device (NCCL
splits the world's communicator, every rank taking part). Outside those cases `build_process_groups` calls
`new_group` only for the rank's own groups, each under the name the full order gives it (the counter set to
the group's index in `plan_groups`), so the members of a group meet under one name whatever else they
created. torch's own `use_local_synchronization=True` is not used: it names a group by a hash of its ranks
and the number of groups the caller already holds, which differ between the members of a boundary group
(stage k's ranks hold their previous boundary, stage k+1's not yet), so they would wait on different keys.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch.distributed as dist
from torch.distributed import distributed_c10d

from heteroflow.backends.rankmap import RankMap
from heteroflow.backends.transport import DirectTransport, HostBridge
from heteroflow.backends.vendor import DIRECT
from heteroflow.devices.facade import Device
from heteroflow.remap.executor import Transport


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group of the plan, as `plan_groups` lists it."""

    name: str
    ranks: tuple[int, ...]
    backend: str
    """The backend the plan means (its vendor's; gloo in emulation and for bridges)."""
    roles: tuple[str, ...]
    """The `ProcessGroups` fields its members take it for (a dp group is also the replicas when cp is 1)."""
    boundary: tuple[int, str] | None = None
    """`(src_stage, kind)` of a boundary group."""


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
    fake: bool
    """The groups live on torch's fake process group (a dry run): no communication, backends as planned."""
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
    backend_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What a backend is registered as in this process when not under its own name (tests' strict CPU stand-ins,
    `heteroflow.testing.strict`); groups created later (the tied embedding's) use it too."""

    def registered(self, backend: str) -> str:
        """The name to pass `dist.new_group` for `backend` in this process."""
        return self.backend_names.get(backend, backend)

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


def plan_groups(rank_map: RankMap, *, emulate: bool = False) -> tuple[GroupSpec, ...]:
    """Every group of the plan in creation order (see the module docstring); the same on every rank."""
    order: list[GroupSpec] = []
    roles: list[list[str]] = []

    def add(name: str, ranks: tuple[int, ...], backend: str, role: str | None,
            boundary: tuple[int, str] | None = None) -> int:
        order.append(GroupSpec(name=name, ranks=ranks, backend=backend, roles=(), boundary=boundary))
        roles.append([] if role is None else [role])
        return len(order) - 1

    for s in rank_map.stages:
        backend = "gloo" if emulate else s.backend
        index_by_ranks: dict[tuple[int, ...], int] = {}
        for name, sets in (("stage", [s.ranks]), ("tp", rank_map.tp_groups(s.index)),
                           ("cp", rank_map.cp_groups(s.index)), ("dp", rank_map.dp_groups(s.index))):
            for ranks in sets:
                index_by_ranks.setdefault(ranks, add(f"stage{s.index}.{name}", ranks, backend, name))
        for name, sets in (("replicas", rank_map.replica_groups(s.index)),
                           ("fanout", rank_map.fanout_groups(s.index)), ("ep", rank_map.ep_groups(s.index)),
                           ("etp", rank_map.etp_groups(s.index)), ("expert_dp", rank_map.expert_dp_groups(s.index))):
            for ranks in sets:
                if len(ranks) == 1 and name not in ("replicas", "expert_dp"):
                    continue  # no fan-out, ep or etp to do
                if ranks in index_by_ranks:  # often an existing group (tp, dp, replicas): reuse it
                    roles[index_by_ranks[ranks]].append(name)
                else:
                    index_by_ranks[ranks] = add(f"stage{s.index}.{name}", ranks, backend, name)
    for k in range(rank_map.num_stages - 1):
        src, dst = rank_map.stages[k], rank_map.stages[k + 1]
        kind = rank_map.boundary_kind(k)
        backend = "gloo" if emulate or kind != DIRECT else src.backend
        add(f"boundary{k}.{kind}", src.ranks + dst.ranks, backend, None, boundary=(k, kind))
    return tuple(GroupSpec(name=g.name, ranks=g.ranks, backend=g.backend, roles=tuple(r), boundary=g.boundary)
                 for g, r in zip(order, roles))


def local_creation_supported() -> bool:
    """Whether a rank may create only its own groups (see the module docstring): no init barrier, no TorchComms
    splits, no world bound to a device."""
    return (os.environ.get("TORCH_DIST_INIT_BARRIER", "0") != "1" and not _torchcomms_enabled()
            and getattr(dist.group.WORLD, "bound_device_id", None) is None)


def _torchcomms_enabled() -> bool:
    # torch.distributed.config (and TorchComms) came after torch 2.4, the floor: absent means off.
    try:
        import torch.distributed.config as dist_config
    except ImportError:
        return False
    return bool(getattr(dist_config, "use_torchcomms", False))


def _create_groups(order: Sequence[GroupSpec], rank: int, *, fake: bool, timeout: datetime.timedelta | None,
                   members_only: bool, backend_names: Mapping[str, str]) -> dict[int, dist.ProcessGroup]:
    """Create the groups of `order` this rank needs; returns its own by index in `order`.

    `members_only`: call `new_group` for the rank's own groups only, each under the name (counter value) the
    full order gives it; otherwise for every group, as torch's general rule asks. A rank outside a group may
    lack its backend (a CUDA rank has no hccl): torch only needs the call. `backend_names`: what a backend is
    registered as here when not under its own name.
    """
    base = distributed_c10d._world.group_count
    own: dict[int, dist.ProcessGroup] = {}
    for index, spec in enumerate(order):
        member = rank in spec.ranks
        if not member and members_only:
            continue
        distributed_c10d._world.group_count = base + index  # a no-op when every group is created
        backend = "fake" if fake else backend_names.get(spec.backend, spec.backend)
        group = dist.new_group(list(spec.ranks), backend=backend, timeout=timeout)
        if member:
            own[index] = group
    distributed_c10d._world.group_count = base + len(order)  # later groups are named as after a full creation
    return own


def build_process_groups(rank_map: RankMap, *, emulate: bool = False, fake: bool = False,
                         members_only: bool | None = None, bridge_chunk_bytes: int = 4 << 20,
                         stage_host_tensors: bool = False, timeout_s: float | None = None,
                         backend_names: Mapping[str, str] | None = None) -> ProcessGroups:
    """Create this rank's groups of the plan (collective: all ranks call it) and return them.

    `emulate`: every group on gloo (CPU processes standing in for devices). `fake`: the world is torch's fake
    process group (a dry run of one rank); every group is created on it, labelled with its planned backend.
    `members_only`: create only this rank's groups (default: where torch allows it, `local_creation_supported`);
    False calls `new_group` for every group of the plan. `stage_host_tensors`: make bridges copy CPU tensors
    through their staging buffers anyway (tests, benchmarks). `backend_names`: what a backend is registered as
    here when not under its own name (`heteroflow.testing.strict`'s CPU stand-ins).
    Outside emulation, make each rank's device current (`Device.set_current`) first.
    """
    if not dist.is_initialized():
        raise RuntimeError("join the world first: heteroflow.backends.init_world(rank_map)")
    rank = dist.get_rank()
    if dist.get_world_size() != rank_map.world_size:
        raise ValueError(f"world has {dist.get_world_size()} ranks, plan {rank_map.world_size}")
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    names = dict(backend_names or {})
    order = plan_groups(rank_map, emulate=emulate)
    handles = _create_groups(order, rank, fake=fake, timeout=timeout, backend_names=names,
                             members_only=local_creation_supported() if members_only is None else members_only)
    me = rank_map.info(rank)
    mine: dict[str, dist.ProcessGroup] = {}
    links: dict[int, BoundaryLink] = {}
    for index, group in handles.items():
        spec = order[index]
        for role in spec.roles:
            mine[role] = group
        if spec.boundary is not None:
            k, kind = spec.boundary
            # Outside emulation an accelerator rank's boundary tensors are device tensors: its bridge stages them
            # (also where a test's CPU stand-in holds them in host memory).
            staging = stage_host_tensors or (not emulate and me.vendor != "cpu")
            transport = (DirectTransport(group) if kind == DIRECT else
                         HostBridge(group, chunk_bytes=bridge_chunk_bytes, stage_host_tensors=staging))
            links[k] = BoundaryLink(src_stage=k, kind=kind, backend=spec.backend, ranks=spec.ranks, group=group,
                                    transport=transport)
    # NCCL and HCCL require the first point-to-point call on a group to involve all of its ranks, which
    # a remap need not; a barrier per direct link, in boundary order (no cycles), sets them up.
    for k in sorted(links):
        if links[k].kind == DIRECT:
            device = Device.for_vendor(me.vendor, me.local_device)
            dist.barrier(group=links[k].group, **_barrier_device(links[k].backend, device))
    return ProcessGroups(rank=rank, rank_map=rank_map, emulate=emulate,
                         backend="gloo" if emulate else rank_map.stages[me.stage].backend, fake=fake,
                         world=dist.group.WORLD, stage=mine["stage"], tp=mine["tp"], cp=mine["cp"], dp=mine["dp"],
                         replicas=mine["replicas"], fanout=mine.get("fanout"), ep=mine.get("ep"), etp=mine.get("etp"),
                         expert_dp=mine["expert_dp"], prev=links.get(me.stage - 1),
                         next=links.get(me.stage), created=tuple((g.name, g.ranks, g.backend) for g in order),
                         backend_names=names)


def _barrier_device(backend: str, device: Device) -> dict:
    """NCCL barriers want to know the device (where it is here); other backends take no argument."""
    return {"device_ids": [device.index]} if backend == "nccl" and device.available else {}
