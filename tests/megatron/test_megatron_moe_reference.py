"""The importer's MoE mapping checked against megatron-core's own router code (megatron-core is in the `test`
extra): for the flags a Megatron script gives, the imported `model.moe` sends every token to the same experts
with the same weights as Megatron's `topk_routing_with_score_function`, its aux-loss term (heteroflow's loss
times the imported coefficient) equals Megatron's `switch_load_balancing_loss_func`, and its expert capacity
is Megatron's `get_capacity`."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from heteroflow.models.moe import Experts, Router
from megatron_helpers import import_args

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine and Apex are not installed
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

NUM_EXPERTS, NUM_TOKENS = 8, 512


def _router_and_logits(tmp_path, args: str):
    """heteroflow's router for the imported `model.moe`, fed logits directly (identity weight)."""
    moe = import_args(tmp_path, f"--swiglu --disable-bias-linear --num-experts {NUM_EXPERTS} {args}").job.model.moe
    router = Router(NUM_EXPERTS, moe)
    with torch.no_grad():
        router.weight.copy_(torch.eye(NUM_EXPERTS))
    torch.manual_seed(0)
    return moe, router, torch.randn(NUM_TOKENS, NUM_EXPERTS)


@pytest.mark.parametrize("args, top_k, pre_softmax, score", [
    ("--moe-router-topk 2", 2, False, "softmax"),
    ("--moe-router-topk 2 --moe-router-pre-softmax", 2, True, "softmax"),
    ("--moe-router-topk 1 --moe-router-pre-softmax", 1, True, "softmax"),
    ("--moe-router-topk 3 --moe-router-score-function sigmoid", 3, False, "sigmoid"),
])
def test_imported_router_routes_as_megatron_core(tmp_path, args, top_k, pre_softmax, score):
    _, router, logits = _router_and_logits(tmp_path, args)
    probs, routing_map = moe_utils.topk_routing_with_score_function(logits, top_k, use_pre_softmax=pre_softmax,
                                                                    score_function=score)
    routing = router(logits)
    ours = torch.zeros(NUM_TOKENS, NUM_EXPERTS).scatter(1, routing.indices_TK, routing.weights_TK)
    assert torch.equal(ours != 0, routing_map)
    torch.testing.assert_close(ours, probs.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("args, top_k, score", [
    ("--moe-router-topk 2 --moe-aux-loss-coeff 1e-2", 2, "softmax"),
    ("--moe-router-topk 4 --moe-aux-loss-coeff 3e-2", 4, "softmax"),
    ("--moe-router-topk 3 --moe-router-score-function sigmoid --moe-aux-loss-coeff 1e-3", 3, "sigmoid"),
])
def test_imported_aux_loss_coefficient_gives_megatrons_aux_loss(tmp_path, args, top_k, score):
    moe, router, logits = _router_and_logits(tmp_path, args)
    coeff = float(args.rsplit(" ", 1)[1])
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, top_k, score)
    megatron = moe_utils.switch_load_balancing_loss_func(
        probs=scores, tokens_per_expert=routing_map.sum(dim=0), total_num_tokens=NUM_TOKENS, topk=top_k,
        num_experts=NUM_EXPERTS, moe_aux_loss_coeff=coeff)
    torch.testing.assert_close(router(logits).aux_loss * moe.aux_loss_coeff, megatron, rtol=1e-5, atol=0)


@pytest.mark.parametrize("factor, top_k", [(1.0, 2), (1.25, 2), (0.5, 3)])
def test_imported_capacity_is_megatrons(tmp_path, factor, top_k):
    moe, _, logits = _router_and_logits(tmp_path, f"--moe-router-topk {top_k} --moe-expert-capacity-factor {factor} "
                                                  "--moe-token-drop-policy position")
    experts = Experts(4, replace(moe, ffn_hidden_size=4))
    assert experts.capacity(NUM_TOKENS) == moe_utils.get_capacity(NUM_TOKENS * top_k, NUM_EXPERTS, factor)
    # Megatron keeps min(routed, capacity) tokens per expert, as heteroflow does (which ones may differ).
    _, routing_map = moe_utils.topk_routing_with_score_function(logits, top_k, score_function="softmax")
    probs = routing_map.float()
    _, kept = moe_utils.apply_router_token_dropping(probs, routing_map, top_k, factor, drop_policy="position")
    assert kept.sum(0).tolist() == routing_map.sum(0).clamp(max=experts.capacity(NUM_TOKENS)).tolist()


