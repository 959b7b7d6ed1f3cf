"""Launch one worker process per device through torch.distributed.elastic (torchrun's engine).

The agent starts the workers, watches them, and stops every rank when one fails; we then show the
failing rank's log. Rank 0's output is shown live (the progress bar); every rank's output is kept in
the run's log directory.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from heteroflow.errors import UserError


class TrainingFailed(Exception):
    """A worker failed; the message holds the failing ranks' logs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """How to start the workers of one node."""

    num_processes: int
    """Workers on this node (one per device)."""
    log_dir: str | None = None
    """Where each rank's stdout/stderr go; a temporary directory when None."""
    max_restarts: int = 0
    """Times the agent restarts all workers after a failure."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous; a free local port when None (single node)."""
    threads_per_process: int | None = None
    """torch threads per worker; None splits this machine's cores between the workers."""


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0 by the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(spec: LaunchSpec, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run `entrypoint(*args)` on every rank; return each rank's return value, or raise `TrainingFailed`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if spec.num_processes < 1:
        raise UserError("nothing to launch: the plan uses no devices")
    log_dir = spec.log_dir or tempfile.mkdtemp(prefix="heteroflow-logs-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    threads = spec.threads_per_process or max(1, (os.cpu_count() or 1) // spec.num_processes)
    # Workers inherit the environment: keep many CPU ranks from oversubscribing the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=spec.num_processes, run_id=f"heteroflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=spec.rdzv_endpoint or f"127.0.0.1:{free_port()}",
        max_restarts=spec.max_restarts, monitor_interval=0.1, start_method="spawn", role="heteroflow",
        log_line_prefix_template="[rank ${rank}] ",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee={0: Std.ALL}),
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        raise TrainingFailed(describe_failure(error, log_dir)) from None


def describe_failure(error: Any, log_dir: str) -> str:
    """The first failing rank's error and the tail of its log, plus where every log is."""
    lines = []
    first_rank = min(error.failures)
    for rank, failure in sorted(error.failures.items()):
        lines.append(f"rank {rank} failed (exit code {failure.exitcode})")
    failure = error.failures[first_rank]
    message = failure.message
    if isinstance(message, dict):  # the error file's payload
        message = message.get("message", message)
        if isinstance(message, dict):
            message = message.get("message", "") + "\n" + message.get("extraInfo", {}).get("py_callstack", "")
    if message:
        lines.append(f"--- rank {first_rank} error ---\n{str(message).strip()}")
    for stream in ("stderr", "stdout"):
        tail = _log_tail(log_dir, failure.local_rank, stream)
        if tail:
            lines.append(f"--- rank {first_rank} {stream} (last lines) ---\n{tail}")
    lines.append(f"all rank logs: {log_dir}")
    return "\n".join(lines)


def _log_tail(log_dir: str, local_rank: int, stream: str, num_lines: int = 30) -> str:
    """The last lines of a rank's newest log file, or ''."""
    candidates = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/{stream}.log"), key=os.path.getmtime)
    if not candidates:
        return ""
    text = candidates[-1].read_text(errors="replace").splitlines()
    return "\n".join(text[-num_lines:])
