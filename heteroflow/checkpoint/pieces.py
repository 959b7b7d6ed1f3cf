"""Pieces of logical tensors: how ranks write them (safetensors + JSON index) and read any box back.

A `Piece` is the part `box` of the logical tensor `name` (its `kind`: a parameter or one of its
optimizer states). Every rank writes the pieces it is responsible for (replicas written once) into its
own safetensors file and describes each in the index: name, kind, logical shape, dtype and the box as
per-dim `offsets` and `sizes`. Reading asks for a box of a logical tensor and assembles it from every
stored piece that intersects it (remap's box algebra), slicing the files lazily with safetensors'
`get_slice`: a rank reads only the bytes it needs, whatever layout wrote the checkpoint.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from heteroflow.checkpoint.files import INDEX, checkpoint_member, read_checkpoint_json
from heteroflow.errors import UserError
from heteroflow.remap.layout import Box, box_intersection, box_shape, box_slices, box_volume

KINDS = ("param", "master", "exp_avg", "exp_avg_sq")
"""What a piece holds: a model parameter, or its fp32 AdamW master weight and moments."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


@dataclass(frozen=True, slots=True)
class Piece:
    """`box` of the logical tensor `name` (of `shape`) as kind `kind`; `tensor` has the box's shape."""

    kind: str
    name: str
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, int, Box]]:
    """Cut the row-major flat range `[start, stop)` of a tensor of `shape` into boxes.

    Returns `(a, b, box)` in order: the flat indices `[a, b)` are exactly `box`, so a contiguous slice
    of a flattened tensor (a ZeRO shard of a parameter) is a few boxes (at most 2 per dim + 1).
    """
    if start >= stop:
        return []
    if not shape:
        return [(start, stop, ())]
    inner = prod(shape[1:])
    rest = tuple((0, n) for n in shape[1:])
    out: list[tuple[int, int, Box]] = []

    def rows_part(row: int, lo: int, hi: int) -> None:  # [lo, hi) inside one row
        base = row * inner
        for a, b, box in flat_range_boxes(shape[1:], lo, hi):
            out.append((base + a, base + b, ((row, row + 1),) + box))

    row, offset = divmod(start, inner)
    if offset:
        end = min(stop, (row + 1) * inner)
        rows_part(row, offset, end - row * inner)
        start = end
    full_end = stop // inner
    if start < stop and full_end > start // inner:
        out.append((start, full_end * inner, ((start // inner, full_end),) + rest))
        start = full_end * inner
    if start < stop:
        rows_part(full_end, 0, stop - full_end * inner)
    return out


def shift_box(box: Box, dim: int | None, offset: int) -> Box:
    """`box` moved by `offset` along `dim` (local shard coordinates -> logical coordinates)."""
    if dim is None or not offset:
        return box
    return tuple((a + offset, b + offset) if d == dim else (a, b) for d, (a, b) in enumerate(box))


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"checkpoints store float tensors, not {dtype}")


def write_rank_file(directory: Path, file_name: str, pieces: list[Piece], *, checkpoint_id: str = "") -> list[dict]:
    """Write `pieces` as one safetensors file in `directory`; return their index entries.

    The file's header names `checkpoint_id`, so a file copied in from another checkpoint is recognised.
    """
    tensors, entries = {}, []
    for piece in pieces:
        assert tuple(piece.tensor.shape) == box_shape(piece.box), (piece.name, piece.tensor.shape, piece.box)
        key = f"{piece.kind}/{piece.name}@" + ",".join(str(a) for a, _ in piece.box)
        assert key not in tensors, f"{key} written twice by one rank"
        tensors[key] = piece.tensor.detach().to("cpu").contiguous()
        entries.append({"key": key, "file": file_name, "kind": piece.kind, "name": piece.name,
                        "shape": list(piece.shape), "dtype": _dtype_name(piece.tensor.dtype),
                        "offsets": [a for a, _ in piece.box], "sizes": [b - a for a, b in piece.box]})
    save_file(tensors, str(directory / file_name),
              metadata={"format": "heteroflow-checkpoint", "checkpoint_id": checkpoint_id})
    return entries


def write_index_part(directory: Path, rank: int, file_name: str, digest: dict, entries: list[dict]) -> Path:
    """Rank `rank`'s index entries and its file's digest (`files.file_digest`), merged by rank 0 into
    `index.json` (`merge_index_parts`)."""
    path = directory / f"index-{rank:05d}.json"
    path.write_text(json.dumps({"file": file_name, "digest": digest, "entries": entries}), encoding="utf-8")
    return path


def merge_index_parts(directory: Path, world_size: int) -> dict:
    """Join every rank's index part into the checkpoint's index (and delete the parts): `entries`, and
    `files`, each rank file's size and checksum."""
    entries, files = [], {}
    for rank in range(world_size):
        part_path = directory / f"index-{rank:05d}.json"
        part = json.loads(part_path.read_text(encoding="utf-8"))
        entries.extend(part["entries"])
        files[part["file"]] = {**part["digest"], "rank": rank}
        part_path.unlink()
    return {"entries": entries, "files": files}


def _entry_box(entry: object, step_dir: Path) -> tuple[str, str, tuple[int, ...], Box]:
    """Validate one index entry; returns (kind, name, logical shape, box)."""
    def bad(why: str) -> UserError:
        return UserError(f"checkpoint {step_dir}: bad index entry {entry!r}: {why}")
    if not isinstance(entry, dict):
        raise bad("not an object")
    for key in ("key", "file", "kind", "name", "dtype"):
        if not isinstance(entry.get(key), str):
            raise bad(f"{key!r} must be a string")
    lists = [entry.get(k) for k in ("shape", "offsets", "sizes")]
    if not all(isinstance(v, list) and all(isinstance(x, int) and x >= 0 for x in v) for v in lists):
        raise bad("shape, offsets and sizes must be lists of non-negative integers")
    shape, offsets, sizes = lists
    if not len(shape) == len(offsets) == len(sizes) or any(o + s > n or s == 0
                                                           for o, s, n in zip(offsets, sizes, shape)):
        raise bad("its box does not lie inside its shape")
    if entry["kind"] not in KINDS or entry["dtype"] not in _DTYPES:
        raise bad(f"kind must be one of {KINDS} and dtype one of {tuple(_DTYPES)}")
    box = tuple((o, o + s) for o, s in zip(offsets, sizes))
    return entry["kind"], entry["name"], tuple(shape), box


class CheckpointReader:
    """Reads boxes of logical tensors from a complete checkpoint directory (JSON + safetensors only).

    Use as a context manager; files are opened on first use and only when a needed piece lies in them.
    """

    def __init__(self, step_dir: str | Path):
        self.step_dir = Path(step_dir)
        self.index = read_checkpoint_json(self.step_dir, INDEX)
        entries = self.index.get("entries")
        if not isinstance(entries, list):
            raise UserError(f"checkpoint {self.step_dir}: {INDEX} has no list of entries")
        self._pieces: dict[tuple[str, str], list[tuple[Box, tuple[int, ...], dict]]] = {}
        for entry in entries:
            kind, name, shape, box = _entry_box(entry, self.step_dir)
            checkpoint_member(self.step_dir, entry["file"])  # refuse escaping names before reading anything
            self._pieces.setdefault((kind, name), []).append((box, shape, entry))
        for (kind, name), pieces in self._pieces.items():  # coverage is counted by volume: no overlaps allowed
            for i, (a, _, _) in enumerate(pieces):
                if any(box_intersection(a, b) is not None for b, _, _ in pieces[i + 1:]):
                    raise UserError(f"checkpoint {self.step_dir}: stored pieces of {kind} {name} overlap; "
                                    "the index is damaged")
        self._stack = ExitStack()
        self._files: dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every opened file."""
        self._stack.close()
        self._files.clear()

    def names(self, kind: str = "param") -> set[str]:
        """Logical names stored as `kind`."""
        return {name for k, name in self._pieces if k == kind}

    def shape(self, kind: str, name: str) -> tuple[int, ...] | None:
        """Logical shape of `name` as stored, or None when it is not in the checkpoint."""
        pieces = self._pieces.get((kind, name))
        return pieces[0][1] if pieces else None

    def _open(self, file_name: str):
        if file_name not in self._files:
            path = checkpoint_member(self.step_dir, file_name)
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for a file that is not one
                raise UserError(f"checkpoint {self.step_dir}: {file_name} is not a readable safetensors file "
                                f"({exc})") from None
            self._files[file_name] = self._stack.enter_context(handle)
        return self._files[file_name]

    def read(self, kind: str, name: str, box: Box, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The part `box` of the logical tensor `name` (expected logical `shape`) as a CPU tensor of `dtype`."""
        pieces = self._pieces.get((kind, name))
        if not pieces:
            raise UserError(f"checkpoint {self.step_dir} holds no {kind} of {name!r}; it was written for another "
                            "model (or is damaged)")
        stored_shape = pieces[0][1]
        if stored_shape != tuple(shape):
            raise UserError(f"checkpoint {self.step_dir}: {name} has shape {list(stored_shape)} there but "
                            f"{list(shape)} in this model")
        out = torch.empty(box_shape(box), dtype=dtype)
        covered = 0
        for stored_box, stored, entry in pieces:
            common = box_intersection(stored_box, box)
            if common is None:
                continue
            if stored != stored_shape:
                raise UserError(f"checkpoint {self.step_dir}: pieces of {name} disagree about its shape")
            handle = self._open(entry["file"])
            if entry["key"] not in handle.keys():
                raise UserError(f"checkpoint {self.step_dir}: {entry['file']} lacks tensor {entry['key']!r}")
            part = handle.get_slice(entry["key"])
            if tuple(part.get_shape()) != box_shape(stored_box):
                raise UserError(f"checkpoint {self.step_dir}: tensor {entry['key']!r} has shape "
                                f"{part.get_shape()}, its index says {list(box_shape(stored_box))}")
            out[box_slices(common, box)] = part[box_slices(common, stored_box)].to(dtype)
            covered += box_volume(common)
        if covered != box_volume(box):  # stored pieces never overlap, so the volumes add up exactly
            raise UserError(f"checkpoint {self.step_dir}: the stored pieces of {kind} {name} cover {covered} of the "
                            f"{box_volume(box)} elements needed; the checkpoint is incomplete or damaged")
        return out
