"""Layout-independent checkpoints in one process: shards written under one layout read back under another.

Fake ranks are threads (one `threading.Barrier` stands in for the world's barrier); shards come from
`remap.local.shard`, and the expected values are always cut from the full logical tensors directly,
never through the checkpoint code's own box arithmetic.
"""

from __future__ import annotations

import itertools
import threading
from math import prod

import pytest
import torch
from torch import nn

from heteroflow.checkpoint.files import complete_checkpoints
from heteroflow.checkpoint.pieces import CheckpointReader, Piece, flat_range_boxes
from heteroflow.checkpoint.save import save_checkpoint
from heteroflow.checkpoint.stage_state import load_stage, stage_pieces
from heteroflow.errors import UserError
from heteroflow.models.data_parallel import DataParallelAdamW
from heteroflow.models.shard import ParamShard, even_split, set_shard, shard_of
from heteroflow.remap import Axis, TensorLayout
from heteroflow.remap.local import shard

KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


def run_fake_ranks(world_size: int, fn) -> list:
    """`fn(rank, barrier)` on `world_size` threads; re-raises the first failure."""
    barrier = threading.Barrier(world_size, timeout=60)
    results, errors = [None] * world_size, []

    def main(rank):
        try:
            results[rank] = fn(rank, barrier.wait)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_flat_range_boxes_cover_exactly_the_range():
    for shape in [(7,), (3, 5), (2, 3, 4), (1, 6), (4, 1, 3)]:
        numel = prod(shape)
        grid = torch.arange(numel).view(shape)
        for start, stop in itertools.combinations(range(numel + 1), 2):
            pieces = flat_range_boxes(shape, start, stop)
            assert len(pieces) <= 2 * len(shape) + 1
            assert pieces[0][0] == start and pieces[-1][1] == stop
            for (a, b, box), nxt in zip(pieces, pieces[1:] + [(stop, None, None)]):
                assert b == nxt[0]  # consecutive, in order
                values = grid[tuple(slice(lo, hi) for lo, hi in box)].flatten()
                assert values.tolist() == list(range(a, b)), (shape, start, stop, box)


def test_pieces_written_under_one_layout_read_under_another(tmp_path):
    gen = torch.Generator().manual_seed(0)
    full = {kind: torch.randn(12, 8, generator=gen) for kind in KINDS}
    # Written by 4 ranks as dp=2 (replicas) x tp=2 over rows; replicas write once.
    src = TensorLayout(shape=(12, 8), axes=(Axis("dp", 2), Axis("tp", 2, 0)), ranks=range(4))
    shards = {kind: shard(full[kind], src) for kind in KINDS}
    writers = {holders[0] for _, holders in src.blocks()}

    def write(rank, barrier):
        pieces = [Piece(kind, "w", (12, 8), src.box(rank), shards[kind][rank]) for kind in KINDS] \
            if rank in writers else []
        return save_checkpoint(tmp_path, 5, pieces, {"model": {}, "optimizer_steps": 5}, rank=rank, world_size=4,
                               barrier=barrier, scratch_id="a1")

    final = run_fake_ranks(4, write)[0]
    assert complete_checkpoints(tmp_path) == [(5, final)]
    # Read as 3 x 2 blocks over (rows, columns): boxes that cut across the writers' blocks.
    dst = TensorLayout(shape=(12, 8), axes=(Axis("a", 3, 0), Axis("b", 2, 1)), ranks=range(6))
    expected = {kind: shard(full[kind], dst) for kind in KINDS}
    with CheckpointReader(final) as reader:
        for rank, kind in itertools.product(dst.ranks, KINDS):
            got = reader.read(kind, "w", dst.box(rank), shape=(12, 8), dtype=torch.float32)
            assert torch.equal(got, expected[kind][rank])
        with pytest.raises(UserError, match="shape"):
            reader.read("param", "w", ((0, 1), (0, 1)), shape=(8, 12), dtype=torch.float32)
        with pytest.raises(UserError, match="holds no param of 'v'"):
            reader.read("param", "v", ((0, 1),), shape=(3,), dtype=torch.float32)


# A toy stage: a column-parallel matrix, a row-parallel one, a vocabulary-like matrix split unevenly,
# and a replicated vector. Values of every kind come from FULL.
SHAPES = {"col": (8, 6), "row": (6, 8), "vocab": (7, 4), "norm": (6,)}
SPLIT_DIM = {"col": 0, "row": 1, "vocab": 0, "norm": None}
_gen = torch.Generator().manual_seed(1)
FULL = {kind: {name: torch.randn(shape, generator=_gen) for name, shape in SHAPES.items()} for kind in KINDS}
FULL["master"] = FULL["param"]  # fp32 parameters are their own master copy (`heteroflow.layout.state_bytes`)


