"""The planner prices a MoE block's compute at its active experts (plus the router) and its memory at all of the
experts a rank holds, through the per-rank counts in layout/shards.py that the runtime uses too (expert
parallelism: `test_moe_ep_pricing.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.config.moe import MoESpec
from heteroflow.layout.shards import active_ffn_width, layer_params_per_rank, local_experts
from heteroflow.models.llama import build_stage_model
from heteroflow.stagemap.compute import layer_forward, model_flops_per_sample
from heteroflow.stagemap.hardware import device_model
from heteroflow.stagemap.memory import activation_bytes

A100 = device_model(CATALOG["nvidia-a100-80g"], "bf16")
DENSE = replace(PRESETS["micro-llama"], num_layers=1)
MOE = MoESpec(num_experts=8, top_k=2, ffn_hidden_size=96, shared_expert_ffn_hidden_size=64, shared_expert_gate=True)
SPARSE = replace(DENSE, moe=MOE)


def test_memory_counts_every_expert_as_the_model_holds_them():
    model = build_stage_model(SPARSE, first_layer=0, last_layer=1, is_first=False, is_last=False)
    assert layer_params_per_rank(SPARSE, 1) == sum(p.numel() for p in model.parameters())
    h = SPARSE.hidden_size
    assert layer_params_per_rank(SPARSE, 2) - layer_params_per_rank(DENSE, 2) == pytest.approx(
        3 * h * (8 * 96 + 64) / 2 + 8 * h + h - 3 * h * DENSE.ffn_hidden_size / 2)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_gelu_experts_are_priced_as_the_model_holds_them(ep):
    """GELU experts and shared expert (fc1 / fc2: two matrices each) per rank: the built block's parameters with
    the experts an ep rank keeps (`local_experts`, as the parallelization keeps them)."""
    gelu = replace(SPARSE, activation="gelu")
    model = build_stage_model(gelu, first_layer=0, last_layer=1, is_first=False, is_last=False)
    kept = {f"layers.0.mlp.experts.{j}." for j in local_experts(MOE.num_experts, ep, 0)}
    held = sum(p.numel() for name, p in model.named_parameters()
               if ".experts." not in name or any(name.startswith(prefix) for prefix in kept))
    assert layer_params_per_rank(gelu, 1, ep=ep) == held
    assert model.layers["0"].mlp.experts["0"].w3 is None and model.layers["0"].mlp.shared_expert.w3 is None
    h = gelu.hidden_size
    assert layer_params_per_rank(SPARSE, 1, ep=ep) - layer_params_per_rank(gelu, 1, ep=ep) == h * (8 // ep * 96 + 64)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_compute_and_activations_follow_the_active_experts(activation):
    active = replace(DENSE, ffn_hidden_size=2 * 96 + 64, activation=activation)  # as wide as one token's experts
    sparse_spec = replace(SPARSE, activation=activation)
    assert active_ffn_width(sparse_spec) == 256
    # At a rate independent of the GEMM shapes, the experts cost what the active width does; the router adds its
    # h x num_experts GEMM on every token.
    flat = replace(A100, eff_half_dim=0.0, hbm_gb_per_s=1e9)
    rate = flat.peak_tflops * flat.eff_max * 1e12
    for tp in (1, 2):
        sparse = layer_forward(sparse_spec, flat, tokens=512, tp=tp, sp=False, dtype_bytes=2)
        dense = layer_forward(active, flat, tokens=512, tp=tp, sp=False, dtype_bytes=2)
        assert sparse.gemm_s - dense.gemm_s == pytest.approx(2 * 512 * 8 * sparse_spec.hidden_size / rate)
        assert sparse.elementwise_s > dense.elementwise_s  # router scores and the token permutation
        # activations: the active width's, plus the routing (`routing_bytes`: fp32 scores, pair rows, indices)
        assert activation_bytes(sparse_spec, tokens=512, tp=tp, sp=False, recompute="none", dtype_bytes=2) == \
            activation_bytes(active, tokens=512, tp=tp, sp=False, recompute="none", dtype_bytes=2) + \
            512 * 8 * 4 + 512 * MOE.top_k * (2 * sparse_spec.hidden_size * 2 + 16)
    assert model_flops_per_sample(sparse_spec) == model_flops_per_sample(active)


def test_dense_first_layers_price_the_costlier_kind():
    narrow = replace(SPARSE, ffn_hidden_size=1000, moe=replace(MOE, first_dense_layers=1))
    assert active_ffn_width(narrow) == 1000
    # 3 * h * 1000 dense weights outnumber the 3 * h * (8 * 96 + 64) + 9 * h of the MoE block here.
    assert layer_params_per_rank(narrow, 1) == layer_params_per_rank(replace(narrow, moe=None), 1)
    wide = replace(narrow, ffn_hidden_size=100)
    assert layer_params_per_rank(wide, 1) == layer_params_per_rank(SPARSE, 1)
