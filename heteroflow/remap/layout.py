"""`TensorLayout`: how a group of ranks holds one logical tensor. Pure Python, no torch.

A layout is a mesh of named axes over an ordered list of ranks (row-major: the first axis is the
outermost, the last the innermost, as in `torch.distributed.DeviceMesh`). Each axis either splits one
tensor dim into equal contiguous blocks or replicates the tensor. When several axes split the same
dim, the outer axis cuts coarser blocks and the inner axis cuts each of those again, so
`(cp=2, tp=2)` both on the sequence dim give four quarters in the order cp0tp0, cp0tp1, cp1tp0, cp1tp1
(Megatron's order for context + sequence parallelism).

A rank's share is a `Box`: one half-open `(start, stop)` interval per dim, in logical coordinates.
Working with intervals rather than "block i of n" is what lets two layouts whose degrees are not
multiples of each other (dp 2 -> dp 3 over a batch of 6) be intersected exactly.

A *balanced* axis (context parallelism's causal load balancing) cuts its dim into `2 * size` chunks
and gives axis index i chunks i and `2 * size - 1 - i`, stored one after the other; axes inside it
split that local concatenation evenly (Megatron's order for cp with sp). Such a share is a tuple of
boxes, its *parts*, laid end to end along that dim in the rank's local tensor (`parts`,
`local_slices`); without balanced axes every share is one part.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

from heteroflow.errors import UserError

Box = tuple[tuple[int, int], ...]
"""Half-open `(start, stop)` interval per tensor dim, in logical coordinates."""

ACTIVATION_DIMS = ("batch", "seq", "hidden")


class LayoutError(UserError, ValueError):
    """A layout that cannot hold its tensor (a split that does not divide a size), or two layouts that
    cannot be remapped into each other. The message names the dim, the sizes and what to change."""


def box_volume(box: Box) -> int:
    """Number of elements in `box`."""
    return prod(stop - start for start, stop in box)


def box_intersection(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def box_contains(outer: Box, inner: Box) -> bool:
    """Whether `inner` lies inside `outer`."""
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Index `box` as slices; relative to the start of `origin` (a rank's own block) when given."""
    if origin is None:
        return tuple(slice(start, stop) for start, stop in box)
    return tuple(slice(start - o0, stop - o0) for (start, stop), (o0, _) in zip(box, origin, strict=True))


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of `box` along each dim."""
    return tuple(stop - start for start, stop in box)


@dataclass(frozen=True, slots=True)
class Axis:
    """One mesh axis: `size` ranks that split tensor dim `dim` (None: they hold replicas)."""

    name: str
    size: int
    dim: int | None = None
    balanced: bool = False
    """Split `dim` into `2 * size` chunks, index i holding chunks i and `2 * size - 1 - i` (see module doc)."""


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A logical tensor of `shape` held by `ranks` arranged as the mesh `axes` (row-major).

    Built once and validated: every dim's split must divide its size. Use `TensorLayout.activation` for the
    `[batch, seq, hidden]` activations of a pipeline stage.
    """

    shape: tuple[int, ...]
    axes: tuple[Axis, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None
    """Names for error messages (`batch`, `seq`, `hidden`); `dim 0`, `dim 1`... when None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if any(s < 1 for s in self.shape):
            raise LayoutError(f"tensor shape {list(self.shape)} has an empty dim; every size must be >= 1")
        if self.dim_names is not None and len(self.dim_names) != len(self.shape):
            raise LayoutError(f"{len(self.dim_names)} dim names for a {len(self.shape)}-d shape")
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise LayoutError(f"mesh axis names must be unique, got {names}")
        for axis in self.axes:
            if axis.size < 1:
                raise LayoutError(f"mesh axis {axis.name!r} has size {axis.size}; sizes must be >= 1")
            if axis.dim is not None and not 0 <= axis.dim < len(self.shape):
                raise LayoutError(f"mesh axis {axis.name!r} splits dim {axis.dim}, but the tensor has "
                                  f"{len(self.shape)} dims")
            if axis.balanced and axis.dim is None:
                raise LayoutError(f"mesh axis {axis.name!r} is balanced but splits no dim")
        if len({a.dim for a in self.axes if a.balanced}) < sum(a.balanced for a in self.axes):
            raise LayoutError("at most one balanced axis per dim")
        if len(self.ranks) != prod(a.size for a in self.axes):
            raise LayoutError(f"{len(self.ranks)} ranks for a mesh of "
                              f"{' x '.join(f'{a.name}={a.size}' for a in self.axes) or 'one rank'} = "
                              f"{prod(a.size for a in self.axes)} ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise LayoutError(f"ranks {list(self.ranks)} repeat a rank; each rank holds one share")
        for dim, size in enumerate(self.shape):
            splitting = self.axes_splitting(dim)
            ways = prod(a.size * (2 if a.balanced else 1) for a in splitting)
            if size % ways:
                by = " * ".join(f"{a.name}={a.size}" + (" (x2 chunks, load-balanced)" if a.balanced else "")
                                for a in splitting)
                divisors = [d for d in range(1, size + 1) if size % d == 0]
                raise LayoutError(
                    f"cannot split {self.dim_name(dim)} (size {size}) of a {self._shape_str()} tensor "
                    f"{ways} ways ({by}): {size} is not divisible by {ways}; use degrees whose product "
                    f"divides {size} (one of {divisors})")

    @classmethod
    def activation(cls, shape: Sequence[int], *, ranks: Sequence[int], dp: int = 1, tp: int = 1, cp: int = 1,
                   sp: bool = False) -> "TensorLayout":
        """A pipeline stage's `[batch, seq, hidden]` activation: batch split over dp, sequence split
        over cp with causal load balancing (rank i holds chunks i and 2cp-1-i) and, under sequence
        parallelism, that local sequence split again over tp; replicated over tp otherwise.

        Mesh order is `(dp, cp, tp)`, tp innermost, matching the plan's rank order.
        """
        if len(shape) != 3:
            raise LayoutError(f"an activation is [batch, seq, hidden], got shape {list(shape)}")
        axes = (Axis("dp", dp, 0), Axis("cp", cp, 1, balanced=cp > 1), Axis("tp", tp, 1 if sp else None))
        return cls(shape=tuple(shape), axes=axes, ranks=tuple(ranks), dim_names=ACTIVATION_DIMS)

    @property
    def ndim(self) -> int:
        """Tensor dims."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Elements of the logical tensor."""
        return prod(self.shape)

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each element (product of the replicating axes)."""
        return prod(a.size for a in self.axes if a.dim is None)

    def dim_name(self, dim: int) -> str:
        """`batch` (or `dim 0` without names), for messages."""
        return self.dim_names[dim] if self.dim_names else f"dim {dim}"

    def _shape_str(self) -> str:
        if self.dim_names:
            return "[" + ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape)) + "]"
        return str(list(self.shape))

    def axes_splitting(self, dim: int) -> tuple[Axis, ...]:
        """The axes that split `dim`, outermost first."""
        return tuple(a for a in self.axes if a.dim == dim)

    def axis(self, name: str) -> Axis:
        """The axis called `name`."""
        for a in self.axes:
            if a.name == name:
                return a
        raise KeyError(name)

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's index along every axis."""
        return self._coords_at(self.ranks.index(rank))

    def _coords_at(self, index: int) -> dict[str, int]:
        """`coords` of the rank at position `index` of `ranks`."""
        out: dict[str, int] = {}
        for axis in reversed(self.axes):
            index, out[axis.name] = divmod(index, axis.size)
        return {a.name: out[a.name] for a in self.axes}

    def parts(self, rank: int) -> tuple[Box, ...]:
        """The boxes `rank` holds, in the order its local tensor stores them (one, without balanced axes)."""
        if rank not in self.ranks:
            raise KeyError(f"rank {rank} is not in this layout (ranks {list(self.ranks)})")
        return self._parts_at(self.ranks.index(rank))

    def _parts_at(self, index: int) -> tuple[Box, ...]:
        """`parts` of the rank at position `index` of `ranks`."""
        coords = self._coords_at(index)
        per_dim = [_dim_intervals(size, self.axes_splitting(dim), coords) for dim, size in enumerate(self.shape)]
        multi = [dim for dim, intervals in enumerate(per_dim) if len(intervals) > 1]
        if not multi:
            return (tuple(intervals[0] for intervals in per_dim),)
        assert len(multi) == 1, "one dim at most is held in several parts"
        dim = multi[0]
        firsts = [intervals[0] for intervals in per_dim]
        return tuple(tuple(part if d == dim else iv for d, iv in enumerate(firsts)) for part in per_dim[dim])

    def box(self, rank: int) -> Box:
        """The part of the logical tensor that `rank` holds (a layout whose shares are one box each)."""
        parts = self.parts(rank)
        assert len(parts) == 1, f"{self.describe()}: rank {rank} holds {len(parts)} parts; use parts()"
        return parts[0]

    def local_slices(self, rank: int, box: Box) -> tuple[slice, ...]:
        """Where `box` (inside one of `rank`'s parts) sits in the rank's local tensor."""
        dim, offset = self._parts_dim(), 0
        for part in self.parts(rank):
            if box_contains(part, box):
                slices = list(box_slices(box, part))
                if dim is not None:  # parts lie end to end along the balanced dim
                    slices[dim] = slice(slices[dim].start + offset, slices[dim].stop + offset)
                return tuple(slices)
            offset += 0 if dim is None else part[dim][1] - part[dim][0]
        raise KeyError(f"{box} is not inside one of rank {rank}'s parts of {self.describe()}")

    def _parts_dim(self) -> int | None:
        return next((a.dim for a in self.axes if a.balanced), None)

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """Shape of one rank's share (the same on every rank: splits are even)."""
        parts = self.parts(self.ranks[0] if rank is None else rank)
        dim = self._parts_dim()
        shape = list(box_shape(parts[0]))
        if dim is not None:
            shape[dim] = sum(part[dim][1] - part[dim][0] for part in parts)
        return tuple(shape)

    def shares(self) -> tuple[tuple[tuple[Box, ...], tuple[int, ...]], ...]:
        """Each distinct share (its parts) with the ranks that hold it (its replica set, in mesh order).

        Shares are listed in the mesh order of their first holder; together they tile the tensor.
        """
        holders: dict[tuple[Box, ...], list[int]] = {}
        for index, rank in enumerate(self.ranks):  # by position: a lookup per rank made large stages quadratic
            holders.setdefault(self._parts_at(index), []).append(rank)
        return tuple((parts, tuple(ranks)) for parts, ranks in holders.items())

    def blocks(self) -> tuple[tuple[Box, tuple[int, ...]], ...]:
        """`shares()` of a layout whose shares are one box each: `(box, holders)`."""
        out = []
        for parts, ranks in self.shares():
            assert len(parts) == 1, f"{self.describe()} has shares of several parts; use shares()"
            out.append((parts[0], ranks))
        return tuple(out)

    def replica_set(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same share as `rank` (itself included)."""
        mine = self.parts(rank)
        return tuple(r for r in self.ranks if self.parts(r) == mine)

    def describe(self) -> str:
        """`[batch=4, seq=16, hidden=8] over dp=2(batch) x tp=2(seq)`, for logs and errors."""
        # Size-1 axes change nothing; leaving them out keeps messages short.
        axes = " x ".join(f"{a.name}={a.size}" + (f"({self.dim_name(a.dim)}{', balanced' if a.balanced else ''})"
                                                  if a.dim is not None else "")
                          for a in self.axes if a.size > 1)
        return f"{self._shape_str()} over {axes or 'one rank'}"


def _dim_intervals(size: int, splitting: tuple[Axis, ...], coords: dict[str, int]) -> tuple[tuple[int, int], ...]:
    """The global intervals of one dim a rank holds, in local order: each axis (outermost first) keeps
    its share of the local sequence left by the axes outside it (two mirrored chunks if balanced)."""
    intervals: list[tuple[int, int]] = [(0, size)]
    for axis in splitting:
        length = sum(b - a for a, b in intervals)
        i = coords[axis.name]
        if axis.balanced:
            chunk = length // (2 * axis.size)
            wanted = [(i * chunk, (i + 1) * chunk), ((2 * axis.size - 1 - i) * chunk, (2 * axis.size - i) * chunk)]
        else:
            width = length // axis.size
            wanted = [(i * width, (i + 1) * width)]
        intervals = [iv for lo, hi in wanted for iv in _local_to_global(intervals, lo, hi)]
    merged: list[tuple[int, int]] = []
    for a, b in intervals:  # neighbours that touch are one part (cp 1, or tp pieces of one chunk)
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(merged)


def _local_to_global(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The global intervals covering local positions `[lo, hi)` of `intervals` laid end to end."""
    out, offset = [], 0
    for a, b in intervals:
        start, stop = max(lo, offset), min(hi, offset + b - a)
        if start < stop:
            out.append((a + start - offset, a + stop - offset))
        offset += b - a
    return out
