"""`plan_transfer`: which slices go from which source rank to which destination rank. Pure Python.

The contract, for a source layout S and a destination layout D of the same logical tensor:

- A *destination replica set* is the set of D's ranks that hold the same share (for an activation
  without sequence parallelism: one tp group). Every element belongs to exactly one such share, and it
  crosses the boundary exactly once: it is sent to one member of the set (a `Piece`) and copied to the
  other members inside the destination stage, over that stage's own backend (a `FanOut`). So the bytes
  across the boundary are exactly the logical tensor's bytes, whatever the replication on either side;
  `TransferPlan.min_boundary_bytes` is that number and `boundary_bytes` always equals it.
- Sending is shared: each source share is cut into as many equal stripes as it has holders (equal up
  to rounding to whole slices along one dim) and each holder sends one stripe. Receiving is shared
  the same way over the holders of each destination share. Stripes follow the regions' natural
  order, so when shares line up no region is cut at all and each message is one contiguous block.
- Source replicas are either `identical` (each holds the full value, e.g. an activation after the
  stage's TP all-reduce, or a gradient after the stage's own TP reduction) or `partial` (each holds a
  partial sum, e.g. an input gradient before the TP all-reduce). For `partial`, each piece is first
  summed onto its sender inside the source stage (a `PreReduce`), so still only the sum crosses.

A plan never depends on which rank builds it: every rank computes the same plan from the same layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from heteroflow.remap.layout import Box, TensorLayout, LayoutError, box_intersection, box_shape, box_volume

SourceReplicas = Literal["identical", "partial"]


@dataclass(frozen=True, slots=True)
class Piece:
    """`box` of the logical tensor goes from `src` (a source rank) to `dst` (a destination rank)."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True, slots=True)
