"""A dry run of one rank of a plan: its groups, stage, shard, optimizer and offload tiers built without the cluster.

The process joins torch's fake process group (collectives return at once, nothing is sent) as rank `r` of a
world of the plan's size, creates the rank's groups as a real run does (`build_process_groups`), and builds
its stage with `build_stage_runtime` under `FakeTensorMode`: every tensor has its shape, dtype and device but
no storage, so a 70B stage costs no memory and no weights are drawn. It then walks the schedule's action list
for one step (what the rank receives and sends for each forward and backward, nothing computed) and reports
the rank's groups, the bytes its shard and state take next to the planner's figures
(`runtime.memory.planned_memory`, `stagemap.memory.stage_offloaded_optimizer_bytes`), and the time taken.

Call `dry_run_rank` in a process with no world of its own (`launcher.dry_run` starts one per rank).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from heteroflow.backends import RankMap, build_process_groups
from heteroflow.config import JobConfig, PlanSpec
from heteroflow.devices.facade import Device
from heteroflow.errors import UserError
from heteroflow.layout.schedule import FORWARD, in_flight, max_in_flight, stage_actions
from heteroflow.remap.layout import box_volume
from heteroflow.runtime.memory import planned_memory
from heteroflow.runtime.stage import DTYPES, StageRuntime, build_stage_runtime
from heteroflow.stagemap.memory import stage_offloaded_optimizer_bytes

STATE_KEYS = ("params", "grads", "optimizer")
"""The training state a rank holds on its device (the planner's and the optimizer's keys)."""


@dataclass(frozen=True, slots=True)
class GroupLine:
    """One of the rank's groups."""

    roles: str
    """The `ProcessGroups` fields it serves (`tp`, `dp+replicas`, `boundary1.bridge`, ...)."""
    backend: str
    """The backend the plan means (the dry run creates it on the fake backend)."""
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepWalk:
    """One step of the rank's schedule, walked without computing."""

    actions: str
    """The action list, `F0 F1 B0 ...`."""
    recv_messages: int
    recv_bytes: int
    send_messages: int
    send_bytes: int
    in_flight: int
    """Most micro-batches whose activations the rank holds at once under the action list."""
    planned_in_flight: int
    """The planner's closed form for the same (`layout.schedule.in_flight`)."""


@dataclass(frozen=True, slots=True)
class DryRunReport:
    """What one rank's dry run found; `format_report` prints it."""

    rank: int
    world_size: int
    stage: int
    where: str
    """Node, device, vendor and indices of the rank."""
    layout: str
    step_windows: bool
    """Part of the planner's device params and grads exist only inside a step (ZeRO-3's gathered blocks,
    offloaded blocks fetched to the device), which a dry run does not run."""
    groups: tuple[GroupLine, ...]
    num_plan_groups: int
    """Groups of the whole plan (`ProcessGroups.created`)."""
    num_created: int
    """`new_group` calls this rank made (its own groups, plus the tied-embedding group every rank creates)."""
    optimizer: str
    measured: dict[str, int]
    """Device bytes of the rank's state by `STATE_KEYS` (`StageOptimizer.memory_bytes`, what a real run's step
    records report), `offload`: the optimizer state in its offload tier, and `shard`: the bytes of the model's
    parameter tensors as built (`shard_bytes`)."""
    planned: dict[str, int]
    """The planner's figures for the rank's stage (`planned_memory`), and `offload` as above."""
    walk: StepWalk
    timings_s: dict[str, float]
    """`groups`, `stage` (shard, optimizer, tiers, boundaries), `schedule`, `total` (in the process)."""

    def state_ratio(self) -> float:
        """Measured / planned bytes of the rank's state, device and offload tier together."""
        keys = (*STATE_KEYS, "offload")
        return sum(self.measured[k] for k in keys) / max(1, sum(self.planned[k] for k in keys))


