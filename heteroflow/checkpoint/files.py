"""Checkpoint directories on disk: names, completeness, atomic publication, pruning, safe paths. No torch.

Inside `train.checkpoint.dir`:

    step-000120/                      a complete checkpoint (the next step to run is 120)
      rank-00000.safetensors ...      each rank's deduplicated pieces (model params, optimizer state)
      index.json                      one entry per stored piece: logical name, shape, dtype, box
      metadata.json                   model, train, plan, step, data position, RNG, optimizer steps
      heteroflow-checkpoint.json      the completion marker, written last
    step-000130.tmp-1a2b3c4d/         being written (or left by a killed save): ignored, cleaned
    step-000100.old-1a2b3c4d/         being deleted (pruned or replaced): ignored, cleaned
    step-000110.damaged-checksum/     found damaged and moved aside (`heteroflow.checkpoint.verify`): kept

Every file is checksummed (`CHECKSUM`): the index records each rank file's size and CRC, the marker
records those of the index and the metadata, and its own (`marker_crc32`); `verify` checks them all.

A checkpoint becomes visible only by the rename of its finished temporary directory, after every
file in it and the directory itself were fsynced; so a kill at any moment leaves either the previous
set of checkpoints or the previous set plus the new one, never a half-written `step-N`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

from heteroflow.errors import UserError

FORMAT = "heteroflow-checkpoint"
FORMAT_VERSION = 2
"""2: checksums in the index and the marker. Version 1 (written before checksums) is still read, unverified."""
READABLE_VERSIONS = (1, 2)
CHECKSUM = "crc32"
"""zlib's CRC-32: the fastest checksum available without a new dependency (no crc32c or xxhash here),
several times blake2b on one core (benchmarks/results/bench_swap_checksum.txt); it catches every burst
of up to 32 flipped bits, and the damage guarded against is accidental (disks, copies, hand edits)."""
MARKER = "heteroflow-checkpoint.json"
"""Completion marker; the offload swap code refuses directories holding a file of this name."""
METADATA = "metadata.json"
INDEX = "index.json"

_COMPLETE = re.compile(r"^step-(\d{6,})$")
_SCRATCH = re.compile(r"^step-(\d{6,})\.(tmp|old)-[0-9a-z]+$")
_READ_BLOCK_BYTES = 8 << 20


def step_dir_name(step: int) -> str:
    """`step-000123`: the directory of the checkpoint taken before step `step` runs."""
    return f"step-{step:06d}"


def rank_file_name(rank: int) -> str:
    """The safetensors file rank `rank` writes."""
    return f"rank-{rank:05d}.safetensors"


def read_marker(step_dir: Path) -> dict | None:
    """The parsed completion marker of `step_dir`, or None when it is missing or not ours."""
    path = step_dir / MARKER
    if path.is_symlink() or not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return None
    return marker


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """`(step, directory)` of every complete checkpoint in `root`, oldest first."""
    return [(step, entry) for step, entry in checkpoint_dirs(root)
            if (marker := read_marker(entry)) is not None and marker.get("step") == step]


def checkpoint_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """`(step, directory)` of every `step-N` directory in `root` (marked or not, no symlinks), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _COMPLETE.match(entry.name)
        if match and not entry.is_symlink() and entry.is_dir():  # a symlinked step dir could point anywhere
            found.append((int(match[1]), entry))
    return sorted(found)


def clean_incomplete(root: str | os.PathLike) -> list[Path]:
    """Delete temporary and half-deleted `step-*` directories in `root`; move unmarked `step-N` ones aside.

    A published `step-N` always holds its marker (it appears by one rename), so one without is damaged
    or copied by hand: renamed to `step-N.damaged-no-marker`, never deleted. Returns the directories
    removed or moved. Only for when no save is in progress (before a run starts or resumes).
    """
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        if _SCRATCH.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif _COMPLETE.match(entry.name) and read_marker(entry) is None:
            move_aside(entry, "no-marker")
            removed.append(entry)
    return removed


