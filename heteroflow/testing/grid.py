"""Grids of activation layouts for exhaustive remap tests."""

from __future__ import annotations

from typing import Iterable, NamedTuple

GRID_SHAPE = (12, 4, 3)
"""[batch, seq, hidden] that every dp in 1..4 and every tp in 1..2 (with or without sp) can hold."""


class Degrees(NamedTuple):
    """One stage layout of the grid."""

    dp: int
    tp: int
    sp: bool

    @property
    def num_ranks(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"dp{self.dp}tp{self.tp}{'sp' if self.sp else ''}"


def degree_grid(dps: Iterable[int] = (1, 2, 3, 4), tps: Iterable[int] = (1, 2)) -> list[Degrees]:
    """Every (dp, tp, sp) combination; sp only with tp > 1, where it changes the layout."""
    return [Degrees(dp, tp, sp) for dp in dps for tp in tps for sp in ((False, True) if tp > 1 else (False,))]


def placement(src: Degrees, dst: Degrees, world_size: int) -> tuple[range, range]:
    """Ranks for a source and a destination stage inside a world of `world_size`: the source at the
    front, the destination at the back, so they are disjoint whenever the world is large enough
    (and share ranks otherwise, which exercises local copies)."""
    assert src.num_ranks <= world_size and dst.num_ranks <= world_size
    return range(src.num_ranks), range(world_size - dst.num_ranks, world_size)
