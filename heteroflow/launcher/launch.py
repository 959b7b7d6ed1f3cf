"""Launch one worker process per device through torch.distributed.elastic (torchrun's engine).

The agent starts the workers, watches them, and stops every rank when one fails (restarting them up to
`max_restarts` times); we then show the failing ranks' logs. Rank 0's output is shown live (the
progress bar); every rank's output is kept in the run's log directory.

One node or several: with `num_nodes > 1` every node runs `launch` with its own `num_processes` (torch
elastic allows a different count per node) and the same `run_id` and `rdzv_endpoint`. Elastic numbers
workers by node rank (the order nodes joined) then local rank, which need not be the plan's order, so
`rank_order` names the plan rank of each local rank; the workers read it from the environment
(`heteroflow.runtime.nodes`) and results and failures are reported by plan rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

from heteroflow.errors import UserError
from heteroflow.launcher.signals import DEFAULT_STOP_GRACE_S, StopController
from heteroflow.runtime.stop import ENV_STOP_FILE
from heteroflow.runtime.user_errors import ENV_ERROR_DIR, error_dir, read_user_errors, user_error_message
from heteroflow.stagemap.hardware import threads_per_process


LOG_DIR_PREFIX = "heteroflow-logs-"
"""Prefix of the temporary log directory of a launch without `log_dir`."""


class TrainingFailed(Exception):
    """A worker failed; the message holds the failing ranks' logs."""