def _param_shard(name: str, tp: int, tp_rank: int) -> ParamShard:
    dim, shape = SPLIT_DIM[name], SHAPES[name]
    if dim is None or tp == 1:
        return ParamShard(full_shape=shape)
    start, length = even_split(shape[dim], tp, tp_rank)
    return ParamShard(full_shape=shape, dim=dim, start=start, length=length)


def toy_rank(tp: int, dp: int, zero: int, rank: int, *, filled: bool):
    """The model and optimizer of fake rank `rank` (tp innermost); state from FULL when `filled`, else junk."""
    tp_rank, dp_rank = rank % tp, rank // tp
    params = nn.ParameterDict()
    for name in SHAPES:
        s = _param_shard(name, tp, tp_rank)
        value = s.take(FULL["param"][name]).clone() if filled else torch.full(s.local_shape, -7.0)
        params[name] = nn.Parameter(value)
        set_shard(params[name], s)
    model = nn.Sequential()
    model.p = params
    opt = DataParallelAdamW(model, dp_group=None, zero=0)
    if zero and dp > 1:  # what a ZeRO rank keeps: its 1/dp of the padded flat buffer
        opt.zero, opt.dp, opt.dp_rank = zero, dp, dp_rank
        opt.padded = -(-opt.numel // dp) * dp
        opt.lo, opt.hi = dp_rank * opt.padded // dp, (dp_rank + 1) * opt.padded // dp
        opt.master = torch.zeros(opt.hi - opt.lo)
        opt.exp_avg, opt.exp_avg_sq = torch.zeros_like(opt.master), torch.zeros_like(opt.master)
    for param, start, stop, views in opt.state_views(writable=True):
        for kind, view in views.items():
            full = FULL[kind][_name(model, param)]
            view.copy_(shard_of(param).take(full).flatten()[start:stop] if filled else torch.full_like(view, -7.0))
    opt.steps = 9 if filled else 0
    return model, opt, tp_rank, dp_rank


def _name(model, param) -> str:
    return next(n for n, p in model.p.items() if p is param)


def check_rank(model, opt):
    for name, param in model.p.items():
        assert torch.equal(param.detach(), shard_of(param).take(FULL["param"][name])), name
    for param, start, stop, views in opt.state_views():
        name = _name(model, param)
        for kind, view in views.items():
            assert torch.equal(view, shard_of(param).take(FULL[kind][name]).flatten()[start:stop]), \
                (name, kind, start, stop)
    assert opt.steps == 9


@pytest.mark.parametrize("src,dst", [
    ((2, 2, 1), (3, 1, 0)),   # tp 2 x dp 2 ZeRO-1  ->  tp 3 (uneven vocabulary split), one dp rank
    ((1, 3, 1), (2, 2, 1)),   # ZeRO over 3 dp ranks ->  ZeRO over 2 with tp 2
    ((2, 2, 0), (1, 3, 1)),   # dp replicas (written once) -> ZeRO ranges that cut rows
])
def test_model_and_zero_optimizer_state_move_between_layouts(tmp_path, src, dst):
    tp, dp, zero = src

    def write(rank, barrier):
        model, opt, tp_rank, dp_rank = toy_rank(tp, dp, zero, rank, filled=True)
        pieces = stage_pieces(model, opt, tp_rank=tp_rank, dp_rank=dp_rank)
        return save_checkpoint(tmp_path, 9, pieces, {"model": {}, "optimizer_steps": 9}, rank=rank,
                               world_size=tp * dp, barrier=barrier, scratch_id="b2")

    final = run_fake_ranks(tp * dp, write)[0]
    with CheckpointReader(final) as reader:  # every value stored exactly once
        for kind in KINDS:
            assert reader.names(kind) == set(f"p.{n}" for n in SHAPES)
        stored = sum(prod(e["sizes"]) for e in reader.index["entries"])
        assert stored == len(KINDS) * sum(prod(s) for s in SHAPES.values())
    tp, dp, zero = dst
    for rank in range(tp * dp):
        model, opt, _, _ = toy_rank(tp, dp, zero, rank, filled=False)
        with CheckpointReader(final) as reader:
            load_stage(model, opt, reader, optimizer_steps=9)
        check_rank(model, opt)
