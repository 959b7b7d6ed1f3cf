"""Node meetings before the elastic rendezvous: who came, under which name, with which job.

Every node agent first joins a *meeting* on the TCP store at `--rdzv HOST:PORT` (the same store torch
elastic's c10d rendezvous then uses; the agent on the machine with that address hosts it). A meeting
decides its roster once, for everyone: the first `expected` nodes to arrive, or, when the first
arrival's deadline passes, those that came by then (the first node to decide writes the roster with
`compare_set`; everybody reads that one). Every node then checks the same roster against the plan
(names, duplicates, missing nodes, plan fingerprints), so a wrong `--node`, a missing node or a
different job file is the same clear error on every node within the join timeout, not a hang.

The replan path uses a second meeting to learn which nodes are still there after a failure.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from heteroflow.errors import UserError, did_you_mean

MEETING_PREFIX = "heteroflow/meeting"


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """What one node agent says when it arrives at a meeting."""

    node: str
    fingerprint: str
    host: str
    pid: int
    problem: str = ""
    """Why this node cannot run its ranks (found before the meeting, so every node hears of it)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "NodeEntry":
        return cls(**json.loads(text))

    @classmethod
    def here(cls, node: str, fingerprint: str, problem: str = "") -> "NodeEntry":
        """This process's entry."""
        return cls(node=node, fingerprint=fingerprint, host=socket.gethostname(), pid=os.getpid(), problem=problem)

    def __str__(self) -> str:
        return f"{self.node!r} (host {self.host}, pid {self.pid})"


def plan_fingerprint(job_dict: dict, **extra: Any) -> str:
    """A short hash of everything the nodes must agree on (the job with its plan, steps, emulation)."""
    text = json.dumps({"job": job_dict, **extra}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_endpoint(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); a `UserError` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv expects HOST:PORT (for example 10.0.0.1:29400), got {text!r}")
    return host.strip("[]"), int(port)


def _is_this_machine(host: str) -> bool:
    """Whether `host` names this machine (then this process may host the store)."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
        return _matches_machine_hostname(host)
    except ImportError:  # an older or newer torch: loopback only
        return host in ("localhost", "127.0.0.1", "::1")


def open_store(host: str, port: int, *, timeout_s: float) -> tuple[Any, bool]:
    """The meeting store at `host:port` and whether this process hosts it.

    On the machine named by `host` the first agent to bind the port hosts it (multi-tenant, so elastic's
    c10d rendezvous in this process shares the server); every other agent connects as a client, retrying
    until `timeout_s`.
    """
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    if _is_this_machine(host):
        try:
            return dist.TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                                 timeout=timeout), True
        except (RuntimeError, ValueError):
            pass  # another agent on this machine hosts it
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout), False
    except (RuntimeError, TimeoutError) as error:
        raise UserError(f"cannot reach the rendezvous at {host}:{port} within {timeout_s:g} s "
                        f"({type(error).__name__}); start the node on the machine with that address, "
                        "and check the address and the firewall") from None


def meet(store: Any, key: str, me: NodeEntry, *, expected: int, timeout_s: float,
         poll_s: float = 0.05) -> tuple[list[NodeEntry], int]:
    """Join meeting `key`; return its roster (the same on every node) and this node's arrival index.

    The roster is the first `expected` arrivals, or fewer if the deadline of whoever decides passed first.
    """
    prefix = f"{MEETING_PREFIX}/{key}"
    index = store.add(f"{prefix}/count", 1) - 1
    store.set(f"{prefix}/node/{index}", me.to_json())
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([f"{prefix}/roster"]):
            roster = store.get(f"{prefix}/roster")
            break
        count = store.add(f"{prefix}/count", 0)
        if count >= expected or time.monotonic() >= deadline:
            proposal = json.dumps([store.get(f"{prefix}/node/{i}").decode() for i in range(min(count, expected))])
            roster = store.compare_set(f"{prefix}/roster", "", proposal)
            break
        time.sleep(poll_s)
    entries = [NodeEntry.from_json(text) for text in json.loads(roster)]
    store.add(f"{prefix}/read", 1)
    return entries, index


def roster_problems(roster: Sequence[NodeEntry], *, plan_nodes: Sequence[str], me: NodeEntry, my_index: int,
                    timeout_s: float) -> list[str]:
    """Why the nodes that met cannot run this plan (empty when they can)."""
    problems = []
    names = [e.node for e in roster]
    for name in dict.fromkeys(names):
        same = [e for e in roster if e.node == name]
        if len(same) > 1:
            where = ", ".join(f"host {e.host} pid {e.pid}" for e in same)
            problems.append(f"node {name!r} joined {len(same)} times ({where}); start one agent per node, each with "
                            "its own --node")
        if name not in plan_nodes:
            problems.append(f"node {name!r} joined, but the plan has no ranks on a node of that name"
                            + did_you_mean(name, plan_nodes) + f"; the plan's nodes are {', '.join(plan_nodes)}")
    for e in roster:
        if e.problem:
            problems.append(f"node {e.node!r} cannot run its ranks: {e.problem}")
    missing = [n for n in plan_nodes if n not in names]
    if missing:
        # a full roster was decided on arrival, a short one at the deadline
        when = f" (the first {len(roster)} to arrive were taken)" if len(roster) >= len(plan_nodes) else \
            f" within {timeout_s:g} s"
        problems.append(f"node{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} of the plan did not "
                        f"join{when}")
    by_print: dict[str, list[str]] = {}
    for e in roster:
        by_print.setdefault(e.fingerprint, []).append(e.node)
    if len(by_print) > 1:
        sides = "; ".join(f"{', '.join(map(repr, nodes))}: job {fp}" for fp, nodes in by_print.items())
        problems.append(f"the nodes disagree on the job ({sides}); run the same job file, --plan, --steps and "
                        "--emulate on every node")
    if my_index >= len(roster):
        problems.append(f"this node ({me}) arrived after the meeting had decided on "
                        f"{', '.join(map(str, roster)) or 'no nodes'}")
    return problems


def check_roster(roster: Sequence[NodeEntry], *, endpoint: str, **kwargs: Any) -> None:
    """Raise a `UserError` naming every problem of the roster (see `roster_problems`)."""
    problems = roster_problems(roster, **kwargs)
    if problems:
        joined = ", ".join(map(str, roster)) or "none"
        raise UserError(f"the nodes that met at {endpoint} do not match the plan:\n"
                        + "\n".join(f"  - {p}" for p in problems) + f"\nnodes that joined: {joined}")
