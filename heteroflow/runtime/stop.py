"""Stopping a run on SIGTERM or SIGINT (preemption, Ctrl-C) without losing the work done.

A worker asks to stop when it gets SIGTERM or SIGINT itself (SLURM signals every process of a job step, a
terminal's Ctrl-C every process of its group) or when its node's agent got one: the agent writes the
signal's number to the file named by `HETEROFLOW_STOP_FILE` (`heteroflow.launcher.signals`), which each
worker looks at once per step. The decision is collective: each rank adds its request to the step's world
all-reduce, so every rank stops after the same step, and then agrees on the signal with one more
all-reduce (`agreed_signal`). A second signal to a worker ends it at once (exit status 128 + the signal).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

ENV_STOP_FILE = "HETEROFLOW_STOP_FILE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by signal `signum`: 128 + its number (143 SIGTERM, 130 SIGINT)."""
    return 128 + signum


def signal_name(signum: int) -> str:
    """`SIGTERM` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """One worker's stop request: its own signal handlers (main thread only) and the agent's stop file."""

    def __init__(self, stop_file: str | None = None):
        self.stop_file = Path(stop_file) if stop_file else None
        self.signum = 0
        """The first stop signal this process got (0: none)."""
        self._saved: dict[int, object] = {}

    @classmethod
    def install(cls) -> "StopRequest":
        """Handle SIGTERM and SIGINT in this process from now on (until `close`) when heteroflow's launcher
        started it (it names the stop file, `HETEROFLOW_STOP_FILE`); elsewhere (a test harness that ends its
        ranks with SIGTERM, a thread that is not the main one) the signals keep their handlers."""
        request = cls(os.environ.get(ENV_STOP_FILE))
        if request.stop_file is not None and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                request._saved[signum] = signal.signal(signum, request._handle)
        return request

    def close(self) -> None:
        """Give the signals back to the handlers that were there before."""
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.signum:  # the second signal: stop now
            sys.stdout.flush()
            os._exit(exit_status(signum))
        self.signum = signum

    def requested(self) -> int:
        """The signal this rank was asked to stop by (its own, else the agent's), or 0."""
        if self.signum:
            return self.signum
        if self.stop_file is not None:
            try:
                text = self.stop_file.read_text().strip()
            except OSError:
                return 0
            return int(text) if text.isdigit() else int(signal.SIGTERM)
        return 0


def agreed_signal(signum: int, group) -> int:
    """The stop signal every rank reports (the largest number any rank of `group` got); collective."""
    value = torch.tensor([signum], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value)