class RendezvousFailed(TrainingFailed):
    """The nodes did not (re)join the elastic rendezvous in time, or its store went away."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """How to start the workers of one node."""

    num_processes: int
    """Workers on this node (one per device)."""
    log_dir: str | None = None
    """Where each rank's stdout/stderr go; when None, a temporary directory, removed after a success and kept
    after a failure (the failure's message names it)."""
    max_restarts: int = 0
    """Times the agent restarts all workers after a failure."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous; a free local port when None (single node)."""
    threads_per_process: int | None = None
    """torch threads per worker; None splits this machine's cores between the workers (the rule the planner
    prices emulated runs with: `stagemap.hardware.threads_per_process`)."""
    num_nodes: int = 1
    """Nodes in the run (min = max: a fixed set); every node launches its own workers."""
    run_id: str | None = None
    """Shared by every node of one run; a fresh one when None (single node)."""
    join_timeout_s: float = 600.0
    """How long the agents wait for every node at the elastic rendezvous (first and after a restart)."""
    local_addr: str | None = None
    """This node's address for the agent's store and the workers (the cluster YAML's `host`)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set for the workers (the agent's environment is restored afterwards)."""
    rank_order: tuple[int, ...] | None = None
    """Plan rank of each local rank; None when elastic's numbering is the plan's (one node)."""
    tee_local_rank: int | None = 0
    """The local rank whose output is also shown live; None shows none."""
    stop_grace_s: float = DEFAULT_STOP_GRACE_S
    """After a SIGTERM or SIGINT, how long the ranks have to finish their step and save before they are killed
    (`heteroflow.launcher.signals`)."""


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0 by the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def aware_rendezvous_clock(rendezvous: ModuleType) -> None:
    """Stamp torch elastic's rendezvous heartbeats and deadlines in timezone-aware UTC on a torch that stamps
    them naive (`datetime.utcnow()`, torch before 2.6), so nodes running torch on both sides of 2.6 can meet.

    The nodes share one rendezvous state, pickled into the store; torch 2.6 and later compare its stamps with
    `datetime.now(timezone.utc)`, and an aware stamp compared with a naive one raises TypeError in every agent.
    `rendezvous` is `torch.distributed.elastic.rendezvous.dynamic_rendezvous`; a torch already aware is left as
    it is.
    """
    if "utcnow()" not in inspect.getsource(rendezvous) or rendezvous.datetime is _AwareUTC:
        return
    rendezvous.datetime = _AwareUTC


class _AwareUTC(datetime.datetime):
    """`datetime` whose `utcnow()` is aware, as torch 2.6+ stamps (the rest is `datetime`'s own)."""

    @classmethod
    def utcnow(cls) -> datetime.datetime:  # type: ignore[override]
        return datetime.datetime.now(datetime.timezone.utc)


_OUR_SIGNALS = "SIGHUP,SIGQUIT"
"""The signals torch elastic's agent still turns into an exception; SIGTERM and SIGINT are `StopController`'s."""


def elastic_signal_options(config_type: type) -> dict[str, Any]:
    """`LaunchConfig` options that leave SIGTERM and SIGINT to `StopController`, where this torch has them (an
    older agent installs its own handlers when it starts the workers: see `elastic_stop_handlers`)."""
    fields = {f.name for f in dataclasses.fields(config_type)}
    if "signals_to_handle" not in fields:
        return {}
    # The workers handle SIGTERM too, so elastic's own SIGTERM to the others after a failure may be held up by a
    # rank blocked in a collective: it is followed by SIGKILL after a few seconds.
    return {"signals_to_handle": _OUR_SIGNALS, **({"shutdown_timeout": 5} if "shutdown_timeout" in fields else {})}


@contextlib.contextmanager
def elastic_stop_handlers(processes_api: ModuleType, stop: StopController, *, needed: bool) -> Iterator[None]:
    """On a torch whose agent takes every signal (`signal.signal(SIGTERM, _terminate_process_handler)` each time
    it starts workers, torch before `signals_to_handle`), route SIGTERM and SIGINT to `stop` while inside.

    `processes_api` is `torch.distributed.elastic.multiprocessing.api`; the agent looks its handler up by name
    when it installs it, so replacing the name is enough. `needed`: False leaves torch as it is.
    """
    if not needed:
        yield
        return
    own = processes_api._terminate_process_handler

    def handler(signum: int, frame: Any) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            stop.handle(signum, frame)
        else:
            own(signum, frame)

    processes_api._terminate_process_handler = handler
    try:
        yield
    finally:
        processes_api._terminate_process_handler = own


def launch(spec: LaunchSpec, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run `entrypoint(*args)` on every local rank; return each rank's return value by plan rank, or raise
    `TrainingFailed` (`RendezvousFailed` when the nodes could not meet)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing import api as processes_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if spec.num_processes < 1:
        raise UserError("nothing to launch: the plan uses no devices")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    aware_rendezvous_clock(dynamic_rendezvous)
    temporary = spec.log_dir is None  # ours to remove after a success; kept (and named) after a failure
    log_dir = spec.log_dir or tempfile.mkdtemp(prefix=LOG_DIR_PREFIX)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    threads = spec.threads_per_process or threads_per_process(os.cpu_count() or 1, spec.num_processes)
    tee = {} if spec.tee_local_rank is None else {spec.tee_local_rank: Std.ALL}
    timeout = max(1, int(spec.join_timeout_s))
    signal_options = elastic_signal_options(LaunchConfig)  # empty on a torch whose agent takes every signal
    config = LaunchConfig(
        min_nodes=spec.num_nodes, max_nodes=spec.num_nodes, nproc_per_node=spec.num_processes,
        run_id=spec.run_id or f"heteroflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=spec.rdzv_endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": timeout, "read_timeout": timeout, "close_timeout": min(timeout, 30)},
        rdzv_timeout=timeout, local_addr=spec.local_addr,
        max_restarts=spec.max_restarts, monitor_interval=0.1, start_method="spawn", role="heteroflow",
        log_line_prefix_template="[rank ${rank}] " if spec.rank_order is None else "[local rank ${local_rank}] ",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=tee),
        # SIGTERM and SIGINT are ours (`StopController`): the ranks stop after a step instead of at once.
        **signal_options,
    )
    order = spec.rank_order
    # Workers inherit the environment: keep many CPU ranks from oversubscribing the cores. Elastic's shared
    # agent store keeps the keys of a failed attempt, which the restarted workers then read
    # (pytorch/pytorch#135712): use a fresh store per rendezvous round, hosted by worker 0.
    stop_file = Path(log_dir) / f"stop-{os.getpid()}"
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", ENV_ERROR_DIR: str(error_dir(log_dir)),
           ENV_STOP_FILE: str(stop_file), **spec.env}
    with worker_environment(env), quiet_elastic_logs(), StopController(stop_file, grace_s=spec.stop_grace_s) as stop, \
            elastic_stop_handlers(processes_api, stop, needed=not signal_options):
        try:
            results = elastic_launch(config, entrypoint)(*args)
        except SignalException:
            if not stop.forced:
                raise
            print(f"heteroflow: all rank logs: {log_dir}", file=sys.stderr, flush=True)
            raise stop.stopped_at_once() from None
        except ChildFailedError as error:
            if stop.forced:  # a rank that got the second signal itself may end before the agent acts on its own
                raise stop.stopped_at_once() from None
            user_errors = read_user_errors(error_dir(log_dir))
            if user_errors:  # something the user can fix: one clear message, not the workers' tracebacks
                raise UserError(f"{user_error_message(user_errors)}\n(all rank logs: {log_dir})") from None
            raise TrainingFailed(describe_failure(error, log_dir, rank_order=order)) from None
        except RendezvousError as error:
            raise RendezvousFailed(f"the nodes did not meet at {config.rdzv_endpoint} within {timeout} s "
                                   f"({type(error).__name__}: {error}); all rank logs: {log_dir}") from None
        except BaseException:  # interrupted (Ctrl-C, a signal to the agent) or an error of the agent itself
            print(f"heteroflow: all rank logs: {log_dir}", file=sys.stderr, flush=True)
            raise
    if temporary:
        shutil.rmtree(log_dir, ignore_errors=True)
    if order is None:
        return results
    # elastic's global ranks of this node are consecutive, in local rank order
    return {order[i]: value for i, (_, value) in enumerate(sorted(results.items()))}


