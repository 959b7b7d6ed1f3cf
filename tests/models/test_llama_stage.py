"""Stage models: split equivalence, names, loss, recompute, tied embeddings (single process)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from heteroflow.config import PRESETS
from heteroflow.layout import ParallelLayout
from heteroflow.models import build_stage_model, init_weights, parallelize_stage, tied_parameter_names
from heteroflow.models.llama import IGNORE_INDEX

BASE = replace(PRESETS["micro-llama"], num_layers=3)
VARIANTS = {
    "llama": BASE,
    "qwen-like tied": replace(BASE, qkv_bias=True, qk_norm=True, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6),
    "gpt-like": replace(BASE, activation="gelu", normalization="layernorm", position_embedding="learned"),
    "mha head_dim": replace(BASE, num_kv_heads=4, head_dim=8),
}


def stage(spec, first, last, seed=11, recompute="none"):
    model = build_stage_model(spec, first_layer=first, last_layer=last, is_first=first == 0,
                              is_last=last == spec.num_layers)
    init_weights(model, seed=seed)
    if recompute != "none":
        parallelize_stage(model, layout=ParallelLayout(recompute=recompute))
    return model


def batch(spec, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (n, spec.seq_length + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("split", [1, 2])
def test_split_stages_equal_full_model_forward_and_backward(variant, split):
    spec = VARIANTS[variant]
    ids, labels = batch(spec)
    full = stage(spec, 0, spec.num_layers)
    loss = full(ids, labels)
    loss.backward()

    first, last = stage(spec, 0, split), stage(spec, split, spec.num_layers)
    hidden = first(ids)
    received = hidden.detach().requires_grad_()
    split_loss = last(received, labels)
    split_loss.backward()
    hidden.backward(received.grad)  # what the pipeline does with the gradient it receives

    torch.testing.assert_close(split_loss, loss, rtol=1e-6, atol=1e-6)
    expected = grads(full)
    got = {**grads(first), **grads(last)}
    if spec.tie_embeddings:  # the two copies' gradients sum to the single tied parameter's
        got["embed.weight"] = got["embed.weight"] + got.pop("head.weight")
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_parameter_names_are_global_and_plan_independent():
    spec = VARIANTS["gpt-like"]
    full_names = set(stage(spec, 0, 3).state_dict())
    middle = build_stage_model(spec, first_layer=1, last_layer=2, is_first=False, is_last=False)
    assert set(middle.state_dict()) == {n for n in full_names if n.startswith("layers.1.")}
    assert {"embed.weight", "pos_embed.weight", "layers.0.attn.wq.weight", "layers.2.mlp.w2.weight",
            "layers.2.mlp_norm.bias", "norm.weight", "head.weight"} <= full_names
    assert "layers.0.mlp.w3.weight" not in full_names  # gelu has two matrices


def test_loss_sum_is_fp32_sum_of_token_losses_and_ignores_masked_labels():
    spec = VARIANTS["llama"]
    model = stage(spec, 0, spec.num_layers)
    ids, labels = batch(spec)
    labels[0, :5] = IGNORE_INDEX
    with torch.no_grad():
        logits = model(ids)
        loss = model(ids, labels)
    assert logits.shape == (3, spec.seq_length, spec.vocab_size) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_identical_results(recompute):
    spec = VARIANTS["qwen-like tied"]
    ids, labels = batch(spec)
    plain, ckpt = stage(spec, 0, 3), stage(spec, 0, 3, recompute=recompute)
    assert set(dict(ckpt.named_parameters())) == set(dict(plain.named_parameters()))  # names survive
    plain(ids, labels).backward()
    ckpt(ids, labels).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_tied_embeddings_api():
    spec = VARIANTS["qwen-like tied"]
    single = build_stage_model(spec, first_layer=0, last_layer=3, is_first=True, is_last=True)
    assert single.head.weight is single.embed.weight and single.tied_parameter_names() == ()
    assert tied_parameter_names(spec, is_first=True, is_last=False) == ("embed.weight",)
    assert tied_parameter_names(spec, is_first=False, is_last=True) == ("head.weight",)
    assert tied_parameter_names(BASE, is_first=True, is_last=False) == ()
    first, last = stage(spec, 0, 1), stage(spec, 1, 3)
    torch.testing.assert_close(first.embed.weight, last.head.weight, rtol=0, atol=0)  # copies start equal


def test_bad_stage_bounds_are_rejected():
    with pytest.raises(ValueError, match="cannot hold the embedding"):
        build_stage_model(BASE, first_layer=1, last_layer=3, is_first=True, is_last=True)
    with pytest.raises(ValueError, match="tp group"):
        parallelize_stage(stage(BASE, 0, 3), layout=ParallelLayout(tp=2))


def test_rope_tables_are_built_once_per_stage_and_saved_once():
    """Every block and micro-batch of a stage rotates with the same cached cos/sin tables: autograd saves two table
    storages per stage (what `stagemap.memory.rope_table_bytes` prices), equal to freshly built ones."""
    from heteroflow.models.llama import rope_tables

    model = stage(BASE, 0, BASE.num_layers)
    assert len({id(block.attn.rope) for block in model.layers.values()}) == 1
    storages = set()

    def pack(t):  # the tables are saved as [seq, 1, head_dim] views
        if t.numel() == BASE.seq_length * BASE.kv_channels and t.shape[-1] == BASE.kv_channels and not t.requires_grad:
            storages.add(t.untyped_storage().data_ptr())
        return t

    x = torch.randint(0, BASE.vocab_size, (2, BASE.seq_length + 1), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(2):  # two micro-batches
            model(x[:, :-1], x[:, 1:]).backward()
    assert len(storages) == 2
    cached = model.layers["0"].attn.rope.get(BASE.seq_length, x.device, torch.float32, None)
    for got, want in zip(cached, rope_tables(BASE.seq_length, BASE.kv_channels, BASE.rope_theta, x.device,
                                             torch.float32)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
