"""`model.moe:` in a job: presets with published shapes, fields over a preset, `null` for dense, errors."""

from __future__ import annotations

import pytest

from conftest import problems
from heteroflow.config import PRESETS, parse_job
from heteroflow.layout import ParallelLayout

CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 8}]}
TRAIN = {"global_batch_size": 16, "micro_batch_size": 2, "precision": "bf16", "steps": 10}
MOE = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 128}


def job(model) -> dict:
    return {"cluster": CLUSTER, "model": model, "train": TRAIN, "plan": "auto"}


def active_params(spec) -> int:
    """Total parameters with each MoE layer's FFN counted at what one token uses."""
    return spec.num_params() - sum(spec.ffn_params(i) - spec.ffn_params(i, active=True)
                                   for i in range(spec.num_layers))


@pytest.mark.parametrize("name,total_b,active_b", [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3)])
def test_moe_presets_have_published_sizes(name, total_b, active_b):
    spec = PRESETS[name]
    assert spec.num_params() / 1e9 == pytest.approx(total_b, abs=0.05)
    assert active_params(spec) / 1e9 == pytest.approx(active_b, abs=0.1)  # model cards round to 0.1B
    assert all(spec.is_moe_layer(i) for i in range(spec.num_layers))


def test_moe_fields_over_a_preset_and_null_for_dense():
    spec = parse_job(job({"preset": "mixtral-8x7b", "moe": {"top_k": 1, "capacity_factor": 1.25}})).model
    assert (spec.moe.top_k, spec.moe.num_experts, spec.moe.capacity_factor) == (1, 8, 1.25)
    assert spec.moe.aux_loss_coeff == 0.02  # the preset's
    assert parse_job(job({"preset": "mixtral-8x7b", "moe": None})).model.moe is None
    assert parse_job(job({"preset": "micro-llama"})).model.moe is None


def test_dense_layers_first_and_by_frequency():
    spec = parse_job(job({"preset": "micro-llama", "num_layers": 6,
                          "moe": {**MOE, "first_dense_layers": 1, "layer_freq": 2}})).model
    assert [i for i in range(6) if spec.is_moe_layer(i)] == [2, 4]


@pytest.mark.parametrize("moe,line", [
    ({**MOE, "top_k": 9}, "model.moe.top_k: 9 is more than num_experts 8"),
    ({"top_k": 2, "ffn_hidden_size": 128}, "model.moe.num_experts: required field is missing"),
    ({**MOE, "topk": 2}, "model.moe.topk:"),
    ({**MOE, "score_function": "relu"}, "model.moe.score_function: must be one of softmax, sigmoid; got 'relu'"),
    ({**MOE, "shared_expert_gate": True}, "model.moe.shared_expert_gate: needs a shared expert"),
    ({**MOE, "aux_loss_coeff": -1}, "model.moe.aux_loss_coeff: must be"),
    ({**MOE, "capacity_factor": 0}, "model.moe.capacity_factor: must be above 0"),
    ({**MOE, "num_experts": 0}, "model.moe.num_experts: must be"),
    ([1, 2], "model.moe: expected a mapping"),
])
def test_moe_errors_name_their_path(moe, line):
    found = problems(job({"preset": "micro-llama", "moe": moe}))
    assert any(p.startswith(line) for p in found), found


def test_gelu_experts_follow_the_model_activation():
    moe = {**MOE, "shared_expert_ffn_hidden_size": 64}
    spec = parse_job(job({"preset": "micro-llama", "activation": "gelu", "moe": moe})).model
    h = spec.hidden_size
    assert spec.ffn_params(0) == 8 * 2 * h * 128 + 2 * h * 64 + 8 * h  # fc1 / fc2 per expert and shared expert
    assert spec.ffn_params(0, active=True) == 2 * 2 * h * 128 + 2 * h * 64 + 8 * h


@pytest.mark.parametrize("moe,line", [
    ({**MOE, "aux_loss_type": "global"}, "model.moe.aux_loss_type: must be one of batch, sequence; got 'global'"),
    ({**MOE, "z_loss_coeff": -1e-3}, "model.moe.z_loss_coeff: must be"),
    ({**MOE, "topk_scaling_factor": 0}, "model.moe.topk_scaling_factor: must be above 0"),
    ({**MOE, "sinkhorn": True}, "model.moe.normalize_top_k: sinkhorn routing weighs the chosen experts"),
    ({**MOE, "sinkhorn": True, "normalize_top_k": False, "aux_loss_coeff": 0.01}, "model.moe.aux_loss_coeff: sinkhorn"),
])
def test_router_option_errors_name_their_path(moe, line):
    found = problems(job({"preset": "micro-llama", "moe": moe}))
    assert any(p.startswith(line) for p in found), found


def test_sequence_aux_loss_runs_without_sp():
    spec = parse_job(job({"preset": "micro-llama", "moe": {**MOE, "aux_loss_type": "sequence"}})).model
    keys = {p.key for p in ParallelLayout(tp=2, sp=True).validate(spec)}
    assert keys == {"sp"}
    assert not ParallelLayout(tp=2, cp=2, ep=2).validate(spec)


def test_layout_rules_for_moe():
    spec = parse_job(job({"preset": "micro-llama", "moe": {**MOE, "ffn_hidden_size": 30}})).model
    keys = {(p.key, p.message) for p in ParallelLayout(tp=4, sp=True).validate(spec)}
    assert ("tp", "tp 4 does not divide model.moe.ffn_hidden_size 30") in keys
    assert not ParallelLayout(tp=2).validate(spec)
    assert not ParallelLayout(tp=2, sp=True, cp=2).validate(spec)  # MoE runs with sp and cp
    # the runtime splits experts over all of tp or none of it, and runs ZeRO-3 / offload without an expert layout
    assert [p.key for p in ParallelLayout(tp=2, dp=2, etp=1, ep=2, zero=3).validate(spec)] == ["ep"]
    assert "etp" in [p.key for p in ParallelLayout(tp=4, dp=1, etp=2).validate(spec)]
