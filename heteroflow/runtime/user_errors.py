"""How a worker's user error reaches the user: as one clear message and exit 2, not as elastic's tracebacks.

A worker that raises a `UserError` (a missing `init_from` file, a read-only swap directory, damaged state,
a diverged run) writes its message to `<error dir>/rank-<r>.txt` before it fails; the launcher, seeing the
run fail, reads those files (`read_user_errors`) and raises the first one as a `UserError` of its own. The
directory is the run's log directory, passed to the workers in `ENV_ERROR_DIR`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from heteroflow.errors import UserError

ENV_ERROR_DIR = "HETEROFLOW_USER_ERROR_DIR"
_SUBDIR = "user-errors"
_NAME = re.compile(r"^rank-(\d+)\.txt$")


class TrainingDiverged(UserError):
    """The loss or the gradient norm stopped being finite; the step that saw it was not applied."""


def error_dir(log_dir: str | os.PathLike) -> Path:
    """Where the workers of a run whose logs go to `log_dir` write their user errors."""
    return Path(log_dir) / _SUBDIR


def record_user_error(error: UserError, rank: int) -> None:
    """Leave `error`'s message for the launcher (a no-op outside a launched run)."""
    root = os.environ.get(ENV_ERROR_DIR)
    if not root:
        return
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".rank-{rank}.txt.tmp"
    tmp.write_text(str(error), encoding="utf-8")
    os.replace(tmp, path / f"rank-{rank}.txt")  # whole or absent: the launcher never reads half a message


def clear_user_error(rank: int) -> None:
    """Drop what this rank left in an earlier attempt of the run (an elastic restart), so that the launcher
    reports only errors of the attempt that failed last."""
    root = os.environ.get(ENV_ERROR_DIR)
    if root:
        (Path(root) / f"rank-{rank}.txt").unlink(missing_ok=True)


def read_user_errors(root: str | os.PathLike) -> list[tuple[int, str]]:
    """`(rank, message)` of every user error the workers left in `root`, by rank."""
    found = []
    path = Path(root)
    if not path.is_dir():
        return found
    for entry in path.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match[1]), entry.read_text(encoding="utf-8", errors="replace").strip()))
    return sorted(found)


def user_error_message(errors: list[tuple[int, str]]) -> str:
    """One message for the user: the first rank's error; the other ranks only where they say something else."""
    first_rank, first = errors[0]
    more = len(errors) - 1
    where = f"rank {first_rank}" + (f" and {more} more rank{'s' * (more > 1)}" if more else "")
    others = sorted({message for _, message in errors[1:] if message != first})
    return "\n".join([f"{first} ({where})"] + [f"also: {message}" for message in others[:3]])
