"""Seed-only initialization: identical weights for the same names under any split (tp: test_tp_stage.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from heteroflow.config import PRESETS
from heteroflow.layout import ParallelLayout
from heteroflow.models import build_stage_model, init_weights, materialize, parallelize_stage
from heteroflow.models.init import full_init_value, param_seed

SPEC = replace(PRESETS["micro-llama"], num_layers=4, tie_embeddings=True)


def weights(first, last, seed=5, **kw):
    model = build_stage_model(SPEC, first_layer=first, last_layer=last, is_first=first == 0, is_last=last == 4)
    init_weights(model, seed=seed, **kw)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_same_seed_same_weights_under_every_layer_split():
    full = weights(0, 4)
    for splits in ([0, 1, 4], [0, 2, 3, 4], [0, 3, 4]):
        for a, b in zip(splits, splits[1:]):
            for name, value in weights(a, b).items():
                reference = full["embed.weight"] if name == "head.weight" else full[name]
                torch.testing.assert_close(value, reference, rtol=0, atol=0, msg=name)


def test_values_follow_the_llama_recipe_and_the_seed():
    w = weights(0, 4)
    assert torch.equal(w["layers.1.attn_norm.weight"], torch.ones(64))
    assert abs(w["layers.0.attn.wq.weight"].std().item() - 0.02) < 0.002
    assert not torch.equal(w["layers.0.attn.wq.weight"], w["layers.1.attn.wq.weight"])
    assert not torch.equal(weights(0, 4, seed=6)["embed.weight"], w["embed.weight"])
    scaled = weights(0, 4, scaled_output=True)
    ratio = scaled["layers.0.mlp.w2.weight"].std() / w["layers.0.mlp.w2.weight"].std()
    assert abs(ratio.item() - 1 / (2 * 4) ** 0.5) < 1e-3


def test_seed_hash_is_stable_across_processes_and_versions():
    # Pinned: changing the scheme would silently change every run's initial weights.
    assert param_seed(1234, "layers.0.attn.wq.weight") == param_seed(1234, "layers.0.attn.wq.weight")
    assert param_seed(1234, "embed.weight") == 4394049756591389530
    assert torch.equal(full_init_value("layers.0.attn.wq.bias", (4,), seed=1, num_layers=2), torch.zeros(4))


def test_meta_build_then_materialize_keeps_ties_and_gives_the_same_weights():
    with torch.device("meta"):
        model = build_stage_model(SPEC, first_layer=0, last_layer=4, is_first=True, is_last=True)
    parallelize_stage(model, layout=ParallelLayout(recompute="full"))
    materialize(model, "cpu")
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "cpu"
    init_weights(model, seed=5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, weights(0, 4)[name], rtol=0, atol=0, msg=name)
