"""The agent's side of stopping on SIGTERM or SIGINT (`heteroflow.runtime.stop` is the workers' side).

While the workers run, the agent (the `heteroflow train` process) handles SIGTERM and SIGINT itself
instead of torch elastic, which would kill the workers at once:

- the first signal writes its number to the stop file the workers look at once per step; they finish
  the step in flight, save a checkpoint and return, and the run ends with exit status 128 + the signal;
- a second signal, or `grace_s` passing after the first (`--stop-grace`, to fit the scheduler's window
  between SIGTERM and SIGKILL), kills the workers at once: `launch` raises `StoppedAtOnce`.

On a multi-node run it is enough that one node's agent gets the signal: its workers' request reaches every
rank through the step's world all-reduce, so every node stops after the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from heteroflow.runtime.stop import STOP_SIGNALS, exit_status, signal_name

DEFAULT_STOP_GRACE_S = 25.0
"""Default of `--stop-grace`: below the 30 s that SLURM (KillWait) and Kubernetes
(terminationGracePeriodSeconds) leave between SIGTERM and SIGKILL by default."""


class Stopped(Exception):
    """A run a signal ended; `exit_status` is 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_status = exit_status(signum)


class StoppedAtOnce(Stopped):
    """The workers were killed: a second signal, or the first one's grace period ran out."""


class StopController:
    """Within `with`: this process's SIGTERM / SIGINT handlers (main thread only; elsewhere it does nothing)."""

    def __init__(self, stop_file: Path, *, grace_s: float = DEFAULT_STOP_GRACE_S):
        self.stop_file = stop_file
        self.grace_s = grace_s
        self.signum = 0
        """The first signal received (0: none)."""
        self.forced = ""
        """Why the workers were killed at once ('' while they were not)."""
        self._saved: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._grace_expired = False
        self._active = True

    def __enter__(self) -> "StopController":
        self.stop_file.unlink(missing_ok=True)
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._saved[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()
        self.stop_file.unlink(missing_ok=True)

    def handle(self, signum: int, _frame) -> None:
        """The handler of SIGTERM and SIGINT: the first asks the ranks to stop, a second kills them."""
        if not self.signum:
            self.signum = signum
            self.stop_file.write_text(str(signum))
            print(f"heteroflow: {signal_name(signum)} received: every rank stops after the step in flight and "
                  f"saves a checkpoint (within --stop-grace {self.grace_s:g} s; a second signal stops at once)",
                  file=sys.stderr, flush=True)
            # No SIGALRM (a test harness's timeout may own it): a timer thread signals this process again.
            self._timer = threading.Timer(self.grace_s, self._grace_over)
            self._timer.daemon = True
            self._timer.start()
            return
        if self._grace_expired:
            self.forced = (f"the ranks did not stop within --stop-grace {self.grace_s:g} s of "
                           f"{signal_name(self.signum)}")
        else:
            self.forced = f"a second {signal_name(signum)}"
        self._kill_workers()

    def _grace_over(self) -> None:
        self._grace_expired = True
        if self._active:
            os.kill(os.getpid(), self.signum)  # handled in the main thread, as a second signal

    def _kill_workers(self) -> None:
        """Make torch elastic's agent kill every worker with SIGKILL (it does so on this exception) and stop."""
        from torch.distributed.elastic.multiprocessing.api import SignalException
        raise SignalException(f"heteroflow: {self.forced}", sigval=signal.SIGKILL)

    def stopped_at_once(self) -> StoppedAtOnce:
        """The error `launch` raises after the workers were killed."""
        return StoppedAtOnce(f"stopped at once after {self.forced}: the step in flight and its checkpoint were "
                             "abandoned", self.signum or signal.SIGTERM)
