"""Initialization draws only the rank's shard: a tp-8 stage's rank draws at most 1/8 of the stage's parameters,
and its weights are the one-device model's slice (ranks of a fake 8-rank world, one after the other)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from heteroflow.config import PRESETS
from heteroflow.layout import ParallelLayout
from heteroflow.models import build_stage_model, init_weights, materialize, parallelize_stage, shard_of
from heteroflow.models.init import draw_normal, tile_extents

# tp 8 divides every split dim; 8 kv heads, so no projection is replicated over tp
SPEC = replace(PRESETS["tiny-llama"], num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
               num_kv_heads=8, vocab_size=1024)
SEED = 11


def test_tp8_ranks_draw_an_eighth_of_the_stage_and_hold_the_one_device_weights():
    reference = build_stage_model(SPEC, first_layer=0, last_layer=2, is_first=True, is_last=True)
    drawn_whole = init_weights(reference, seed=SEED)
    stage_numel = sum(p.numel() for p in reference.parameters())
    assert 0 < drawn_whole <= stage_numel  # norms are ones: not drawn
    full = dict(reference.named_parameters())
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            with torch.device("meta"):
                model = build_stage_model(SPEC, first_layer=0, last_layer=2, is_first=True, is_last=True)
            parallelize_stage(model, layout=ParallelLayout(tp=8), tp_group=dist.group.WORLD)
            materialize(model, "cpu")
            drawn = init_weights(model, seed=SEED)
        finally:
            dist.destroy_process_group()
        assert drawn * 8 <= stage_numel, (rank, drawn, stage_numel)
        assert drawn * 8 == drawn_whole  # exactly its eighth of what one device draws
        for name, p in model.named_parameters():
            assert torch.equal(p, shard_of(p).take(full[name])), (rank, name)


def test_a_region_is_the_same_values_whatever_draws_it():
    shape = (192, 160)  # 4 x 4 tiles of 48 x 40
    box = ((0, 192), (0, 160))
    whole, drawn = draw_normal("w", shape, box, seed=1)
    assert drawn == 192 * 160
    part, drawn_part = draw_normal("w", shape, ((10, 50), (7, 33)), seed=1)
    assert torch.equal(part, whole[10:50, 7:33]) and drawn_part == 2 * 48 * 40  # two tiles overlap it
    assert not torch.equal(draw_normal("w", shape, box, seed=2)[0], whole)
    assert not torch.equal(draw_normal("v", shape, box, seed=1)[0], whole)


def test_tiles_depend_on_the_shape_only_and_stay_large_enough():
    assert tile_extents((8192, 28672)) == (128, 448)  # 64 x 64 tiles
    assert tile_extents((64, 64)) == (32, 32)  # 4 tiles of 1,024 elements
    assert tile_extents((10,)) == (10,)  # one tile
    assert tile_extents((8, 1024, 4096)) == (1, 64, 256)  # 16 parts per dim, cut short by a dim of 8
