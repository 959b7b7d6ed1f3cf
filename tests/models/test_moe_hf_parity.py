"""Tiny random Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints made by `transformers` load with `init_from`
and give transformers' loss (one device); the per-layer aux loss equals transformers' router aux loss."""

from __future__ import annotations

import pytest
import torch

from heteroflow.models.hf_checkpoint import HFCheckpoint, load_hf_weights
from heteroflow.models.llama import build_stage_model
from heteroflow.models.moe import moe_layers, take_aux_losses

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)


def make_checkpoint(kind: str, path, **extra):
    """A random tiny model of `kind` saved as safetensors; returns the transformers model (fp32, eval)."""
    torch.manual_seed(7)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                            router_aux_loss_coef=0.02, **extra)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=36, norm_topk_prob=False,
                                             router_aux_loss_coef=0.01, **extra)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**SHAPE, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                             norm_topk_prob=True, router_aux_loss_coef=0.001, **extra)
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # transformers zero-initializes some routers; random ones route unevenly
        for name, param in model.named_parameters():
            if "gate" in name and param.dim() == 2 and param.shape[1] == SHAPE["hidden_size"]:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model.float().eval()


@pytest.mark.parametrize("kind,extra", [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}),
                                        ("qwen2_moe", {"mlp_only_layers": [0]})])
def test_first_step_loss_matches_transformers(tmp_path, kind, extra):
    hf = make_checkpoint(kind, tmp_path / kind, **extra)
    spec = HFCheckpoint(tmp_path / kind, seq_length=16).spec
    assert spec.moe is not None and spec.moe.first_dense_layers == len(extra.get("mlp_only_layers", []))
    if kind == "qwen2_moe":
        assert spec.moe.shared_expert_gate and not spec.moe.normalize_top_k and spec.qkv_bias
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    load_hf_weights(model, tmp_path / kind)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, dims=1)
    loss = model(tokens, labels=labels) / labels.numel()
    loss.backward()
    with torch.no_grad():
        out = hf(input_ids=tokens, output_router_logits=True)
    direct = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    assert loss.item() == pytest.approx(direct.item(), rel=1e-5)
    # Aux loss, layer by layer (transformers pools all layers into one figure: compare one layer at a time).
    aux_fn = getattr(transformers.models, "mixtral" if kind == "mixtral" else kind).__dict__[
        f"modeling_{kind}"].load_balancing_loss_func
    layers = moe_layers(model)
    ours = [layer.aux_losses[0].item() for layer in layers]
    theirs = [aux_fn((logits,), spec.moe.num_experts, spec.moe.top_k).item() for logits in out.router_logits]
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert take_aux_losses(model).item() == pytest.approx(sum(theirs), rel=1e-5)
    assert all(not layer.aux_losses for layer in layers)


def test_aux_loss_gradient_is_coeff_times_its_gradient(tmp_path):
    """The router's gradient from the aux term equals coeff * d(aux)/d(router) computed directly."""
    make_checkpoint("mixtral", tmp_path / "m")
    spec = HFCheckpoint(tmp_path / "m", seq_length=16).spec
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(5))
    grads = {}
    for coeff in (0.0, 0.5):
        model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
        load_hf_weights(model, tmp_path / "m")
        for layer in moe_layers(model):
            layer.aux_loss_coeff = coeff
        model(tokens, labels=tokens).backward()
        grads[coeff] = model.layers["1"].mlp.router.weight.grad.clone()
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    load_hf_weights(model, tmp_path / "m")
    with torch.no_grad():
        h = model.embed(tokens)
        h = model.layers["0"](h)
        block = model.layers["1"]
        h = h + block.attn(block.attn_norm(h))
        x = block.mlp_norm(h).reshape(-1, SHAPE["hidden_size"])
    routing = block.mlp.router(x)
    routing.aux_loss.backward()
    assert torch.allclose(grads[0.5] - grads[0.0], 0.5 * block.mlp.router.weight.grad, atol=1e-6)
