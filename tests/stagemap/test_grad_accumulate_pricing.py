"""The planner prices the gradient accumulation the runtime runs after every micro-batch's backward: the on-device
optimizers (`models.data_parallel.DataParallelAdamW`) add each parameter's gradient, in the parameters' dtype,
into their fp32 gradient buffer (read it, read and write the buffer). (`tests/measure/test_runtime_hooks_timed.py`:
the profile's block timings run under those hooks, so their fixed cost is in the measured block overhead.)"""

from __future__ import annotations

import pytest

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.layout import GRAD_REDUCE_BYTES, OffloadSpec, ParallelLayout
from heteroflow.layout.shards import embedding_params_per_rank, layer_params_per_rank
from heteroflow.stagemap.calibration import DeviceFactors, apply_factors
from heteroflow.stagemap.compute import grad_accumulate_s
from heteroflow.stagemap.costs import StageHardware, stage_costs
from heteroflow.stagemap.hardware import Hardware, device_model

MODEL = PRESETS["llama2-7b"]
A100 = device_model(CATALOG["nvidia-a100-80g"], "bf16")
HW = StageHardware(device=A100, num_devices=2, num_nodes=1, node_count=8)
HARDWARE = Hardware(models={}, inter_node_gb_per_s=25)


def test_each_backward_adds_the_gradients_into_the_fp32_buffer_at_memory_bandwidth():
    on_device = stage_costs(MODEL, HW, ParallelLayout(tp=2), 1, HARDWARE)
    on_host = stage_costs(MODEL, HW, ParallelLayout(tp=2, offload=OffloadSpec(optimizer="cpu")), 1, HARDWARE)
    params = layer_params_per_rank(MODEL, 2)
    per_block = params * (2 + 2 * GRAD_REDUCE_BYTES) / (A100.hbm_gb_per_s * 1e9)  # bf16 gradient, fp32 buffer
    assert grad_accumulate_s(params, A100, weight_bytes=2) == pytest.approx(per_block)
    # The offloaded optimizer adds its gradients on the host instead: the block's backward differs by exactly that.
    assert on_device.bwd_layer_s - on_host.bwd_layer_s == pytest.approx(per_block)
    assert on_device.fwd_layer_s == pytest.approx(on_host.fwd_layer_s)
    embedding = grad_accumulate_s(embedding_params_per_rank(MODEL, 2), A100, weight_bytes=2)
    assert on_device.bwd_first_s - on_host.bwd_first_s == pytest.approx(embedding)


def test_zero1_accumulates_as_zero0_and_the_calibrated_memory_rate_sets_its_price():
    params = layer_params_per_rank(MODEL, 1)
    on_host = OffloadSpec(optimizer="cpu")
    for device in (A100, apply_factors(A100, DeviceFactors(memory=0.5))):  # a calibration's memory factor
        hw = StageHardware(device=device, num_devices=2, num_nodes=1, node_count=8)
        added = grad_accumulate_s(params, device, weight_bytes=2)
        assert added == pytest.approx(params * (2 + 2 * GRAD_REDUCE_BYTES) / (device.hbm_gb_per_s * 1e9))
        for zero in (0, 1, 2):  # every ZeRO stage that keeps the fp32 gradient buffer on the device
            accumulating = stage_costs(MODEL, hw, ParallelLayout(dp=2, zero=zero), 2, HARDWARE)
            offloaded = stage_costs(MODEL, hw, ParallelLayout(dp=2, zero=zero, offload=on_host), 2, HARDWARE)
            assert accumulating.bwd_layer_s - offloaded.bwd_layer_s == pytest.approx(added)
    slow = apply_factors(A100, DeviceFactors(memory=0.5))
    assert grad_accumulate_s(params, slow, weight_bytes=2) == pytest.approx(2 * grad_accumulate_s(params, A100,
                                                                                                   weight_bytes=2))
