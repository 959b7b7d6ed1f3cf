"""The planner prices context parallelism as the runtime runs it (`models/cp_attention.py`): the sequence
split over cp, K/V all-gathered forward and gathered plus reduce-scattered backward (exposed), the weights'
gradients all-reduced over cp in the tail (unless ZeRO-3 shards over cp x dp), and the backward's gathered K/V as
transient memory."""

from __future__ import annotations

import pytest

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.layout import GRAD_REDUCE_BYTES, ParallelLayout
from heteroflow.layout.shards import kv_heads_per_rank
from heteroflow.stagemap.comm import all_gather_s, all_reduce_s
from heteroflow.stagemap.compute import layer_forward
from heteroflow.stagemap.costs import StageHardware, context_parallel_working_bytes, stage_costs
from heteroflow.stagemap.hardware import Hardware, device_model
from heteroflow.stagemap.memory import activation_bytes

MODEL = PRESETS["llama2-7b"]
A100 = device_model(CATALOG["nvidia-a100-80g"], "bf16")
HW = StageHardware(device=A100, num_devices=2, num_nodes=1, node_count=8)
HARDWARE = Hardware(models={}, inter_node_gb_per_s=25)


def test_cp_splits_the_tokens_and_adds_the_kv_all_gather_to_attention():
    one = stage_costs(MODEL, HW, ParallelLayout(dp=2), 2, HARDWARE)
    cp2 = stage_costs(MODEL, HW, ParallelLayout(cp=2), 2, HARDWARE)
    tokens = MODEL.seq_length  # micro-batch 2: one sample per rank either way
    lc = layer_forward(MODEL, A100, tokens=tokens, tp=1, sp=False, dtype_bytes=2)
    link, latency = A100.tp_link()
    kv_chunk = tokens * 2 * kv_heads_per_rank(MODEL, 1) * MODEL.kv_channels * 2
    gather = all_gather_s(2 * kv_chunk, 2, link, latency)
    # same tokens per rank (dp 2 vs cp 2), so the difference is exactly the exposed K/V traffic
    assert cp2.fwd_layer_s - one.fwd_layer_s == pytest.approx(gather)
    assert cp2.bwd_layer_s - one.bwd_layer_s == pytest.approx(2 * gather)
    assert lc.attention_s > 0 and gather > 0


def test_cp_halves_stored_activations_and_prices_the_backward_gather_as_working_memory():
    cp1 = stage_costs(MODEL, HW, ParallelLayout(tp=2), 1, HARDWARE).memory_parts
    cp2 = stage_costs(MODEL, HW, ParallelLayout(cp=2), 1, HARDWARE).memory_parts
    tokens = MODEL.seq_length
    assert cp2.stored["none"] == pytest.approx(activation_bytes(MODEL, tokens=tokens / 2, tp=1, sp=False,
                                                                recompute="none", dtype_bytes=2))
    extra = context_parallel_working_bytes(MODEL, tokens=tokens / 2, tp=1, cp=2, dtype_bytes=2)
    assert extra == 2 * tokens * MODEL.num_attention_heads * MODEL.kv_channels * (2 + 4)
    assert cp2.working["none"] == pytest.approx(extra)
    assert context_parallel_working_bytes(MODEL, tokens=tokens, tp=1, cp=1, dtype_bytes=2) == 0
    assert cp1.working["none"] == 0


def test_cp_gradients_are_all_reduced_in_the_tail():
    one = stage_costs(MODEL, HW, ParallelLayout(dp=2), 2, HARDWARE)
    base = stage_costs(MODEL, StageHardware(device=A100, num_devices=1, num_nodes=1, node_count=8),
                       ParallelLayout(), 2, HARDWARE)
    cp2 = stage_costs(MODEL, HW, ParallelLayout(cp=2), 2, HARDWARE)
    link, latency = A100.tp_link()
    grad_bytes = GRAD_REDUCE_BYTES  # the fp32 gradient buffer, as the runtime sums it over cp
    assert cp2.tail_per_param_s - base.tail_per_param_s == pytest.approx(all_reduce_s(grad_bytes, 2, link, 0.0))
    assert cp2.tail_const_s - base.tail_const_s == pytest.approx(2 * latency)
    assert one.tail_per_param_s > base.tail_per_param_s  # dp 2 reduces too, on its own link


def test_zero3_under_cp_is_priced_as_sharded_over_cp_times_dp():
    # `models.zero3` shards over the stage's cp x dp ranks: its state is that of ZeRO-3 over 4 dp ranks, and the
    # cp sum of the tail is its reduce-scatter (in the backward), not a separate all-reduce.
    hw4 = StageHardware(device=A100, num_devices=4, num_nodes=1, node_count=8)
    cp2dp2 = stage_costs(MODEL, hw4, ParallelLayout(cp=2, dp=2, zero=3), 4, HARDWARE)
    dp4 = stage_costs(MODEL, hw4, ParallelLayout(dp=4, zero=3), 4, HARDWARE)
    cp2dp2_z1 = stage_costs(MODEL, hw4, ParallelLayout(cp=2, dp=2, zero=1), 4, HARDWARE)
    for part in ("weights", "gradients", "optimizer"):
        assert getattr(cp2dp2.memory, part) == getattr(dp4.memory, part), part
    assert cp2dp2.memory.optimizer.per_layer == pytest.approx(dp4.memory.optimizer.per_layer)
    assert cp2dp2.memory.optimizer.per_layer < cp2dp2_z1.memory.optimizer.per_layer / 1.5  # z1: dp 2 only
    assert cp2dp2.tail_per_param_s == pytest.approx(dp4.tail_per_param_s)
    assert cp2dp2.tail_const_s == pytest.approx(dp4.tail_const_s)
    assert cp2dp2_z1.tail_const_s > dp4.tail_const_s  # ZeRO-1 under cp still all-reduces over cp in the tail
