"""`ParamShard`: how a rank's local parameter relates to the full logical tensor of the same name.

Initialization, Hugging Face loading and gradient synchronization all go through this one record, so
they agree with `parallelize_stage` about which slice a rank holds. Parameters that were never
sharded have no record and mean "the local tensor is the full tensor".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_ATTR = "_heteroflow_shard"


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamShard:
    """The local tensor is `full.narrow(dim, start, length)`, or the full tensor when `dim` is None."""

    full_shape: tuple[int, ...]
    """Shape of the logical tensor (the unsharded model's parameter)."""
    dim: int | None = None
    """Tensor dim split over the stage's tp group; None when every tp rank holds the whole tensor."""
    start: int = 0
    """First index along `dim` held by this rank."""
    length: int = 0
    """Extent along `dim` held by this rank."""
    partial_grad: bool = False
    """The local gradient is this rank's part of a sum over the tp group: all-reduce it before use
    (norms under sequence parallelism, q/k norms, kv projections replicated because tp > kv heads)."""
    expert: bool = False
    """A routed expert's parameter under an expert layout of its own (ep > 1 or etp != tp): `dim` splits it over
    the etp group, and its replicas are the expert-dp group, not the stage's tp, cp and dp ranks."""

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full` (a view)."""
        assert tuple(full.shape) == self.full_shape, (tuple(full.shape), self.full_shape)
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def read(self, read_slice: Callable[[int | None, int, int], torch.Tensor]) -> torch.Tensor:
        """Read only this rank's part through `read_slice(dim, start, stop)` (e.g. a safetensors slice)."""
        if self.dim is None:
            return read_slice(None, 0, 0)
        return read_slice(self.dim, self.start, self.start + self.length)


def shard_of(param: torch.Tensor) -> ParamShard:
    """The record of `param`; a full, unsharded record when it has none."""
    return getattr(param, _ATTR, None) or ParamShard(full_shape=tuple(param.shape))


def set_shard(param: torch.Tensor, shard: ParamShard) -> None:
    """Attach `shard` to `param` (kept as an attribute so it follows the Parameter, as Megatron does)."""
    assert tuple(param.shape) == shard.local_shape, (tuple(param.shape), shard.local_shape)
    setattr(param, _ATTR, shard)


def even_split(size: int, parts: int, index: int) -> tuple[int, int]:
    """`(start, length)` of part `index` when `size` is split into `parts` nearly equal pieces
    (the first `size % parts` pieces one longer); used for vocabularies that tp does not divide."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)