def dry_run_rank(job: JobConfig, plan: PlanSpec, rank: int) -> DryRunReport:
    """Dry-run `rank` of `plan` in this process (see the module docstring)."""
    started = time.perf_counter()
    rank_map = RankMap.from_plan(plan, job.cluster)
    if not 0 <= rank < rank_map.world_size:
        raise UserError(f"--rank: {rank} is not a rank of this plan (0..{rank_map.world_size - 1})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=rank_map.world_size)
    calls = _count_new_group_calls()
    try:
        groups = build_process_groups(rank_map, fake=True)
        groups_done = time.perf_counter()
        info = rank_map.info(rank)
        device = Device.for_vendor(info.vendor, info.local_device, emulate=True)  # labels only: nothing runs
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # the activation meter keys parameters by storage address; fake ones have none, which is harmless here
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            rt = build_stage_runtime(job, plan, rank_map, groups, device=device, meta=True)
        try:
            stage_done = time.perf_counter()
            walk = walk_step(rt)
            measured = {k: int(v) for k, v in rt.optimizer.memory_bytes().items()}
            measured["shard"] = shard_bytes(rt.model)
            report = rt.offload_report()
            measured["offload"] = int(report.get("optimizer_tier_bytes", 0)) if report is not None else 0
        finally:
            rt.close()
    finally:
        dist.new_group = calls.original
        dist.destroy_process_group()
    stage = plan.stages[info.stage]
    precision = stage.layout.compute_precision(job.train.precision)
    planned = planned_memory(job, plan, info.stage)
    planned["offload"] = int(round(stage_offloaded_optimizer_bytes(
        job.model, stage.layout, precision=precision, stage=info.stage, num_stages=len(plan.stages),
        layers=stage.layers)))
    done = time.perf_counter()
    return DryRunReport(
        rank=rank, world_size=rank_map.world_size, stage=info.stage,
        where=f"node {info.node} device {info.local_device} ({info.device_type}, {info.vendor}), "
              f"dp {info.dp} cp {info.cp} tp {info.tp}",
        layout=stage.layout.describe(), step_windows=stage.layout.zero == 3 or stage.layout.offload.params != "device",
        groups=_group_lines(groups), num_plan_groups=len(groups.created), num_created=calls.count,
        optimizer=type(rt.optimizer).__name__, measured=measured, planned=planned, walk=walk,
        timings_s={"groups": groups_done - started, "stage": stage_done - groups_done,
                   "schedule": done - stage_done, "total": done - started})


def shard_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters as this rank holds them (ZeRO-3: the local shards; offloaded blocks:
    what stays in the model, their placeholders)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class _CountingNewGroup:
    """Counts `dist.new_group` calls while installed (restore `original` afterwards)."""

    def __init__(self) -> None:
        self.original, self.count = dist.new_group, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.original(*args, **kwargs)


def _count_new_group_calls() -> _CountingNewGroup:
    counter = _CountingNewGroup()
    dist.new_group = counter  # build_process_groups and build_stage_runtime call it as `dist.new_group`
    return counter


def _group_lines(groups) -> tuple[GroupLine, ...]:
    """The rank's groups, one line per group (roles sharing one group joined by `+`)."""
    rank = groups.rank
    by_ranks: dict[tuple[int, ...], list] = {}
    for name, ranks, backend in groups.created:
        if rank in ranks:
            entry = by_ranks.setdefault(ranks, [[], backend])
            entry[0].append(name.split(".", 1)[1] if name.startswith("stage") else name)
    return tuple(GroupLine(roles="+".join(roles), backend=backend, ranks=ranks)
                 for ranks, (roles, backend) in by_ranks.items())


def walk_step(rt: StageRuntime) -> StepWalk:
    """The rank's action list for one step, with the boundary messages each action receives and sends."""
    plan, k, rank = rt.plan, rt.info.stage, rt.groups.rank
    num_stages, num_micro_batches = len(plan.stages), plan.num_micro_batches(rt.job.train)
    actions = stage_actions(plan.schedule, num_stages, k, num_micro_batches)
    sizes = [torch.empty((), dtype=DTYPES[s.layout.compute_precision(rt.job.train.precision)]).element_size()
             for s in plan.stages]
    counts = {"recv": [0, 0], "send": [0, 0]}

    def add(kind: str, pieces, elem_size: int) -> None:
        counts[kind][0] += len(pieces)
        counts[kind][1] += sum(box_volume(piece.box) for _, piece in pieces) * elem_size

    for action in actions:
        if action.kind == FORWARD:
            if rt.prev is not None:  # the previous stage's activation, in its precision
                add("recv", rt.prev.forward_plan.recvs_of(rank), sizes[k - 1])
            if rt.next is not None:
                add("send", rt.next.forward_plan.sends_of(rank), sizes[k])
        else:
            if rt.next is not None:  # the next stage's gradient, in its precision
                add("recv", rt.next.backward_plan.recvs_of(rank), sizes[k + 1])
            if rt.prev is not None:
                add("send", rt.prev.backward_plan.sends_of(rank), sizes[k])
    return StepWalk(actions=" ".join(map(str, actions)), recv_messages=counts["recv"][0],
                    recv_bytes=counts["recv"][1], send_messages=counts["send"][0], send_bytes=counts["send"][1],
                    in_flight=max_in_flight(actions),
                    planned_in_flight=in_flight(plan.schedule, num_stages, k, num_micro_batches))


def format_report(report: DryRunReport, *, wall_s: float | None = None) -> str:
    """The report as text: groups, memory measured next to planned, the step walked, times."""
    gib = 2 ** 30
    lines = [f"rank {report.rank} of {report.world_size}: stage {report.stage} ({report.layout}), {report.where}",
             f"  groups: {len(report.groups)} of the plan's {report.num_plan_groups} "
             f"({report.num_created} new_group calls here)"]
    for g in report.groups:
        shown = (", ".join(map(str, g.ranks)) if len(g.ranks) <= 8 else
                 f"{', '.join(map(str, g.ranks[:4]))}, ..., {g.ranks[-1]} ({len(g.ranks)} ranks)")
        lines.append(f"    {g.roles:<22} {g.backend:<5} [{shown}]")
    ssd = " (its SSD tier laid out on the host: a dry run writes no swap files)" if "ssd" in report.layout else ""
    lines.append(f"  memory ({report.optimizer}{ssd}), GiB measured / planned:")
    for key in (*STATE_KEYS, "offload"):
        m, p = report.measured[key], report.planned[key]
        ratio = f"{m / p:6.3f}" if p else ("   -  " if not m else "  inf ")
        label = "offload tier (optimizer state)" if key == "offload" else f"device {key}"
        lines.append(f"    {label:<31} {m / gib:9.3f} / {p / gib:9.3f}  x{ratio}")
    lines.append(f"    {'parameter tensors (the shard)':<31} {report.measured['shard'] / gib:9.3f}")
    if report.step_windows:
        lines.append("    (blocks gathered or fetched inside a step are in the planned device params and grads, "
                     "not here: a dry run runs no step)")
    lines.append(f"    {'state, all of it':<31} x{report.state_ratio():.3f}; planned besides: activations "
                 f"{report.planned['activations'] / gib:.3f}, transient {report.planned['transient'] / gib:.3f}")
    w = report.walk
    actions = w.actions if len(w.actions) <= 80 else w.actions[:76] + " ..."
    lines.append(f"  one step ({len(w.actions.split())} actions): {actions}")
    lines.append(f"    receives {w.recv_messages} messages, {w.recv_bytes / 2**20:.1f} MiB; sends {w.send_messages} "
                 f"messages, {w.send_bytes / 2**20:.1f} MiB; in flight {w.in_flight} (planner {w.planned_in_flight})")
    t = report.timings_s
    wall = f"; {wall_s:.1f} s with the process start" if wall_s is not None else ""
    lines.append(f"  time: groups {t['groups']:.2f} s, stage {t['stage']:.2f} s, schedule {t['schedule']:.2f} s, "
                 f"total {t['total']:.2f} s{wall}")
    return "\n".join(lines)
