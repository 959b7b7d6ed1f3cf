"""Tensor layout algebra: which rank holds which box, for activations and for parameters; clear errors."""

from __future__ import annotations

import pytest

from heteroflow.errors import UserError
from heteroflow.remap import Axis, TensorLayout, LayoutError, box_intersection, box_volume, plan_transfer


def test_activation_without_sp_splits_batch_over_dp_and_replicates_over_tp():
    layout = TensorLayout.activation((4, 8, 16), ranks=range(10, 14), dp=2, tp=2)
    # tp innermost: ranks 10, 11 are one tp group holding the first half of the batch.
    assert layout.box(10) == layout.box(11) == ((0, 2), (0, 8), (0, 16))
    assert layout.box(12) == layout.box(13) == ((2, 4), (0, 8), (0, 16))
    assert layout.coords(13) == {"dp": 1, "cp": 0, "tp": 1}
    assert layout.replica_set(12) == (12, 13)
    assert layout.num_replicas == 2
    assert layout.local_shape() == (2, 8, 16)


def test_sequence_parallel_splits_seq_over_tp_inside_cp():
    layout = TensorLayout.activation((2, 16, 4), ranks=range(8), dp=2, cp=2, tp=2, sp=True)
    # cp is load-balanced (cp rank 0 holds quarters 0 and 3, cp rank 1 quarters 1 and 2) and tp splits
    # each cp rank's local sequence: cp0tp0, cp0tp1, cp1tp0, cp1tp1.
    assert [layout.box(r)[1] for r in range(4)] == [(0, 4), (12, 16), (4, 8), (8, 12)]
    assert layout.box(5) == ((1, 2), (12, 16), (0, 4))
    assert layout.num_replicas == 1
    assert all(len(holders) == 1 for _, holders in layout.blocks())


