"""train.init_from: Hugging Face checkpoints load exactly (transformers as the independent reference)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from heteroflow.config import PRESETS
from heteroflow.errors import ConfigError, UserError
from heteroflow.models import HFCheckpoint, build_stage_model, init_weights, load_hf_weights, model_spec_from_hf_config
from heteroflow.models.hf_checkpoint import check_against, hf_config_from_spec, read_hf_config, write_hf_checkpoint

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-6, max_position_embeddings=64)


def _hf_model(kind: str, tie: bool, path):
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[kind]
    torch.manual_seed(0)
    extra = {"head_dim": 12} if kind == "qwen3" else {}
    config = getattr(transformers, config_cls)(tie_word_embeddings=tie, **TINY, **extra)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # Hugging Face starts norms at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.eval().save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("kind,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_logits_and_first_step_loss_match_transformers(kind, tie, tmp_path):
    reference = _hf_model(kind, tie, tmp_path)
    ckpt = HFCheckpoint(tmp_path, seq_length=16)
    assert (ckpt.spec.tie_embeddings, ckpt.spec.qkv_bias, ckpt.spec.qk_norm) == (tie, kind == "qwen2", kind == "qwen3")
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = reference(ids, labels=ids)

    whole = build_stage_model(ckpt.spec, first_layer=0, last_layer=2, is_first=True, is_last=True)
    load_hf_weights(whole, tmp_path, job_spec=ckpt.spec)
    with torch.no_grad():
        torch.testing.assert_close(whole(ids), out.logits, rtol=1e-5, atol=1e-5)

    # The same loss through two stages, each reading only its own tensors.
    first = build_stage_model(ckpt.spec, first_layer=0, last_layer=1, is_first=True, is_last=False)
    last = build_stage_model(ckpt.spec, first_layer=1, last_layer=2, is_first=False, is_last=True)
    assert not any(n.startswith(("layers.1", "norm", "head")) for n in ckpt.load_into(first))
    assert "embed.weight" not in ckpt.load_into(last)
    with torch.no_grad():
        loss_sum = last(first(ids[:, :-1]), ids[:, 1:])
    torch.testing.assert_close(loss_sum / ids[:, 1:].numel(), out.loss, rtol=1e-5, atol=1e-6)


def test_round_trip_through_a_sharded_checkpoint(tmp_path):
    spec = replace(PRESETS["micro-llama"], num_layers=2, qk_norm=True)
    source = build_stage_model(spec, first_layer=0, last_layer=2, is_first=True, is_last=True)
    init_weights(source, seed=1)
    write_hf_checkpoint(source.state_dict(), spec, tmp_path, model_type="qwen3", num_shards=3)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == \
        len(source.state_dict())
    target = build_stage_model(spec, first_layer=0, last_layer=2, is_first=True, is_last=True)
    init_weights(target, seed=2)
    load_hf_weights(target, tmp_path)
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name


def test_job_fields_that_contradict_config_json_are_each_reported(tmp_path):
    spec = PRESETS["micro-llama"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_spec(spec)))
    job = replace(spec, num_layers=6, rope_theta=500000.0, tie_embeddings=True, seq_length=4096)
    with pytest.raises(ConfigError) as err:
        check_against(job, model_spec_from_hf_config(read_hf_config(tmp_path)), ckpt_dir=str(tmp_path))
    lines = str(err.value).splitlines()
    assert len(lines) == 3  # seq_length is a training choice, not checked
    assert lines[0] == (f"train.init_from: {tmp_path}: model.num_layers is 6 but config.json says "
                        "num_hidden_layers = 4; set model.num_layers: 4")
    assert "model.rope_theta is 500000.0 but config.json says rope_theta = 10000.0" in lines[1]
    assert "model.tie_embeddings is True" in lines[2]


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope scaling 'llama3'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
])
def test_unsupported_configs_are_user_errors(change, message):
    config = {**hf_config_from_spec(PRESETS["micro-llama"]), **change}
    with pytest.raises(UserError, match=message):
        model_spec_from_hf_config(config)


def test_missing_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="config.json not found"):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_spec(PRESETS["micro-llama"])))
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(UserError, match="no \\*.safetensors"):
        HFCheckpoint(tmp_path)
