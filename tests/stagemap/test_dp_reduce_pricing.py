"""The dp gradient reduction is priced as the runtime runs it: the fp32 gradient buffer (`GRAD_REDUCE_BYTES` per
element, in every precision), all-reduced under ZeRO 0 and reduce-scattered after the flush under ZeRO 1 and 2."""

from __future__ import annotations

import pytest

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.layout import GRAD_REDUCE_BYTES, ParallelLayout
from heteroflow.layout.shards import layer_params_per_rank
from heteroflow.stagemap.comm import all_gather_s, all_reduce_s
from heteroflow.stagemap.costs import StageHardware, stage_costs
from heteroflow.stagemap.hardware import Hardware, device_model

MODEL = PRESETS["llama2-7b"]
HARDWARE = Hardware(models={}, inter_node_gb_per_s=25)


def _parts(precision: str, layout: ParallelLayout, layers: int = 4):
    device = device_model(CATALOG["nvidia-a100-80g"], precision)
    hw = StageHardware(device=device, num_devices=layout.num_devices, num_nodes=1, node_count=8)
    costs = stage_costs(MODEL, hw, layout, 8, HARDWARE)
    return costs, costs.parts(layers, False, False), device


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_the_dp_all_reduce_sends_the_fp32_buffer_in_every_precision(precision):
    costs, parts, device = _parts(precision, ParallelLayout(tp=2, dp=4))
    gb_per_s, latency_s = device.collective_link()
    grads = 4 * layer_params_per_rank(MODEL, 2) * GRAD_REDUCE_BYTES
    assert parts.dp_s == pytest.approx(all_reduce_s(grads, 4, gb_per_s, latency_s), rel=1e-9)
    assert GRAD_REDUCE_BYTES == 4  # the runtime's `main_grad` is fp32 (`models.data_parallel`)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_reduce_scatter_after_the_flush_alike(zero):
    _, parts, device = _parts("bf16", ParallelLayout(tp=1, dp=8, zero=zero))
    gb_per_s, latency_s = device.collective_link()
    grads = 4 * layer_params_per_rank(MODEL, 1) * GRAD_REDUCE_BYTES
    assert parts.dp_s == pytest.approx(all_gather_s(grads, 8, gb_per_s, latency_s), rel=1e-9)


def test_zero_2_is_priced_as_zero_1_in_time_and_memory():
    """The runtime's ZeRO 2 keeps the whole gradient buffer and reduces it once after the flush, as ZeRO 1."""
    one, p1, _ = _parts("bf16", ParallelLayout(tp=2, dp=4, zero=1))
    two, p2, _ = _parts("bf16", ParallelLayout(tp=2, dp=4, zero=2))
    assert p1 == p2
    assert one.memory_bytes(4, 2, False, False) == two.memory_bytes(4, 2, False, False)