class FanOut:
    """After the transfer, `root` copies `box` to the other `ranks` of its destination replica set."""

    root: int
    ranks: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class PreReduce:
    """Before the transfer, the source replica set `ranks` sums its partial copies of `box` onto `root`."""

    root: int
    ranks: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Everything that moves when a tensor held as `src` must be held as `dst`; see the module doc."""

    src: TensorLayout
    dst: TensorLayout
    pieces: tuple[Piece, ...]
    fanouts: tuple[FanOut, ...]
    pre_reduces: tuple[PreReduce, ...] = ()
    source_replicas: SourceReplicas = "identical"
    _by_rank: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Index once: executors ask "what do I send / receive" on every micro-batch.
        index: dict[str, dict[int, list]] = {"send": {}, "recv": {}, "fan": {}, "red": {}}
        for i, p in enumerate(self.pieces):
            index["send"].setdefault(p.src, []).append(i)
            index["recv"].setdefault(p.dst, []).append(i)
        for i, f in enumerate(self.fanouts):
            for r in f.ranks:
                index["fan"].setdefault(r, []).append(i)
        for i, f in enumerate(self.pre_reduces):
            for r in f.ranks:
                index["red"].setdefault(r, []).append(i)
        object.__setattr__(self, "_by_rank", index)

    def sends_of(self, rank: int) -> list[tuple[int, Piece]]:
        """`(piece index, piece)` that `rank` sends, in plan order."""
        return [(i, self.pieces[i]) for i in self._by_rank["send"].get(rank, [])]

    def recvs_of(self, rank: int) -> list[tuple[int, Piece]]:
        """`(piece index, piece)` that `rank` receives, in plan order."""
        return [(i, self.pieces[i]) for i in self._by_rank["recv"].get(rank, [])]

    def fanouts_of(self, rank: int) -> list[FanOut]:
        """Broadcasts `rank` takes part in (as root or receiver), in plan order."""
        return [self.fanouts[i] for i in self._by_rank["fan"].get(rank, [])]

    def pre_reduces_of(self, rank: int) -> list[PreReduce]:
        """Reductions `rank` takes part in, in plan order."""
        return [self.pre_reduces[i] for i in self._by_rank["red"].get(rank, [])]

    @property
    def boundary_elements(self) -> int:
        """Elements that move from a source rank to a destination rank (self-copies included, which
        only happen when the two layouts share ranks, as in a checkpoint reshard)."""
        return sum(box_volume(p.box) for p in self.pieces)

    def boundary_bytes(self, elem_size: int) -> int:
        """Bytes across the boundary for elements of `elem_size` bytes."""
        return self.boundary_elements * elem_size

    def min_boundary_bytes(self, elem_size: int) -> int:
        """The least any remap can move: each element once, to one replica of its destination share."""
        return self.src.numel * elem_size

    def remote_bytes(self, elem_size: int) -> int:
        """Bytes between different ranks (pieces a rank sends to itself are local copies)."""
        return sum(box_volume(p.box) for p in self.pieces if p.src != p.dst) * elem_size

    def send_load(self) -> dict[int, int]:
        """Elements each source rank sends (every source rank listed, idle ones with 0)."""
        load = dict.fromkeys(self.src.ranks, 0)
        for p in self.pieces:
            load[p.src] += box_volume(p.box)
        return load

    def recv_load(self) -> dict[int, int]:
        """Elements each destination rank receives across the boundary (fan-out not counted)."""
        load = dict.fromkeys(self.dst.ranks, 0)
        for p in self.pieces:
            load[p.dst] += box_volume(p.box)
        return load

    def reversed(self, source_replicas: SourceReplicas = "identical") -> "TransferPlan":
        """The plan for the way back (gradients): from `dst` to `src`."""
        return plan_transfer(self.dst, self.src, source_replicas=source_replicas)

    def summary(self) -> str:
        """One line: layouts, pieces, fan-outs and the balance of sending."""
        sends = self.send_load().values()
        return (f"{self.src.describe()} -> {self.dst.describe()}: {len(self.pieces)} pieces, "
                f"{len(self.fanouts)} fan-outs, {len(self.pre_reduces)} pre-reduces, "
                f"{self.boundary_elements} of {self.src.numel} elements across, "
                f"send load {min(sends)}..{max(sends)} per source rank")


def plan_transfer(src: TensorLayout, dst: TensorLayout, *, source_replicas: SourceReplicas = "identical") -> TransferPlan:
    """The transfer plan that turns a tensor held as `src` into one held as `dst`.

    Raises `LayoutError` when the layouts describe tensors of different shapes.
    """
    if src.shape != dst.shape:
        raise LayoutError(f"cannot remap a {src.describe()} tensor into {dst.describe()}: the logical "
                          f"shapes differ ({list(src.shape)} vs {list(dst.shape)}); both stages must agree "
                          "on the micro-batch, sequence and hidden sizes")
    if source_replicas not in ("identical", "partial"):
        raise ValueError(f"source_replicas must be 'identical' or 'partial', got {source_replicas!r}")
    src_shares, dst_shares = src.shares(), dst.shares()
    # Regions: where a part of a source share meets a part of a destination share; they tile the tensor.
    # Keys (i, pi, j, pj): share i's part pi meets share j's part pj.
    regions: dict[tuple[int, int, int, int], _Region] = {}
    for i, (sparts, _) in enumerate(src_shares):
        for pi, sbox in enumerate(sparts):
            for j, (dparts, _) in enumerate(dst_shares):
                for pj, dbox in enumerate(dparts):
                    common = box_intersection(sbox, dbox)
                    if common is not None:
                        regions[i, pi, j, pj] = _Region(common)
    # Stripe each source share over its holders and each destination share over its holders, regions in
    # the order the share's local tensor stores them.
    for i, (_, sranks) in enumerate(src_shares):
        _stripe([regions[key] for key in sorted(k for k in regions if k[0] == i)], sranks, "senders")
    for j, (_, dranks) in enumerate(dst_shares):
        _stripe([regions[key] for key in sorted((k for k in regions if k[2] == j), key=lambda k: (k[3], k[0], k[1]))],
                dranks, "receivers")
    pieces, fanouts, pre_reduces = [], [], []
    for (i, _, j, _), region in sorted(regions.items()):
        for box, sender, receiver in region.pieces():
            pieces.append(Piece(sender, receiver, box))
            if len(dst_shares[j][1]) > 1:
                fanouts.append(FanOut(receiver, dst_shares[j][1], box))
            if source_replicas == "partial" and len(src_shares[i][1]) > 1:
                pre_reduces.append(PreReduce(sender, src_shares[i][1], box))
    return TransferPlan(src=src, dst=dst, pieces=tuple(pieces), fanouts=tuple(fanouts),
                        pre_reduces=tuple(pre_reduces), source_replicas=source_replicas)


@dataclass(slots=True)
class _Region:
    """One source share meeting one destination share, and where its stripes start on either side."""

    box: Box
    senders: list[tuple[int, int]] = field(default_factory=list)
    """`(element offset in the region, rank)`: from that offset on, `rank` sends. Starts at offset 0."""
    receivers: list[tuple[int, int]] = field(default_factory=list)

    def pieces(self) -> list[tuple[Box, int, int]]:
        """Sub-boxes where one sender meets one receiver, cut along one dim (see `_cut_dim`)."""
        volume = box_volume(self.box)
        offsets = sorted({offset for offset, _ in self.senders + self.receivers} - {0})
        dim = _cut_dim(self.box, offsets)
        rows = box_shape(self.box)[dim]
        row_volume = volume // rows

        def segments(marks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
            # Offsets become whole rows along `dim` (rounded); a stripe rounded to nothing drops out.
            cuts = [min(rows, round(offset / row_volume)) for offset, _ in marks] + [rows]
            return [(a, b, rank) for (a, b), (_, rank) in zip(zip(cuts, cuts[1:]), marks) if a < b]

        senders, receivers = segments(self.senders), segments(self.receivers)
        cuts = sorted({0, rows, *(c for seg in senders + receivers for c in seg[:2])})
        start = self.box[dim][0]
        out = []
        for lo, hi in zip(cuts, cuts[1:]):
            sender = next(r for a, b, r in senders if a <= lo < b)
            receiver = next(r for a, b, r in receivers if a <= lo < b)
            box = tuple((start + lo, start + hi) if d == dim else iv for d, iv in enumerate(self.box))
            out.append((box, sender, receiver))
        return out


def _cut_dim(box: Box, offsets: list[int]) -> int:
    """The dim along which to cut a region at element `offsets` (taken in slices along that dim).

    Cutting an outer dim keeps pieces contiguous in memory, cutting an inner one lands closer to the
    exact offsets: take the outermost dim whose rounding moves no cut by more than 1/64 of the region
    (exactly, for small regions), else the one that moves them least.
    """
    extents = box_shape(box)
    if not offsets:
        return 0
    volume = box_volume(box)
    tolerance = volume // 64
    best: tuple[int, int] | None = None
    for dim, extent in enumerate(extents):
        if extent == 1:
            continue
        row_volume = volume // extent
        error = max(abs(o - round(o / row_volume) * row_volume) for o in offsets)
        if error <= tolerance:
            return dim
        if best is None or error < best[0]:
            best = (error, dim)
    assert best is not None, "a region with cuts inside has a dim longer than 1"
    return best[1]


def _stripe(regions: list[_Region], holders: tuple[int, ...], side: str) -> None:
    """Give each of `holders` an equal, contiguous stripe of the regions laid end to end.

    Records in each region where the stripes inside it begin; when the regions already line up with
    the stripes (the common case) every region lies in one stripe and is not cut at all.
    """
    total = sum(box_volume(r.box) for r in regions)
    n = len(holders)
    starts = [round(k * total / n) for k in range(n)]  # element offset where stripe k begins
    offset, k = 0, 0
    for region in regions:
        volume = box_volume(region.box)
        while k + 1 < n and starts[k + 1] <= offset:
            k += 1
        marks = [(0, holders[k])]
        while k + 1 < n and starts[k + 1] < offset + volume:
            k += 1
            marks.append((starts[k] - offset, holders[k]))
        getattr(region, side).extend(marks)
        offset += volume
