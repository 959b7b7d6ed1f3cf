"""Loading DeepSpeed's JIT-built ops (async_io, cpu_adam) without ever waiting forever.

torch builds an extension under a `lock` file in its build directory and makes every other process
wait, with no time limit, until that file is gone. A build killed half-way (Ctrl-C, a test timeout,
an OOM kill) leaves the file behind, and every later load then hangs. A build takes 1-3 minutes on
2 cores, so a lock much older than that was left by a dead build: it is removed, with a warning.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("heteroflow.offload")

STALE_LOCK_S = 20 * 60.0
"""A build lock older than this is taken to be left by a killed build (a real build takes minutes)."""


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


def clear_stale_lock(lock: Path, *, stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> None:
    """Wait while `lock` is younger than `stale_after_s` (a build in progress); remove it once it is older."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= stale_after_s:
            log.warning("removing %s, a build lock %.0f minutes old: a build of this DeepSpeed op was killed "
                        "before it finished", lock, age / 60)
            lock.unlink(missing_ok=True)
            return
        time.sleep(min(poll_s, stale_after_s - age))


def load_deepspeed_op(builder_name: str, *, missing_hint: str = "",
                      stale_after_s: float = STALE_LOCK_S) -> tuple[Any, str]:
    """DeepSpeed op `builder_name` (e.g. `AsyncIOBuilder`) loaded, building it the first time.

    Returns `(module, "")`, or `(None, why)` when it is not compatible with this machine or fails to
    build (`missing_hint` says what to install); never raises, never waits on a lock left by a killed build.
    """
    try:
        from deepspeed.ops import op_builder

        builder = getattr(op_builder, builder_name)()
        if not builder.is_compatible(verbose=False):
            return None, f"DeepSpeed {builder.name} is not compatible with this machine{missing_hint}"
        lock = build_lock_path(builder.name)
        if lock is not None:
            clear_stale_lock(lock, stale_after_s=stale_after_s)
        return builder.load(verbose=False), ""
    except Exception as exc:  # any build or import failure means: use the fallback
        return None, f"DeepSpeed {builder_name} failed to build or load: {type(exc).__name__}: {exc}"[:300]

