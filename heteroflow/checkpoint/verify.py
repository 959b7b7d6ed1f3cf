"""Checking a checkpoint against its checksums before anything loads it, and falling back past damage.

    step_dir = checkpoint_to_resume(root)   # before launch on --resume: None when there is no checkpoint
    step_dir = newest_intact(root)          # the same, but None also when every checkpoint is damaged

What is checked, in order, each failure a `CheckpointDamaged` naming the file and what is wrong:
the marker (present, readable, its own checksum, its step), the index and the metadata (sizes and
checksums from the marker, same step and checkpoint id), then every rank file the index lists
(present, written by this save according to its header, its size and checksum). A damaged newest
checkpoint is reported, renamed to `step-N.damaged-<reason>` (never deleted: it may be all the user
has), and the next newest is tried. No torch: the launcher runs this before any worker starts.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Callable

from heteroflow.checkpoint.files import (CHECKSUM, FORMAT, INDEX, MARKER, METADATA, READABLE_VERSIONS,
                                         checkpoint_dirs, complete_checkpoints, file_digest, marker_checksum,
                                         move_aside)
from heteroflow.errors import UserError

REASONS = ("no-marker", "marker", "missing-file", "truncated", "size", "checksum", "stale-file", "metadata")
"""The `<reason>` of a directory moved aside: what the first problem found was."""
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header


class CheckpointDamaged(UserError):
    """A checkpoint file is missing, changed or inconsistent; `file` and `reason` (one of `REASONS`) say which."""

    def __init__(self, step_dir: Path, file: str, reason: str, detail: str):
        assert reason in REASONS, reason
        self.step_dir, self.file, self.reason = step_dir, file, reason
        super().__init__(f"checkpoint {step_dir} is damaged: {file}: {detail}")


class NoIntactCheckpoint(UserError):
    """Resuming was asked for, checkpoints exist, but every one failed its verification (all moved aside)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        super().__init__(f"every checkpoint in {root} is damaged (each was reported and moved aside to "
                         "step-N.damaged-*); nothing intact to resume from: restore one, or run without --resume "
                         "to start at step 0")


