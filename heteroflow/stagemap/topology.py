"""Collective bandwidth inside a node whose devices are not all linked alike (`config.NodeTopology`).

A ring collective over a group of a node's devices (a stage's tp, cp or dp group) moves, per rank, at most
what the links among the group carry across any cut of it: every ring crosses every cut once each way, and
the rings a collective library builds over the group add up to at most the cut's links (NCCL and HCCL build
several rings, one per link). So the group's bandwidth is the minimum cut of its link graph (Stoer-Wagner),
times one link's bandwidth; a group that its links leave apart talks through the host (the device's host
link). It never exceeds the device type's `intra_node_gb_per_s`. A stage's axis is as fast as its slowest
group; the cost model scales the axis's collective bandwidth by `axis_fraction` (1.0 without a topology, or
for groups that span nodes, which the network prices).

The planner prices a slice of a node (`placement=None`) as its slowest slice of that size, so that any
slice it picks costs at most what it predicted; `plan --evaluate` prices the devices a plan names.
"""

from __future__ import annotations

from functools import lru_cache

from heteroflow.config.topology import NodeTopology
from heteroflow.layout import ParallelLayout

Placement = tuple[tuple[int, int], ...]
"""(node ordinal within the stage, device index on that node) of each stage-local rank."""


def min_cut_links(links: tuple[tuple[int, ...], ...], members: tuple[int, ...]) -> int:
    """The least number of links across any cut of `members` (Stoer-Wagner on their link counts); 0 when some
    of them have no path of links to the others."""
    weights = [[links[i][j] for j in members] for i in members]
    vertices = list(range(len(members)))
    best = None
    while len(vertices) > 1:
        added, gains = [vertices[0]], {v: weights[vertices[0]][v] for v in vertices[1:]}
        while gains:
            last = max(gains, key=gains.get)
            cut = gains.pop(last)
            added.append(last)
            for v in gains:
                gains[v] += weights[last][v]
        s, t = added[-2], added[-1]
        best = cut if best is None else min(best, cut)
        for v in vertices:  # merge t into s
            weights[s][v] += weights[t][v]
            weights[v][s] = weights[s][v]
        vertices.remove(t)
    return best or 0


@lru_cache(maxsize=4096)
def group_gb_per_s(topology: NodeTopology, members: tuple[int, ...], *, host_gb_per_s: float,
                   device_gb_per_s: float) -> float:
    """Per-rank bandwidth of a ring collective over devices `members` of one node (see the module docstring)."""
    if len(members) < 2:
        return device_gb_per_s
    cut = min_cut_links(topology.links, members)
    return min(device_gb_per_s, cut * topology.link_gb_per_s if cut else host_gb_per_s)


def axis_fraction(topology: NodeTopology | None, layout: ParallelLayout, axis: str, placement: Placement, *,
                  host_gb_per_s: float, device_gb_per_s: float) -> float:
    """The slowest of the stage's `axis` groups inside one node, as a fraction of `device_gb_per_s`."""
    if topology is None:
        return 1.0
    slowest = device_gb_per_s
    for group in layout.axis_groups(axis):
        nodes = {placement[r][0] for r in group}
        devices = tuple(sorted(placement[r][1] for r in group))
        if len(nodes) == 1 and devices[-1] < topology.num_devices:
            slowest = min(slowest, group_gb_per_s(topology, devices, host_gb_per_s=host_gb_per_s,
                                                  device_gb_per_s=device_gb_per_s))
    return slowest / device_gb_per_s


def slices(num_devices: int, node_count: int) -> list[Placement]:
    """Where the planner may put a stage of `num_devices` devices: each slice of a node of `node_count` devices,
    or whole nodes."""
    if num_devices < node_count:
        return [tuple((0, first + i) for i in range(num_devices))
                for first in range(0, node_count - num_devices + 1, num_devices)]
    return [tuple((n, i) for n in range(num_devices // node_count) for i in range(node_count))]


def stage_fractions(topology: NodeTopology | None, layout: ParallelLayout, placements: list[Placement], *,
                    host_gb_per_s: float, device_gb_per_s: float) -> tuple[float, float, float]:
    """(tp, cp, dp) fractions of the stage's collective bandwidth: of its placement, or of the slowest of
    `placements` (the planner's candidate slices)."""
    if topology is None:
        return 1.0, 1.0, 1.0
    return tuple(min(axis_fraction(topology, layout, axis, p, host_gb_per_s=host_gb_per_s,
                                   device_gb_per_s=device_gb_per_s) for p in placements)
                 for axis in ("tp", "cp", "dp"))