@contextlib.contextmanager
def worker_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set `env` in this process (the workers inherit it) and restore the previous values afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def quiet_elastic_logs() -> Iterator[None]:
    """Keep torch elastic's own log records (a failed worker's traceback, "terminating process") off the
    user's terminal: the launcher reports failures itself, from the workers' error files and logs, which
    stay in the run's log directory. `LOGLEVEL` set by the user (elastic's own switch) keeps them."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(prefixes)]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def describe_failure(error: Any, log_dir: str, *, rank_order: tuple[int, ...] | None = None) -> str:
    """Each failing rank's error line, the first one's error and log tail, and where every log is.

    `rank_order` translates local ranks to plan ranks (multi-node); elastic's own numbering otherwise.
    """
    def plan_rank(rank: int, failure: Any) -> int:
        return rank if rank_order is None else rank_order[failure.local_rank]

    failures = sorted((plan_rank(rank, f), f) for rank, f in error.failures.items())
    lines = []
    for rank, failure in failures:
        first_line = _message(failure).strip().splitlines()[:1]
        suffix = f": {first_line[0]}" if first_line else ""
        lines.append(f"rank {rank} failed (exit code {failure.exitcode}){suffix}")
    first_rank, failure = failures[0]
    message = _message(failure)
    if message:
        lines.append(f"--- rank {first_rank} error ---\n{message.strip()}")
    for stream in ("stderr", "stdout"):
        tail = _log_tail(log_dir, failure.local_rank, stream)
        if tail:
            lines.append(f"--- rank {first_rank} {stream} (last lines) ---\n{tail}")
    lines.append(f"all rank logs: {log_dir}")
    return "\n".join(lines)


def _message(failure: Any) -> str:
    """A failure's error text: the error file's message (and Python stack), or ''."""
    message = failure.message
    if isinstance(message, dict):  # the error file's payload
        message = message.get("message", message)
        if isinstance(message, dict):
            message = message.get("message", "") + "\n" + message.get("extraInfo", {}).get("py_callstack", "")
    return str(message or "")


def _log_tail(log_dir: str, local_rank: int, stream: str, num_lines: int = 30) -> str:
    """The last lines of a rank's newest log file, or ''."""
    candidates = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/{stream}.log"), key=os.path.getmtime)
    if not candidates:
        return ""
    text = candidates[-1].read_text(errors="replace").splitlines()
    return "\n".join(text[-num_lines:])