def _read_json(step_dir: Path, name: str, reason: str = "metadata") -> dict:
    try:
        data = json.loads((step_dir / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointDamaged(step_dir, name, reason, f"unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointDamaged(step_dir, name, reason, "not a JSON object")
    return data


def _check_file(step_dir: Path, name: str, recorded: object) -> None:
    """Compare a file's size and checksum with `recorded` ({"bytes": n, "crc32": hex})."""
    path = step_dir / name
    if not isinstance(recorded, dict) or not isinstance(recorded.get("bytes"), int) \
            or not isinstance(recorded.get(CHECKSUM), str):
        raise CheckpointDamaged(step_dir, name, "metadata", f"its recorded size and checksum are malformed: "
                                f"{recorded!r}")
    if path.is_symlink() or not path.is_file():
        raise CheckpointDamaged(step_dir, name, "missing-file", "missing (or not a regular file)")
    actual = file_digest(path)
    if actual["bytes"] != recorded["bytes"]:
        shorter = actual["bytes"] < recorded["bytes"]
        raise CheckpointDamaged(step_dir, name, "truncated" if shorter else "size",
                                f"{actual['bytes']} bytes on disk, {recorded['bytes']} when written"
                                + (": truncated" if shorter else ": something was appended"))
    if actual[CHECKSUM] != recorded[CHECKSUM]:
        raise CheckpointDamaged(step_dir, name, "checksum", f"checksum mismatch ({CHECKSUM} {recorded[CHECKSUM]} "
                                f"when written, {actual[CHECKSUM]} on disk): its content changed after the save "
                                "(flipped bits, overwritten bytes or an edit)")


def _header_checkpoint_id(path: Path) -> str | None:
    """The checkpoint id in a safetensors file's header metadata, or None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(length).decode("utf-8"))
        found = header.get("__metadata__", {}).get("checkpoint_id")
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def verify_checkpoint(step_dir: str | os.PathLike) -> str | None:
    """Check every file of the checkpoint `step_dir`; raises `CheckpointDamaged` at the first problem.

    Returns None, or a note when the checkpoint predates checksums (format version 1: files only
    checked to exist).
    """
    step_dir = Path(step_dir)
    step = int(step_dir.name.split("-", 1)[1])
    marker_path = step_dir / MARKER
    if marker_path.is_symlink() or not marker_path.is_file():
        raise CheckpointDamaged(step_dir, MARKER, "no-marker", "the completion marker is missing, so this directory "
                                "was never published by a finished save (removed by hand, or copied in part)")
    marker = _read_json(step_dir, MARKER, "marker")
    if marker.get("format") != FORMAT or marker.get("version") not in READABLE_VERSIONS:
        raise CheckpointDamaged(step_dir, MARKER, "marker", f"not a heteroflow checkpoint marker (format "
                                f"{marker.get('format')!r}, version {marker.get('version')!r})")
    if marker.get("version") == 1:
        for name in (INDEX, METADATA):
            if not (step_dir / name).is_file():
                raise CheckpointDamaged(step_dir, name, "missing-file", "missing")
        return f"{step_dir} was written before checkpoints had checksums: its files were not verified"
    if marker.get("marker_crc32") != marker_checksum(marker):
        raise CheckpointDamaged(step_dir, MARKER, "marker", "the marker's own checksum does not match its content: "
                                "it was edited or damaged")
    if marker.get("step") != step:
        raise CheckpointDamaged(step_dir, MARKER, "marker", f"says step {marker.get('step')!r}, the directory "
                                f"is step {step}")
    recorded = marker.get("files")
    if not isinstance(recorded, dict):
        raise CheckpointDamaged(step_dir, MARKER, "marker", "lists no file checksums")
    for name in (INDEX, METADATA):
        _check_file(step_dir, name, recorded.get(name))
    index, meta = _read_json(step_dir, INDEX), _read_json(step_dir, METADATA)
    checkpoint_id = marker.get("checkpoint_id")
    for name, data in ((INDEX, index), (METADATA, meta)):
        if data.get("step") != step or data.get("checkpoint_id") != checkpoint_id:
            raise CheckpointDamaged(step_dir, name, "stale-file", f"belongs to checkpoint {data.get('checkpoint_id')!r} "
                                    f"(step {data.get('step')!r}), not to {checkpoint_id!r} (step {step})")
    files = index.get("files")
    if not isinstance(files, dict) or not files or sorted(files) != sorted(meta.get("files") or ()):
        raise CheckpointDamaged(step_dir, INDEX, "metadata", "its list of rank files is missing or disagrees with "
                                f"{METADATA}")
    for name, digest in sorted(files.items()):
        path = step_dir / name
        if Path(name).name != name or name in (INDEX, METADATA, MARKER):
            raise CheckpointDamaged(step_dir, INDEX, "metadata", f"lists an invalid rank file name {name!r}")
        if path.is_file() and not path.is_symlink():
            found = _header_checkpoint_id(path)
            if found is not None and found != checkpoint_id:
                raise CheckpointDamaged(step_dir, name, "stale-file", f"was written by checkpoint {found!r}, not by "
                                        f"{checkpoint_id!r}: a file of another checkpoint was copied in")
        _check_file(step_dir, name, digest)
    return None


def _report_to_stderr(line: str) -> None:
    print(f"heteroflow: {line}", file=sys.stderr, flush=True)


def newest_intact(root: str | os.PathLike, *, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint in `root` that passes `verify_checkpoint`, or None when there is none.

    Every newer `step-N` directory (marked or not) that fails is reported through `report` (stderr by
    default) with the file and the problem, and moved aside to `step-N.damaged-<reason>`. Call it
    where no save is running: before launching a `--resume`, and on one rank before loading.
    """
    report = report or _report_to_stderr
    for _, step_dir in reversed(checkpoint_dirs(root)):
        try:
            note = verify_checkpoint(step_dir)
        except CheckpointDamaged as damage:
            moved = move_aside(step_dir, damage.reason)
            where = f"moved aside to {moved.name}" if moved is not None else "already moved aside by another node"
            report(f"{damage}; {where}; falling back to an older checkpoint")
            continue
        if note:
            report(f"note: {note}")
        return step_dir
    return None


def checkpoint_to_resume(root: str | os.PathLike, *, report: Callable[[str], None] | None = None) -> Path | None:
    """The checkpoint `--resume` continues from: `newest_intact(root)`; None when `root` holds no complete
    checkpoint at all (start at step 0); `NoIntactCheckpoint` when there are some but none is intact."""
    if not complete_checkpoints(root):
        return None
    found = newest_intact(root, report=report)
    if found is None:
        raise NoIntactCheckpoint(root)
    return found