@pytest.mark.parametrize("args, top_k, score", [
    ("--moe-router-topk 2 --moe-aux-loss-coeff 1e-2", 2, "softmax"),
    ("--moe-router-topk 3 --moe-router-score-function sigmoid --moe-aux-loss-coeff 1e-3", 3, "sigmoid"),
])
def test_imported_seq_aux_loss_gives_megatrons(tmp_path, args, top_k, score):
    """Megatron's `_apply_seq_aux_loss`: its tokens are [seq, batch]; the routing map and scores are viewed as
    [seq, batch * experts], the switch loss taken over them with seq tokens, divided by the batch size."""
    batch, seq = 4, NUM_TOKENS // 4
    moe, router, logits = _router_and_logits(tmp_path, f"{args} --moe-router-load-balancing-type seq_aux_loss")
    assert moe.aux_loss_type == "sequence"
    coeff = float(args.rsplit(" ", 1)[1])
    logits_BSE = logits.view(batch, seq, NUM_EXPERTS)
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
        logits_BSE.transpose(0, 1).reshape(-1, NUM_EXPERTS), top_k, score)
    megatron = moe_utils.switch_load_balancing_loss_func(
        probs=scores.reshape(seq, -1), tokens_per_expert=routing_map.reshape(seq, -1).sum(dim=0),
        total_num_tokens=seq, topk=top_k, num_experts=NUM_EXPERTS, moe_aux_loss_coeff=coeff) / batch
    ours = router(logits, batch).aux_loss * moe.aux_loss_coeff
    torch.testing.assert_close(ours, megatron, rtol=1e-5, atol=0)
    # it is the batch loss only when every sequence routes alike: here it differs
    assert not torch.isclose(ours, router(logits).aux_loss * moe.aux_loss_coeff)


def test_imported_z_loss_gives_megatrons(tmp_path):
    moe, router, logits = _router_and_logits(tmp_path, "--moe-router-topk 2 --moe-z-loss-coeff 1e-3")
    torch.testing.assert_close(router(logits * 5).z_loss * moe.z_loss_coeff,
                               moe_utils.z_loss_func(logits * 5, 1e-3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("args, pre_softmax, score", [
    ("--moe-router-topk 2", False, "softmax"),
    ("--moe-router-topk 2 --moe-router-pre-softmax", True, "softmax"),
    ("--moe-router-topk 3 --moe-router-score-function sigmoid", False, "sigmoid"),
])
def test_imported_topk_scaling_factor_scales_as_megatron(tmp_path, args, pre_softmax, score):
    _, router, logits = _router_and_logits(tmp_path, f"{args} --moe-router-topk-scaling-factor 2.5")
    top_k = int(args.split()[1])
    probs, _ = moe_utils.topk_routing_with_score_function(logits, top_k, use_pre_softmax=pre_softmax,
                                                          score_function=score, scaling_factor=2.5)
    routing = router(logits)
    ours = torch.zeros(NUM_TOKENS, NUM_EXPERTS).scatter(1, routing.indices_TK, routing.weights_TK)
    torch.testing.assert_close(ours, probs.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("top_k", [1, 2])
def test_imported_sinkhorn_routing_chooses_as_megatron_core(tmp_path, top_k):
    """Megatron's `sinkhorn_load_balancing` in training: the top-k of `sinkhorn(logits)`, weighted by the chosen
    experts' sigmoid (top-k 1) or softmax scores."""
    moe, router, logits = _router_and_logits(tmp_path, f"--moe-router-topk {top_k} --moe-router-pre-softmax "
                                                       "--moe-router-load-balancing-type sinkhorn")
    assert moe.sinkhorn
    logits = logits * 3  # sharper scores: the balancing changes many tokens' first choice
    chosen = torch.topk(moe_utils.sinkhorn(logits), top_k, dim=1).indices
    scores = torch.sigmoid(logits) if top_k == 1 else torch.softmax(logits, dim=-1)
    megatron = torch.zeros_like(logits).scatter(1, chosen, scores.gather(1, chosen))
    routing = router(logits)
    ours = torch.zeros(NUM_TOKENS, NUM_EXPERTS).scatter(1, routing.indices_TK, routing.weights_TK)
    torch.testing.assert_close(ours, megatron, rtol=1e-6, atol=1e-7)
    assert not torch.equal(routing.indices_TK, torch.topk(logits, top_k, dim=1).indices)  # not the plain top-k
