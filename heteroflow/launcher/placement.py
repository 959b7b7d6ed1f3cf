"""Which plan ranks run on which node, and what each node's workers find in their environment.

The node agent (`heteroflow train --node NAME`) starts one worker per device the plan uses on that node.
Local rank i runs on the i-th of those devices in device order (torchrun's convention: local rank =
device), and the agent tells its workers which plan rank each local rank is (`HETEROFLOW_NODE_RANKS`),
because elastic numbers ranks node by node in the order the nodes joined, which is not the plan's order
(a node's ranks need not even be contiguous in the plan). The workers read these variables
(`heteroflow.runtime.nodes`) and join the world under their plan rank.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from heteroflow.backends.rankmap import RankMap
from heteroflow.config import JobConfig, PlanSpec
from heteroflow.devices.facade import visible_devices_variable
from heteroflow.runtime.nodes import ENV_NODE, ENV_NODE_RANKS, ENV_VISIBLE


@dataclass(frozen=True, slots=True)
class NodeRanks:
    """The plan's ranks on one node, in local rank order (by device index)."""

    node: str
    ranks: tuple[int, ...]
    """Plan rank of each local rank."""
    devices: tuple[int, ...]
    """Device index on the node of each local rank (ascending)."""
    vendor: str


def plan_nodes(plan: PlanSpec) -> list[str]:
    """The nodes the plan uses, in the order of their first rank."""
    names: list[str] = []
    for stage in plan.stages:
        for ref in stage.device_refs:
            if ref.node not in names:
                names.append(ref.node)
    return names


def node_ranks(rank_map: RankMap, node: str) -> NodeRanks:
    """The ranks of `rank_map` that run on `node` (none when the plan does not use it)."""
    infos = sorted((rank_map.info(r) for r in range(rank_map.world_size) if rank_map.info(r).node == node),
                   key=lambda info: info.local_device)
    vendor = infos[0].vendor if infos else "cpu"
    return NodeRanks(node=node, ranks=tuple(i.rank for i in infos), devices=tuple(i.local_device for i in infos),
                     vendor=vendor)


def declared_environment(job: JobConfig, nodes: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The cluster YAML's `env` for the workers of `nodes`, all started by one agent (one environment for
    all): each node's variables (cluster, device type, node; the most specific wins). Used for a node of a
    multi-node run and for a single-machine run alike. When an emulated run puts several nodes here and they
    set a variable differently, the first node's value is kept; the second value is one line each saying so."""
    env: dict[str, str] = {}
    setter: dict[str, str] = {}
    conflicts = []
    for node in nodes:
        for name, value in job.cluster.node_env(node).items():
            if name not in env:
                env[name], setter[name] = value, node
            elif env[name] != value:
                conflicts.append(f"cluster env {name}: node {node} sets {value!r}, node {setter[name]} sets "
                                 f"{env[name]!r}; every rank here gets {env[name]!r}")
    return env, conflicts


def node_environment(job: JobConfig, plan: PlanSpec, node: str, *, emulate: bool) -> dict[str, str]:
    """The variables for `node`'s workers: the cluster YAML's `env` (`declared_environment`), heteroflow's
    placement variables, and on real devices the vendor's visible-devices variable when the plan uses only
    some of the node's devices and the YAML does not set it."""
    placement = node_ranks(RankMap.from_plan(plan, job.cluster), node)
    env, _ = declared_environment(job, [node])
    env[ENV_NODE] = node
    env[ENV_NODE_RANKS] = ",".join(map(str, placement.ranks))
    variable = visible_devices_variable(placement.vendor)
    all_devices = tuple(range(job.cluster.node(node).count))
    if not emulate and variable and variable not in env and placement.devices != all_devices:
        env[variable] = env[ENV_VISIBLE] = ",".join(map(str, placement.devices))
    return env