def move_aside(step_dir: Path, reason: str) -> Path | None:
    """Rename the damaged `step_dir` to `step-N.damaged-<reason>` (`-2`, `-3`... if taken); never deletes.

    Returns the new path, or None when the directory is already gone (another node moved it first).
    """
    for n in range(1, 1000):
        target = step_dir.with_name(f"{step_dir.name}.damaged-{reason}" + (f"-{n}" if n > 1 else ""))
        if target.exists() or target.is_symlink():
            continue  # rename() would silently replace an empty directory
        try:
            os.rename(step_dir, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise UserError(f"checkpoint {step_dir} is damaged but cannot be moved aside to {target.name}: {exc}; "
                            "move or remove it by hand") from None
        fsync_dir(step_dir.parent)
        return target
    raise UserError(f"cannot move the damaged checkpoint {step_dir} aside: 999 damaged copies already exist")


def file_digest(path: str | os.PathLike) -> dict:
    """`{"bytes": size, "crc32": "8 hex digits"}` of a file, read in blocks."""
    crc, size = 0, 0
    buf = bytearray(_READ_BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"bytes": size, CHECKSUM: f"{crc:08x}"}


def marker_checksum(marker: dict) -> str:
    """The CRC of the marker's own content (every key but `marker_crc32`, canonical JSON)."""
    body = {k: v for k, v in marker.items() if k != "marker_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode('utf-8')):08x}"


def latest_checkpoint(root: str | os.PathLike, *, clean: bool = False) -> Path | None:
    """The newest complete checkpoint in `root`, or None. Partial ones are ignored (deleted with `clean`)."""
    if clean:
        clean_incomplete(root)
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (new names, renames) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def write_json(path: Path, data: object) -> None:
    """Write JSON and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def publish(tmp_dir: Path, final_dir: Path, scratch_id: str) -> None:
    """Make the finished `tmp_dir` visible as `final_dir` by one rename (fsyncing everything first).

    An existing `final_dir` (a checkpoint of the same step from an earlier run) is first renamed aside
    and deleted afterwards; older checkpoints stay intact throughout.
    """
    for entry in tmp_dir.iterdir():
        fsync_file(entry)
    fsync_dir(tmp_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f"{final_dir.name}.old-{scratch_id}")
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: str | os.PathLike, keep: int, scratch_id: str) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints; returns the deleted directories.

    Each is renamed aside first, so an interrupted delete never leaves a marked, half-empty checkpoint.
    """
    found = complete_checkpoints(root)
    doomed = [path for _, path in found[:max(0, len(found) - keep)]]
    for path in doomed:
        aside = path.with_name(f"{path.name}.old-{scratch_id}")
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if doomed:
        fsync_dir(root)
    return doomed


def checkpoint_member(step_dir: Path, name: object) -> Path:
    """The file `name` (from the checkpoint's index) inside `step_dir`, refusing anything that leaves it.

    Absolute paths, `..`, and symlinks that resolve outside the directory are `UserError`s.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"checkpoint {step_dir}: invalid file name {name!r} in its index")
    pure = Path(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise UserError(f"checkpoint {step_dir}: refusing file {name!r} from its index: checkpoint files must lie "
                        "inside the checkpoint directory (no absolute paths, no '..')")
    base = step_dir.resolve()
    path = (step_dir / pure).resolve()
    if base not in path.parents:
        raise UserError(f"checkpoint {step_dir}: refusing file {name!r} from its index: it resolves to {path}, "
                        "outside the checkpoint directory (a symlink?)")
    if not path.is_file():
        raise UserError(f"checkpoint {step_dir}: file {name!r} named in its index is missing; the checkpoint is "
                        "damaged, resume from an older one (delete this directory)")
    return path


def read_checkpoint_json(step_dir: Path, name: str) -> dict:
    """A JSON file of the checkpoint (metadata or index), as a dict, or a `UserError`."""
    path = checkpoint_member(step_dir, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"checkpoint {step_dir}: cannot read {name}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"checkpoint {step_dir}: {name} is not a JSON object")
    return data


def inside_root(step_dir: Path, root: str | os.PathLike) -> Path:
    """`step_dir`, after checking that it really lies inside the checkpoint root (symlinks resolved)."""
    resolved = Path(step_dir).resolve()
    if Path(root).resolve() not in resolved.parents:
        raise UserError(f"checkpoint {step_dir} resolves to {resolved}, outside the checkpoint directory {root}")
    return resolved
