"""Loading DeepSpeed's JIT-built ops (async_io, cpu_adam) without ever waiting forever.

torch builds an extension under a `lock` file in its build directory and makes every other process
wait, with no time limit, until that file is gone. A build killed half-way (Ctrl-C, a test timeout,
an OOM kill) leaves the file behind, and every later load then hangs. The file names no owner, so the
owner is looked for: ninja and the compilers it runs work in the build directory (their current
directory). A lock with no such process, older than the moment a build needs to start them, was left
by a killed build: it is removed, with a line saying so. A live build is waited for, up to a limit;
past it the op is not used (the caller falls back) and a line says which processes hold it and which
file to remove if they are not a build. Where processes cannot be seen (no /proc), a lock counts as
left behind once it is older than any real build takes.

heteroflow's own processes (the ranks of one node) take turns with a kernel lock (`flock`, released
when its holder dies) around the check and the build, so one never removes the lock of another's build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

STALE_LOCK_S = 20 * 60.0
"""Without /proc: a build lock older than this is taken to be left by a killed build (a real build takes
1-3 minutes on 2 cores)."""
STARTING_S = 30.0
"""With /proc: how long a lock may exist before its build's compilers are seen (torch writes build.ninja and
checks the compiler first)."""
BUILD_TIMEOUT_S = 15 * 60.0
"""How long a load waits for a build in progress (its own turn included) before it gives the op up."""


def _say(line: str) -> None:
    print(f"heteroflow: {line}", file=sys.stderr, flush=True)


def build_lock_path(op_name: str) -> Path | None:
    """The lock file torch's JIT build of extension `op_name` uses, or None where torch does not say."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private, stable since torch 1.x
    except ImportError:
        return None
    try:
        return Path(_get_build_directory(op_name, verbose=False)) / "lock"
    except Exception:  # an unwritable cache directory: torch's own load reports it better
        return None


def build_processes(build_dir: Path) -> list[int] | None:
    """Processes working in `build_dir` (ninja and the compilers run there), or None where that cannot be seen."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    inside, pids = str(build_dir.resolve()), []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone, or not ours to look at
            continue
        if cwd == inside or cwd.startswith(inside + os.sep):
            pids.append(int(entry.name))
    return pids


def clear_stale_lock(lock: Path, *, stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0,
                     starting_s: float = STARTING_S, timeout_s: float = BUILD_TIMEOUT_S,
                     say: Callable[[str], None] = _say) -> str:
    """Return '' once `lock` is gone: released by its build, or removed when its build is gone (see the module
    docstring). Returns why the op is given up instead when a build holds it for more than `timeout_s`."""
    started = time.monotonic()
    told = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return ""
        pids = build_processes(lock.parent)
        if pids is None:
            stale = age >= stale_after_s
        else:
            stale = not pids and age >= min(starting_s, stale_after_s)
        if stale:
            say(f"removed {lock}: a build of this DeepSpeed op, started {age / 60:.1f} minutes ago, was killed before "
                f"it finished (no process is building it); building it again")
            lock.unlink(missing_ok=True)
            return ""
        waited = time.monotonic() - started
        if waited >= timeout_s:
            holders = f" (processes {', '.join(map(str, pids))} work in {lock.parent})" if pids else ""
            return (f"the build lock {lock} has been held for {age / 60:.1f} minutes{holders}; not waiting longer "
                    f"than {timeout_s:g} s. If no build is running, delete that file")
        if pids and not told:
            say(f"waiting for a build of this DeepSpeed op in progress (processes {', '.join(map(str, pids))}, "
                f"lock {lock}; at most {timeout_s:g} s)")
            told = True
        time.sleep(max(0.01, min(poll_s, timeout_s - waited)))


@contextlib.contextmanager
def build_turn(build_dir: Path, *, timeout_s: float = BUILD_TIMEOUT_S, poll_s: float = 1.0) -> Iterator[str]:
    """Hold heteroflow's turn to check and build in `build_dir` (an `flock`: free again when its holder dies);
    yields '' with the turn, or why it was not had within `timeout_s` (without it)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / "heteroflow-turn", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, told = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    _say(f"waiting for another heteroflow process building in {build_dir} (at most {timeout_s:g} s)")
                    told = True
                if time.monotonic() >= deadline:
                    yield (f"another heteroflow process has been building in {build_dir} for more than "
                           f"{timeout_s:g} s")
                    return
                time.sleep(poll_s)
        try:
            yield ""
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def load_deepspeed_op(builder_name: str, *, missing_hint: str = "",
                      timeout_s: float = BUILD_TIMEOUT_S) -> tuple[Any, str]:
    """DeepSpeed op `builder_name` (e.g. `AsyncIOBuilder`) loaded, building it the first time.

    Returns `(module, "")`, or `(None, why)` when it is not compatible with this machine, fails to build
    (`missing_hint` says what to install) or is held by a build for more than `timeout_s`; never raises,
    never waits on a lock left by a killed build.
    """
    try:
        from deepspeed.ops import op_builder

        builder = getattr(op_builder, builder_name)()
        if not builder.is_compatible(verbose=False):
            return None, f"DeepSpeed {builder.name} is not compatible with this machine{missing_hint}"
        lock = build_lock_path(builder.name)
        if lock is None:
            return builder.load(verbose=False), ""
        with build_turn(lock.parent, timeout_s=timeout_s) as busy:
            why = busy or clear_stale_lock(lock, timeout_s=timeout_s)
            if why:
                _say(f"DeepSpeed {builder.name} not used: {why}")
                return None, f"DeepSpeed {builder.name} not used: {why}"
            return builder.load(verbose=False), ""
    except Exception as exc:  # any build or import failure means: use the fallback
        return None, f"DeepSpeed {builder_name} failed to build or load: {type(exc).__name__}: {exc}"[:300]
