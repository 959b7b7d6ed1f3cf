"""Run `heteroflow train --node X --rdzv 127.0.0.1:PORT --emulate` as separate processes ("nodes") on this
machine, each in its own session so a test can kill a whole node, with bounded waits and every node's
output in the failure message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from conftest import REPO

CLUSTER = {"nodes": [{"name": "a", "device": "nvidia-a100-80g", "count": 2, "host": "127.0.0.1"},
                     {"name": "b", "device": "ascend-910b2", "count": 2, "host": "127.0.0.1"}]}
MODEL = {"preset": "micro-llama"}
TRAIN = {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "steps": 3, "lr": 3e-3, "min_lr": 3e-4,
         "warmup_steps": 1}
# Node a holds ranks 0 and 3, node b ranks 1 and 2: a node's ranks are not contiguous in the plan's order.
SANDWICH_PLAN = {"micro_batch_size": 2, "stages": [{"devices": ["a:0"], "layers": 1},
                                                   {"devices": ["b"], "layers": 2, "dp": 2},
                                                   {"devices": ["a:1"], "layers": 1}]}


def job_dict(plan: dict = SANDWICH_PLAN, cluster: dict = CLUSTER, **train) -> dict:
    return {"cluster": cluster, "model": MODEL, "train": {**TRAIN, **train}, "plan": plan}


def write_job(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Node:
    """One `heteroflow train --node` process."""

    name: str
    proc: subprocess.Popen
    log: Path
    started: float

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """Kill the node: its agent and every worker (the whole session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_node(tmp: Path, job: Path, name: str, port: int, *extra: str, env: dict | None = None) -> Node:
    """Start node `name`; output goes to tmp/NAME.out."""
    log = tmp / f"{name}.out"
    cmd = [sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", "--node", name, "--rdzv",
           f"127.0.0.1:{port}", "--log-dir", str(tmp / "logs"), *extra]
    full_env = {**os.environ, "HETEROFLOW_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Node(name=name, proc=proc, log=log, started=time.monotonic())


def start_nodes(tmp: Path, job: Path, names: list[str], port: int, *extra: str,
                env: dict[str, dict] | None = None) -> list[Node]:
    """Start the nodes, the first one (which hosts the rendezvous) before the others."""
    env = env or {}
    first = start_node(tmp, job, names[0], port, *extra, env=env.get(names[0]))
    deadline = time.monotonic() + 120
    while not listening(port) and first.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return [first] + [start_node(tmp, job, n, port, *extra, env=env.get(n)) for n in names[1:]]


def wait_nodes(nodes: list[Node], timeout_s: float) -> dict[str, int]:
    """Every node's exit status; kills them all and fails with their output when one outlives the timeout."""
    deadline = time.monotonic() + timeout_s
    codes = {}
    try:
        for node in nodes:
            codes[node.name] = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        raise AssertionError(f"nodes still running after {timeout_s} s\n" + outputs(nodes)) from None
    return codes


def outputs(nodes: list[Node]) -> str:
    """Every node's output, for failure messages."""
    return "\n".join(f"---- node {n.name} ----\n{n.output()[-6000:]}" for n in nodes)


def stop_all(nodes: list[Node]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.kill()
            node.proc.wait(timeout=30)
