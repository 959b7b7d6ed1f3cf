"""The MoE layer's routing and capacity rules, checked against direct computations."""

from __future__ import annotations

import math

import torch

from heteroflow.config.moe import MoESpec
from heteroflow.models.moe import MoE

H = 16


def layer(**fields) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, MoESpec(**{"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8, **fields}))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.5)
    return moe


def test_output_is_the_weighted_sum_of_the_chosen_experts():
    moe = layer()
    x = torch.randn(5, H)
    routing = moe.router(x)
    scores = torch.softmax(x @ moe.router.weight.T, dim=-1)
    top, idx = scores.topk(2, dim=-1)
    torch.testing.assert_close(routing.weights_TK, top / top.sum(-1, keepdim=True))
    want = torch.stack([sum(w * moe.experts[str(int(j))](x[t]) for w, j in zip(routing.weights_TK[t], idx[t]))
                        for t in range(5)])
    torch.testing.assert_close(moe(x[None]).squeeze(0), want)


def test_sigmoid_scores_are_normalised_over_the_top_k():
    moe = layer(score_function="sigmoid", normalize_top_k=False)
    routing = moe.router(torch.randn(7, H))
    torch.testing.assert_close(routing.weights_TK.sum(-1), torch.ones(7))


def test_capacity_keeps_the_earliest_tokens_of_each_expert():
    dropless, capped = layer(), layer(capacity_factor=0.5)
    x = torch.randn(12, H)
    routing = dropless.router(x)
    capacity = math.ceil(0.5 * 12 * 2 / 4)
    assert capped.experts.capacity(12) == capacity
    kept = torch.zeros(12, 2, dtype=torch.bool)
    for j in range(4):
        token, slot = torch.where(routing.indices_TK == j)
        kept[token[:capacity], slot[:capacity]] = True
    assert not kept.all()  # something was dropped
    weights = routing.weights_TK * kept
    torch.testing.assert_close(capped(x[None]).squeeze(0),
                               dropless.experts(x, weights, routing.indices_TK))
