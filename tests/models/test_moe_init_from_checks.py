"""`train.init_from` on MoE checkpoints: config.json maps to `model.moe`, and a job that disagrees with it,
or a layer pattern heteroflow cannot represent, is refused with `path: message` lines."""

from __future__ import annotations

import json

import pytest

from heteroflow.config import parse_job
from heteroflow.errors import ConfigError, UserError
from heteroflow.models.hf_checkpoint import check_init_from, hf_name, model_spec_from_hf_config

QWEN2_MOE = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 172,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 32,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
             "decoder_sparse_step": 1, "mlp_only_layers": [0], "router_aux_loss_coef": 0.001}
MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "normalize_top_k": False,
       "shared_expert_ffn_hidden_size": 48, "shared_expert_gate": True, "first_dense_layers": 1}


def job(tmp_path, moe, config=QWEN2_MOE):
    directory = tmp_path / "ckpt"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")
    return parse_job({"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 1}]},
                      "model": {"preset": "micro-llama", "qkv_bias": True, "moe": moe},
                      "train": {"global_batch_size": 2, "steps": 1, "init_from": str(directory)},
                      "plan": {"micro_batch_size": 1, "stages": [{"devices": ["a"], "layers": 4}]}})


def test_qwen2_moe_config_maps_to_the_job_model(tmp_path):
    spec = model_spec_from_hf_config(QWEN2_MOE)
    assert spec.moe.first_dense_layers == 1 and spec.moe.shared_expert_gate and spec.qkv_bias
    # The aux coefficient and capacity are training choices: a job may set its own.
    check_init_from(job(tmp_path, {**MOE, "aux_loss_coeff": 0.5, "capacity_factor": 2.0}))


def test_a_job_that_disagrees_with_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_init_from(job(tmp_path, {**MOE, "top_k": 1, "normalize_top_k": True}))
    lines = [str(p) for p in info.value.problems]
    assert any("model.moe.top_k is 1 but config.json says num_experts_per_tok = 2; set model.moe.top_k: 2" in line
               for line in lines), lines
    assert any("model.moe.normalize_top_k is True but config.json says norm_topk_prob = False" in line
               for line in lines), lines
    assert all(line.startswith("train.init_from: ") for line in lines)


def test_dense_job_on_a_moe_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_init_from(job(tmp_path, None))
    assert any("describes a mixture-of-experts model" in str(p) for p in info.value.problems)


def test_unrepresentable_layer_pattern_is_refused(tmp_path):
    with pytest.raises(UserError, match="decoder_sparse_step 2"):
        check_init_from(job(tmp_path, MOE, {**QWEN2_MOE, "decoder_sparse_step": 2}))
    with pytest.raises(UserError, match="router_jitter_noise"):
        model_spec_from_hf_config({**QWEN2_MOE, "model_type": "mixtral", "num_local_experts": 4,
                                   "router_jitter_noise": 0.1})


@pytest.mark.parametrize("ours,model_type,theirs", [
    ("layers.2.mlp.router.weight", "mixtral", "model.layers.2.block_sparse_moe.gate.weight"),
    ("layers.2.mlp.experts.7.w3.weight", "mixtral", "model.layers.2.block_sparse_moe.experts.7.w3.weight"),
    ("layers.0.mlp.router.weight", "qwen3_moe", "model.layers.0.mlp.gate.weight"),
    ("layers.0.mlp.experts.11.w1.weight", "qwen3_moe", "model.layers.0.mlp.experts.11.gate_proj.weight"),
    ("layers.1.mlp.shared_expert.w2.weight", "qwen2_moe", "model.layers.1.mlp.shared_expert.down_proj.weight"),
    ("layers.1.mlp.shared_expert_gate.weight", "qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight"),
    ("layers.0.mlp.w1.weight", "qwen2_moe", "model.layers.0.mlp.gate_proj.weight"),  # a dense layer
])
def test_hugging_face_names(ours, model_type, theirs):
    assert hf_name(ours, model_type) == theirs
