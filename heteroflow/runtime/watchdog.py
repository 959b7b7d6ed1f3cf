"""A per-rank step watchdog: a step that runs past the limit is reported (rank, node, stage, layout
indices, step, and where the rank is) and the rank exits, so the agent stops the run instead of it
hanging. Collective timeouts alone say neither the stage nor the step, and a rank stuck outside a
collective (a loop, a dead device) never hits one; so collectives get a little longer
(`collective_timeout_s`) and stay the backstop.

Who is to blame comes from heartbeats, not from reading stacks (a rank blocked in a C++ `work.wait()`
shows only the Python frame that called it): with a `ProgressBoard`, each rank publishes its step and a
heartbeat in the c10d store, and every rank past its limit reads the board twice, a few heartbeats apart
(`progress.laggards`). A rank behind the step, or whose heartbeat stopped (frozen by SIGSTOP, dead), is
named, with the ranks that wait for it; only when every rank is in the step with a live heartbeat does a
rank report itself, and one whose stack shows a wait holds that back a little so that the rank it waits
for (stuck computing) is reported first.

Also the fault-injection hook the failure tests use: `HETEROFLOW_INJECT_FAULT=kill@RANK:STEP` kills
plan rank RANK with SIGKILL when it starts step STEP, `hang@RANK:STEP` makes it sleep there,
`freeze@RANK:STEP` stops its process there (SIGSTOP: it can no longer report itself); each only in a
node's first attempt (`TORCHELASTIC_RESTART_COUNT=0`), so a restarted run goes through.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

from heteroflow.runtime.progress import ProgressBoard, laggards, waiting_ranks

ENV_INJECT_FAULT = "HETEROFLOW_INJECT_FAULT"
FAULTS = ("kill", "hang", "freeze")
"""The kinds of `HETEROFLOW_INJECT_FAULT`."""
EXIT_STUCK = 3
"""Exit status of a rank the watchdog stopped."""


def grace_s(limit_s: float) -> float:
    """How much longer than the step limit collectives may wait."""
    return max(5.0, 0.1 * limit_s)


def collective_timeout_s(step_limit_s: float) -> float:
    """The collective timeout that goes with a step limit: the watchdog reports first."""
    return step_limit_s + grace_s(step_limit_s)


class StepWatchdog:
    """Watches one rank's steps from a daemon thread: `begin(step)` at each step, `stop()` at the end."""

    def __init__(self, *, limit_s: float, rank: int, where: str, poll_s: float | None = None,
                 progress: ProgressBoard | None = None):
        self.limit_s = limit_s
        self.rank = rank
        self.where = where
        """`stage 1 (dp 0, tp 1) on node b`: how the report names this rank's place in the plan."""
        self.progress = progress
        """Where every rank's step and heartbeat are (None: the report names this rank only)."""
        self._before: dict | str | None = None  # the first read of the board in a late step (or why it failed)
        self._after: dict | str | None = None  # the latest read
        self._before_at = 0.0
        self._step: int | None = None
        self._started = 0.0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._poll_s = poll_s if poll_s is not None else min(0.25, max(0.05, limit_s / 40))
        self._thread = threading.Thread(target=self._watch, name="heteroflow-step-watchdog", daemon=True)
        self._thread.start()

    def begin(self, step: int) -> None:
        """Step `step` starts now."""
        self._started = time.monotonic()
        self._step = step
        self._before = self._after = None
        if self.progress is not None:
            self.progress.enter(step)
        inject_fault(self.rank, step)

    def stop(self) -> None:
        """No more steps to watch."""
        self._step = None
        self._stop.set()
        if self.progress is not None:
            self.progress.close()

    def report(self, step: int, elapsed_s: float, held_up_by: list[str] | None = None, note: str = "") -> str:
        """The line that names the stuck rank: the ranks in `held_up_by` (phrases from `progress.laggards`)
        when there are any, else this one; `note` is added at the end."""
        limit = f"over the step limit of {self.limit_s:g} s (--timeout)"
        end = f"; {note}" if note else ""
        if held_up_by:
            them = "it" if len(held_up_by) == 1 else "them"
            return (f"heteroflow watchdog: {'; '.join(held_up_by)}; rank {self.rank} ({self.where}) has waited "
                    f"for {them} in step {step} for {elapsed_s:.1f} s, {limit}; it is {self._doing(waiting=True)}"
                    f"{self._also_waiting(step)}{end}")
        return (f"heteroflow watchdog: rank {self.rank} ({self.where}) has been in step {step} for "
                f"{elapsed_s:.1f} s, {limit}; it is {self._doing()}{end}")

    def _read_board(self) -> dict | str:
        """Every other rank's progress, or why it could not be read."""
        try:
            return self.progress.read()
        except (RuntimeError, ValueError) as error:  # the store did not answer within its timeout
            return (f"the other ranks' progress could not be read from the store ({type(error).__name__}); the "
                    "rank hosting it may be the one frozen")

    def _beats_seen(self) -> bool:
        """Whether a live rank has had time for two heartbeats since the board's first read."""
        return self.progress is None or time.monotonic() - self._before_at >= 2.5 * self.progress.beat_s

    def _held_up_by(self, step: int) -> tuple[list[str], str]:
        """The ranks this (waiting) rank waits for, from two reads of the board, and a note when the board
        could not be read."""
        if self.progress is None:
            return [], ""
        after = self._after = self._read_board()
        before = self._before if self._before is not None else after
        for failed in (after, before):
            if isinstance(failed, str):
                return [], failed
        return laggards(before, after, step=step), ""

    def _stack(self) -> list[traceback.FrameSummary]:
        frame = sys._current_frames().get(self._main)
        return traceback.extract_stack(frame) if frame is not None else []

    def _waiting(self) -> bool:
        """Whether the main thread's Python stack shows a collective or point-to-point wait (a wait inside C++
        called from a heteroflow frame does not show: the heartbeats are what names ranks)."""
        stack = self._stack()
        if not stack:
            return False
        innermost = stack[-1]
        return ("torch/distributed" in innermost.filename.replace(os.sep, "/")
                or any(w in innermost.name for w in ("wait", "recv", "all_reduce", "barrier")))

    def _doing(self, *, waiting: bool = False) -> str:
        """Where the main thread is: its innermost frame, then the heteroflow frames that led there; `waiting`:
        the heartbeats show it waits for other ranks, whatever its stack shows."""
        stack = self._stack()
        if not stack:
            return "(main thread not found)"
        innermost, callers = stack[-1], stack[:-1]
        ours = [f for f in callers if "heteroflow" in f.filename.replace(os.sep, "/")]
        path = "".join(f" <- {_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-4:]))
        kind = "waiting for other ranks" if waiting or self._waiting() else "computing or stuck"
        return f"{kind} at {_short(innermost.filename)}:{innermost.lineno} {innermost.name}{path}"

    def _also_waiting(self, step: int) -> str:
        """The other ranks in `step` with a live heartbeat (waiting too), as a clause, or ''."""
        if not isinstance(self._before, dict) or not isinstance(self._after, dict):
            return ""
        ranks = waiting_ranks(self._before, self._after, step=step)
        if not ranks:
            return ""
        them = f"ranks {', '.join(map(str, ranks))} are" if len(ranks) > 1 else f"rank {ranks[0]} is"
        return f"; {them} in step {step} too, waiting"

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            step = self._step
            if step is None:
                continue
            elapsed = time.monotonic() - self._started
            if elapsed <= self.limit_s or self._step != step:
                continue
            if self.progress is not None and self._before is None:
                # heartbeats that stop between this read and the next: frozen ranks
                self._before, self._before_at = self._read_board(), time.monotonic()
            if not self._beats_seen():
                continue
            held_up_by, note = self._held_up_by(step)
            if not held_up_by and self._waiting() and elapsed <= self.limit_s + grace_s(self.limit_s) / 2:
                continue  # every heartbeat is alive: let the rank this one waits for (stuck computing) report first
            self._fail(self.report(step, elapsed, held_up_by, note))

    def _fail(self, report: str) -> None:
        """Print the report, leave it where the elastic agent looks for a rank's error, and exit."""
        print(report, file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            frame = sys._current_frames().get(self._main)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
            payload = {"message": {"message": f"StepTimeout: {report}",
                                   "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump(payload, f)
        sys.stdout.flush()
        os._exit(EXIT_STUCK)  # the main thread may be blocked in C++; nothing else would stop it


def _short(filename: str) -> str:
    """`heteroflow/runtime/pipeline.py` rather than the full path."""
    parts = filename.replace(os.sep, "/").split("/")
    for i, part in enumerate(parts):
        if part == "heteroflow":
            return "/".join(parts[i:])
    return parts[-1]


def parse_fault(text: str) -> tuple[str, int, int]:
    """`kill@3:2` -> ("kill", 3, 2)."""
    try:
        kind, _, at = text.partition("@")
        rank, _, step = at.partition(":")
        if kind not in FAULTS:
            raise ValueError(kind)
        return kind, int(rank), int(step)
    except ValueError:
        raise ValueError(f"{ENV_INJECT_FAULT}={text!r}: expected KIND@RANK:STEP with KIND one of "
                         f"{', '.join(FAULTS)}") from None


def inject_fault(rank: int, step: int) -> None:
    """The test hook (see the module docstring); does nothing unless `HETEROFLOW_INJECT_FAULT` names this
    rank and step and this is the node's first attempt."""
    text = os.environ.get(ENV_INJECT_FAULT)
    if not text or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    kind, fault_rank, fault_step = parse_fault(text)
    if (fault_rank, fault_step) != (rank, step):
        return
    print(f"heteroflow: injected fault: {kind} rank {rank} at step {step}", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # continued (SIGCONT): go on
    while True:
        time.sleep(3600)
