"""Run a function on N local ranks joined in one torch.distributed world, for tests and benchmarks.

    results = run_ranks(check_remap, 4, shape=(4, 8, 16), timeout_s=60)

- Ranks are fresh processes that inherit nothing from the parent (no threads, no CUDA state, no
  test state), one CPU thread each unless told otherwise. The default start method is `forkserver`
  with torch preloaded in the server: each rank forks from a clean single-threaded process that has
  imported torch once, which starts 8 ranks in about a second where `spawn` (each rank imports
  torch itself) takes 10-40 s on a busy 2-core machine. `start_method="spawn"` is there for code that
  must not share even the import. `fn(rank, world_size, *args, **kwargs)` must be importable by
  name (a module-level function) and its return value picklable; `run_ranks` returns them by rank.
- The rendezvous store lives in the parent and binds port 0, so the kernel picks a free port and
  nothing races for it: no fixed ports, no retries.
- Fail fast: as soon as one rank fails, the others are stopped and `MultiprocError` is raised with
  every rank's exit status, output and traceback. The same on timeout, naming the ranks still running.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

OUTPUT_TAIL_CHARS = 6000
"""How much of each rank's output an error shows (the end, where tracebacks are)."""


class MultiprocError(RuntimeError):
    """A rank failed or the run timed out; the message holds every rank's status and output."""

    def __init__(self, summary: str, outputs: dict[int, str]):
        self.summary, self.outputs = summary, outputs
        parts = [summary]
        for rank, text in sorted(outputs.items()):
            parts.append(f"---- rank {rank} output ----\n{text.rstrip() or '(no output)'}")
        super().__init__("\n".join(parts))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, backend: str = "gloo",
              threads_per_rank: int = 1, env: dict[str, str] | None = None, start_method: str = "forkserver",
              **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh ranks; their results by rank.

    `timeout_s` covers the whole run, start-up included.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r} (fork would copy "
                         "the parent's threads and state)")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])  # no effect once the server runs
    with tempfile.TemporaryDirectory(prefix="heteroflow-ranks-") as tmp:
        logs = [Path(tmp, f"rank{r}.log") for r in range(world_size)]
        results = [Path(tmp, f"rank{r}.pkl") for r in range(world_size)]
        config = dict(port=store.port, backend=backend, threads=threads_per_rank, env=env or {},
                      timeout_s=timeout_s)
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, config, str(logs[r]), str(results[r]),
                                                      args, kwargs), daemon=True, name=f"rank{r}")
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            _watch(procs, logs, timeout_s)
        finally:
            _stop(procs)
        return [pickle.loads(path.read_bytes()) for path in results]


def _watch(procs: list, logs: list[Path], timeout_s: float) -> None:
    """Wait for every rank; on the first failure or at the deadline, raise with all outputs."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _stop(procs)
            # Every rank already down is named: a rank that failed only because a peer died (its
            # collective broke) may have exited before the harness looked, as well as the peer.
            failures = "; ".join(f"rank {r} failed (exit code {codes[r]})" for r in failed)
            raise MultiprocError(f"{failures}; stopped the other ranks. " + _status(procs), _outputs(logs))
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            _stop(procs)
            raise MultiprocError(f"timed out after {timeout_s:g} s with ranks {running} still running; "
                                 + _status(procs), _outputs(logs))
        time.sleep(0.02)


def _status(procs: list) -> str:
    return "exit codes: " + ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs))


def _outputs(logs: list[Path]) -> dict[int, str]:
    out = {}
    for rank, path in enumerate(logs):
        text = path.read_text(errors="replace") if path.exists() else ""
        out[rank] = text if len(text) <= OUTPUT_TAIL_CHARS else "...\n" + text[-OUTPUT_TAIL_CHARS:]
    return out


def _stop(procs: list) -> None:
    """Terminate ranks still running (only the processes this run started), then reap them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, config: dict, log: str, result: str,
               args: tuple, kwargs: dict) -> None:
    """Entry point of one rank: route output to its log, join the world, run `fn`, save the result."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # file descriptors, so output of C++ (gloo, torch) is captured too
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.update({"OMP_NUM_THREADS": str(config["threads"]), **config["env"]})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(config["threads"])
        timeout = datetime.timedelta(seconds=config["timeout_s"])
        store = dist.TCPStore("127.0.0.1", config["port"], None, False, timeout=timeout)
        dist.init_process_group(config["backend"], store=store, rank=rank, world_size=world_size, timeout=timeout)
        value = fn(rank, world_size, *args, **kwargs)
        Path(result).write_bytes(pickle.dumps(value))
        # Only on success (a failed rank exits at once instead), and together, as the worker ends: on torch 2.4
        # a gloo rank destroying its group after its peer's process is gone waits forever.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that could block on a broken world
    sys.stdout.flush()
    sys.stderr.flush()
