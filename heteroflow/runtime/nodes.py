"""In a worker a node agent started: which plan rank this process is, joining the world under it, and
whether any node has restarted.

The agent (`heteroflow.launcher.placement`) sets the variables below: elastic numbers ranks node by node
in the order the nodes joined, which is not the plan's order, so the agent names the plan rank of each
local rank.

Pure Python except `join_node_world` and `restarted_anywhere` (collectives).
"""

from __future__ import annotations

import os
from dataclasses import replace

from heteroflow.backends.rankmap import RankMap

ENV_NODE = "HETEROFLOW_NODE"
"""This node's name."""
ENV_NODE_RANKS = "HETEROFLOW_NODE_RANKS"
"""Plan rank of each local rank, comma-separated (`3,0` : local rank 0 is plan rank 3)."""
ENV_VISIBLE = "HETEROFLOW_VISIBLE_DEVICES"
"""The device indices heteroflow put in the vendor's visible-devices variable, in order."""


def assigned_rank() -> int | None:
    """In a worker: this process's plan rank when a node agent started it, else None (elastic's RANK is the
    plan's rank on a single node)."""
    ranks = os.environ.get(ENV_NODE_RANKS)
    if not ranks:
        return None
    return int(ranks.split(",")[int(os.environ["LOCAL_RANK"])])


def join_node_world(rank_map: RankMap, *, timeout_s: float) -> None:
    """In a worker a node agent started: join the gloo world under this process's plan rank (no-op otherwise).

    The store is the one elastic set up for this attempt (MASTER_ADDR:MASTER_PORT, a fresh port each
    rendezvous round), hosted by the worker elastic numbered 0 (which need not be plan rank 0); the launcher
    turns off elastic's shared agent store, whose keys outlive a restart (pytorch/pytorch#135712).
    """
    import datetime

    import torch.distributed as dist
    rank = assigned_rank()
    if rank is None or dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", rank_map.world_size)) != rank_map.world_size:  # the node meeting prevents it
        raise RuntimeError(f"elastic started {os.environ['WORLD_SIZE']} workers in all, the plan has "
                           f"{rank_map.world_size} ranks; every node must run the same job and plan")
    timeout = datetime.timedelta(seconds=timeout_s)
    hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ.get("RANK") == "0"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank_map.world_size,
                          is_master=hosts, timeout=timeout, multi_tenant=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=rank_map.world_size, timeout=timeout)


def node_view(rank_map: RankMap) -> RankMap:
    """In a worker: `rank_map` with this node's device indices renumbered to the visible devices heteroflow
    chose (device 5 is index 1 when `CUDA_VISIBLE_DEVICES=4,5`); unchanged when it chose none."""
    visible = os.environ.get(ENV_VISIBLE)
    node = os.environ.get(ENV_NODE)
    if not visible or not node:
        return rank_map
    position = {int(d): i for i, d in enumerate(visible.split(","))}
    infos = [rank_map.info(r) for r in range(rank_map.world_size)]
    infos = [replace(i, local_device=position[i.local_device]) if i.node == node else i for i in infos]
    return RankMap(rank_map.stages, infos)


def restarted_anywhere(group=None) -> bool:
    """In a worker (collective over `group`): whether any node's agent has restarted its workers.

    An agent counts only its own failures (`TORCHELASTIC_RESTART_COUNT`); the nodes that restart because
    another failed say 0, so the ranks agree through one all-reduce.
    """
    import torch
    import torch.distributed as dist
    flag = torch.tensor([1 if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
