"""A stage's model shard and optimizer state as layout-independent pieces, and back.

What each rank writes (so every value is stored exactly once):
  * parameters: its tp shard (the box `ParamShard` describes), written by dp rank 0 only; values
    replicated over tp (norms, kv projections kept whole) by tp rank 0 only. Under ZeRO-3 (`optimizer.zero`
    3) no rank holds a whole tp shard: each writes the range it keeps, cut into boxes like the optimizer state;
  * optimizer state (fp32 master, exp_avg, exp_avg_sq): for each parameter, the part this rank keeps.
    Without ZeRO that is the whole local shard (written by dp rank 0). With ZeRO a rank keeps a
    contiguous range of the flattened local shard; that range is cut into at most a few boxes
    (`flat_range_boxes`) and written as such, in the parameter's logical coordinates. No gathering:
    each rank writes exactly what it holds, and the pieces of all dp ranks tile the tensor;
  * the head copy of an embedding tied across stages is not written: it equals `embed.weight`
    (same values, same gradients, same optimizer state), and is read back from it;
  * routed experts with a layout of their own (`ParamShard.expert`) by the same rules in expert coordinates: etp
    instead of tp, expert-dp instead of dp. Their names carry the global expert index, so a checkpoint does not
    depend on ep either.

Loading reads, for each local shard or ZeRO range of the new layout, exactly its boxes from whatever
pieces cover them.

The optimizer is a `heteroflow.optim.StageOptimizer`; this module uses its `zero`, `steps`,
`state_views(writable=...)`, `named_weights()` and `load_weights(values)`: `DataParallelAdamW`, and
`OffloadedAdamW`, whose parameters and state may live in CPU memory or on SSD (its state views are copies,
and with `writable=True` what is written into them is stored back in the offload tier).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from heteroflow.checkpoint.pieces import CheckpointReader, Piece, flat_range_boxes, shift_box
from heteroflow.layout.shards import counted_once
from heteroflow.models.init import canonical_name
from heteroflow.models.shard import ParamShard, shard_of
from heteroflow.optim import StageOptimizer
from heteroflow.remap.layout import box_shape

OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")


def shard_box(shard: ParamShard) -> tuple[tuple[int, int], ...]:
    """The box of the logical tensor that a local parameter holds."""
    box = [(0, n) for n in shard.full_shape]
    if shard.dim is not None:
        box[shard.dim] = (shard.start, shard.start + shard.length)
    return tuple(box)


def _stored_params(model: nn.Module, ranks: "_Ranks") -> Iterator[tuple[str, nn.Parameter, ParamShard, int]]:
    """`(name, param, shard, dp_rank)` of the parameters whose values this rank's tp (or etp) index stores, with
    the rank's index among the parameter's replicas (dp, or expert-dp for an expert)."""
    tied = getattr(model, "spec", None) is not None and model.spec.tie_embeddings
    for name, param in model.named_parameters():
        shard = shard_of(param)
        tp_rank, dp_rank = ranks.of(shard)
        if dp_rank is None:
            continue
        # the head copy of a tied embedding is stored as embed.weight by the first stage
        head_copy = tied and canonical_name(name, tie_embeddings=True) != name
        if counted_once(split_over_tp=shard.dim is not None, tp_rank=tp_rank, tied_head_copy=head_copy):
            yield name, param, shard, dp_rank


class _Ranks:
    """A rank's indices in the dense layout and in the expert layout; `of(shard)` picks those of a parameter
    (dp None: this rank writes none of the dense parameters, e.g. a cp rank other than 0)."""

    def __init__(self, tp_rank: int, dp_rank: int | None, expert_ranks: tuple[int, int]):
        self.dense, self.expert = (tp_rank, dp_rank), expert_ranks

    def of(self, shard: ParamShard) -> tuple[int, int | None]:
        return self.expert if shard.expert else self.dense


def _zero_boxes(shard: ParamShard, start: int, stop: int) -> list[tuple[int, int, tuple]]:
    """The flat range `[start, stop)` of a local shard as `(a, b, logical box)`, a/b relative to `start`."""
    return [(a - start, b - start, shift_box(box, shard.dim, shard.start if shard.dim is not None else 0))
            for a, b, box in flat_range_boxes(shard.local_shape, start, stop)]


def stage_pieces(model: nn.Module, optimizer: StageOptimizer | None, *, tp_rank: int, dp_rank: int,
                 writes_dense: bool = True, expert_ranks: tuple[int, int] = (0, 0)) -> list[Piece]:
    """The pieces this rank writes: its share of the parameters and of the optimizer state. `writes_dense`: False
    on a rank whose non-expert values another rank writes (a cp rank other than 0); `expert_ranks`: its
    `(etp, expert_dp)` indices, for the experts marked `ParamShard.expert`."""
    pieces = []
    stored = {id(param): (name, shard, replica)
              for name, param, shard, replica in _stored_params(model, _Ranks(tp_rank, dp_rank if writes_dense
                                                                               else None, expert_ranks))}
    # ZeRO-3 keeps no whole copy of a parameter: each rank writes its range, from the master it also is (below).
    params_sharded = optimizer is not None and optimizer.zero >= 3
    if not params_sharded:
        values = dict(optimizer.named_weights() if optimizer is not None else model.named_parameters())
        for name, shard, replica in stored.values():
            if replica == 0:
                pieces.append(Piece("param", name, shard.full_shape, shard_box(shard), values[name].detach()))
    if optimizer is None:
        return pieces
    for param, start, stop, views in optimizer.state_views(writable=False):
        if id(param) not in stored:
            continue
        name, shard, replica = stored[id(param)]
        if not optimizer.zero and replica != 0:
            continue  # without ZeRO every replica keeps the same state: replica 0 writes it
        for a, b, box in _zero_boxes(shard, start, stop):
            for kind in OPTIMIZER_KINDS:
                pieces.append(Piece(kind, name, shard.full_shape, box, views[kind][a:b].view(box_shape(box))))
            if params_sharded:  # a copy: safetensors refuses two entries sharing memory
                pieces.append(Piece("param", name, shard.full_shape, box,
                                    views["master"][a:b].detach().clone().view(box_shape(box))))
    return pieces


@torch.no_grad()
def load_stage(model: nn.Module, optimizer: StageOptimizer | None, reader: CheckpointReader, *,
               optimizer_steps: int) -> None:
    """Fill the model shard and the optimizer state this rank holds from a checkpoint (any layout)."""
    tied = getattr(model, "spec", None) is not None and model.spec.tie_embeddings
    names, values = {}, {}
    for name, param in model.named_parameters():
        stored = canonical_name(name, tie_embeddings=tied)
        shard = shard_of(param)
        names[id(param)] = (stored, shard)
        values[name] = reader.read("param", stored, shard_box(shard), shape=shard.full_shape,
                                   dtype=param.dtype).view(shard.local_shape)
    if optimizer is None:
        for name, param in model.named_parameters():
            param.copy_(values[name])
        return
    optimizer.load_weights(values)
    for param, start, stop, views in optimizer.state_views(writable=True):
        stored, shard = names[id(param)]
        for a, b, box in _zero_boxes(shard, start, stop):
            for kind in OPTIMIZER_KINDS:
                target = views[kind][a:b]
                target.copy_(reader.read(kind, stored, box, shape=shard.full_shape, dtype=target.dtype).flatten())
    optimizer.steps = optimizer_steps
