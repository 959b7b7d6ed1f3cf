"""The planner prices the gradient accumulation the runtime runs after every micro-batch's backward: the on-device
optimizers (`models.data_parallel.DataParallelAdamW`) add each parameter's gradient, in the parameters' dtype,
into their fp32 gradient buffer (read it, read and write the buffer); the profile's block timings run under
those hooks, so their fixed cost is in the measured block overhead."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.config.model import ModelSpec
from heteroflow.layout import GRAD_REDUCE_BYTES, OffloadSpec, ParallelLayout
from heteroflow.layout.shards import embedding_params_per_rank, layer_params_per_rank
from heteroflow.measure.thread import _block_seconds
from heteroflow.models.llama import Block
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


def test_zero1_accumulates_as_zero0_and_the_term_follows_the_calibrated_memory_rate():
    zero0 = stage_costs(MODEL, HW, ParallelLayout(dp=2), 2, HARDWARE)
    zero1 = stage_costs(MODEL, HW, ParallelLayout(dp=2, zero=1), 2, HARDWARE)
    assert zero1.bwd_layer_s == pytest.approx(zero0.bwd_layer_s)
    slow = replace(A100, hbm_gb_per_s=A100.hbm_gb_per_s / 2)  # what a calibration's `memory` factor changes
    assert grad_accumulate_s(1e9, slow, weight_bytes=2) == pytest.approx(2 * grad_accumulate_s(1e9, A100, weight_bytes=2))


def test_the_profile_times_blocks_with_the_runtime_s_gradient_hooks():
    spec = ModelSpec(num_layers=1, hidden_size=16, ffn_hidden_size=16, num_attention_heads=2, num_kv_heads=1,
                     vocab_size=16, seq_length=4)
    blocks = torch.nn.Sequential(Block(spec), Block(spec))
    forward_s, backward_s = _block_seconds(torch, blocks, (1, 4, 16), budget_s=0.005)
    assert forward_s > 0 and backward_s > 0
    # The gradients went into the runtime optimizer's fp32 buffer, none was left on a parameter.
    buffer = blocks.gradient_buffer
    assert buffer.main_grad.dtype == torch.float32 and buffer.main_grad.abs().sum() > 0
    assert all(p.grad is None for p in blocks.parameters())
