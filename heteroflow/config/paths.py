"""Output paths checked before any work starts, so that a command never plans or trains for hours and then
fails to write its result (or fails inside a worker).

Each output is named by its flag or job path (`--metrics`, `train.checkpoint.dir`) and has one of four kinds:
a file whose directory must exist (`plan -o`), a file whose missing directories the command creates
(`--metrics`), a directory the command creates when missing (`--log-dir`, `train.checkpoint.dir`), or a
directory that must exist (`profile --disk-dir`). Every problem is reported at once, as `NAME: message`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from heteroflow.errors import ConfigError, Problem

if TYPE_CHECKING:
    from heteroflow.config.job import JobConfig

FILE = "file"
"""A file written in an existing directory."""
FILE_IN_NEW_DIR = "file in new dir"
"""A file whose missing parent directories the command creates."""
DIR = "dir"
"""A directory, created (with its parents) when missing."""
EXISTING_DIR = "existing dir"
"""A directory that must already exist."""


@dataclass(frozen=True, slots=True)
class Output:
    """One path a command will write: `name` is how the user gave it (a flag or a job path)."""

    name: str
    path: str | os.PathLike | None
    kind: str = FILE


def _writable_dir(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


def _creatable(path: Path) -> str | None:
    """Why directory `path` (missing) cannot be created, or None."""
    ancestor = next((p for p in path.parents if p.exists()), None)
    if ancestor is None or not ancestor.is_dir():
        return f"cannot create it: {str(ancestor)!r} is not a directory"
    if not _writable_dir(ancestor):
        return f"cannot create it: directory {str(ancestor)!r} is not writable"
    return None


def output_problem(output: Output) -> str | None:
    """What is wrong with writing `output`, or None when it can be written (as far as can be told now)."""
    path = Path(os.path.expanduser(str(output.path)))
    shown = repr(str(output.path))
    if output.kind in (DIR, EXISTING_DIR):
        if path.is_dir():
            return None if _writable_dir(path) else f"directory {shown} is not writable"
        if path.exists():
            return f"{shown} is a file, not a directory; name a directory"
        if output.kind == EXISTING_DIR:
            return f"directory {shown} does not exist"
        problem = _creatable(path)
        return None if problem is None else f"directory {shown}: {problem}"
    assert output.kind in (FILE, FILE_IN_NEW_DIR), output.kind
    if path.is_dir():
        return f"{shown} is a directory; name a file in it"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"file {shown} exists and is not writable"
    parent = path.parent
    if parent.is_dir():
        return None if _writable_dir(parent) else f"cannot write {shown}: directory {str(parent)!r} is not writable"
    if parent.exists():
        return f"cannot write {shown}: {str(parent)!r} is not a directory"
    if output.kind == FILE:
        return f"cannot write {shown}: directory {str(parent)!r} does not exist; create it first"
    problem = _creatable(parent)
    return None if problem is None else f"cannot write {shown}: directory {str(parent)!r}: {problem}"


def check_output_paths(*outputs: Output) -> None:
    """Raise a `ConfigError` with one `NAME: message` line per output that cannot be written (None paths skipped)."""
    problems = [Problem(o.name, message) for o in outputs
                if o.path is not None and (message := output_problem(o)) is not None]
    if problems:
        raise ConfigError(problems)


def job_outputs(job: JobConfig) -> list[Output]:
    """The directories a training run of `job` writes: `train.checkpoint.dir`, `train.offload_dir` and
    `train.tensorboard_dir`."""
    outputs = []
    if job.train.checkpoint is not None:
        outputs.append(Output("train.checkpoint.dir", job.resolve_path(job.train.checkpoint.dir), DIR))
    if job.train.offload_dir is not None:
        outputs.append(Output("train.offload_dir", job.resolve_path(job.train.offload_dir), DIR))
    if job.train.tensorboard_dir is not None:
        outputs.append(Output("train.tensorboard_dir", job.resolve_path(job.train.tensorboard_dir), DIR))
    return outputs