def test_context_parallel_ranks_hold_two_mirrored_chunks_in_local_order():
    layout = TensorLayout.activation((1, 24, 2), ranks=range(6), cp=3, tp=2)
    # 6 chunks of 4 tokens: cp rank r holds chunks r and 5 - r, replicated over its tp pair.
    assert [tuple(p[1] for p in layout.parts(r)) for r in (0, 2, 4)] == [((0, 4), (20, 24)), ((4, 8), (16, 20)),
                                                                         ((8, 16),)]
    assert layout.local_shape(0) == (1, 8, 2)
    assert layout.local_slices(0, ((0, 1), (21, 23), (0, 2))) == (slice(0, 1), slice(5, 7), slice(0, 2))
    assert [holders for _, holders in layout.shares()] == [(0, 1), (2, 3), (4, 5)]
    # tp 3 under sp cuts a cp rank's 8 local tokens across its two chunks.
    sp = TensorLayout.activation((1, 12, 2), ranks=range(3), tp=3, sp=True)
    assert [sp.parts(r)[0][1] for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    odd = TensorLayout.activation((1, 24, 2), ranks=range(6), cp=2, tp=3, sp=True)
    assert [p[1] for p in odd.parts(1)] == [(4, 6), (18, 20)]


def test_blocks_tile_the_tensor_exactly():
    layout = TensorLayout.activation((6, 4, 2), ranks=range(6), dp=3, tp=2)
    blocks = layout.blocks()
    assert sum(box_volume(box) for box, _ in blocks) == layout.numel
    for i, (a, _) in enumerate(blocks):
        for b, _ in blocks[i + 1:]:
            assert box_intersection(a, b) is None
    assert [holders for _, holders in blocks] == [(0, 1), (2, 3), (4, 5)]


def test_parameter_layouts_split_any_dim():
    # A [out=8, in=6] weight: column parallel splits dim 0, row parallel splits dim 1.
    column = TensorLayout(shape=(8, 6), axes=(Axis("tp", 4, 0),), ranks=range(4))
    row = TensorLayout(shape=(8, 6), axes=(Axis("tp", 2, 1),), ranks=range(2))
    assert column.box(3) == ((6, 8), (0, 6))
    assert row.box(1) == ((0, 8), (3, 6))
    # Two axes splitting two dims, plus a replicated one.
    grid = TensorLayout(shape=(4, 6), axes=(Axis("r", 2), Axis("a", 2, 1), Axis("b", 2, 0)), ranks=range(8))
    assert grid.box(1) == ((2, 4), (0, 3)) == grid.box(5)
    assert grid.replica_set(1) == (1, 5)


def test_uneven_but_divisible_pairs_intersect_exactly():
    two = TensorLayout.activation((6, 2, 3), ranks=(0, 1), dp=2)
    three = TensorLayout.activation((6, 2, 3), ranks=(2, 3, 4), dp=3)
    assert [three.box(r)[0] for r in (2, 3, 4)] == [(0, 2), (2, 4), (4, 6)]
    assert box_intersection(two.box(0), three.box(3)) == ((2, 3), (0, 2), (0, 3))


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(4, 8, 16), dp=3), "cannot split batch (size 4) of a [batch=4, seq=8, hidden=16] tensor 3 ways (dp=3)"),
    (dict(shape=(4, 6, 16), tp=4, sp=True), "cannot split seq (size 6)"),
    (dict(shape=(4, 6, 16), tp=2, cp=2, sp=True), "8 ways (cp=2 (x2 chunks, load-balanced) * tp=2): 6 is not divisible by 8"),
    (dict(shape=(4, 8), dp=2), "an activation is [batch, seq, hidden]"),
    (dict(shape=(0, 8, 16)), "has an empty dim"),
])
def test_layouts_that_cannot_hold_the_tensor_say_why(kwargs, message):
    degrees = {k: kwargs.get(k, 1) for k in ("dp", "tp", "cp")}
    n = degrees["dp"] * degrees["tp"] * degrees["cp"]
    with pytest.raises(LayoutError) as info:
        TensorLayout.activation(kwargs.pop("shape"), ranks=range(n), **kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_divisibility_error_lists_the_degrees_that_would_work():
    with pytest.raises(LayoutError, match=r"one of \[1, 2, 3, 6\]"):
        TensorLayout.activation((6, 2, 2), ranks=range(4), dp=4)


@pytest.mark.parametrize("make, message", [
    (lambda: TensorLayout(shape=(4,), axes=(Axis("tp", 2, 0),), ranks=(0, 1, 2)), "3 ranks for a mesh of tp=2"),
    (lambda: TensorLayout(shape=(4,), axes=(Axis("tp", 2, 0),), ranks=(1, 1)), "repeat a rank"),
    (lambda: TensorLayout(shape=(4,), axes=(Axis("tp", 2, 1),), ranks=(0, 1)), "splits dim 1, but the tensor has 1 dims"),
    (lambda: TensorLayout(shape=(4,), axes=(Axis("a", 1), Axis("a", 1)), ranks=(0,)), "names must be unique"),
    (lambda: TensorLayout(shape=(4,), axes=(Axis("a", 0),), ranks=()), "has size 0"),
])
def test_malformed_meshes_are_rejected(make, message):
    with pytest.raises(LayoutError, match=message):
        make()


def test_remapping_tensors_of_different_shapes_is_an_error():
    a = TensorLayout.activation((4, 8, 16), ranks=range(2), dp=2)
    b = TensorLayout.activation((4, 16, 16), ranks=range(2, 4), dp=2)
    with pytest.raises(LayoutError, match="logical shapes differ"):
        plan_transfer(a, b)


def test_describe_leaves_out_trivial_axes():
    layout = TensorLayout.activation((4, 8, 16), ranks=range(4), dp=2, tp=2, sp=True)
    assert layout.describe() == "[batch=4, seq=8, hidden=16] over dp=2(batch) x tp=2(seq)"
    assert "one rank" in TensorLayout.activation((1, 1, 1), ranks=[0]).describe()
