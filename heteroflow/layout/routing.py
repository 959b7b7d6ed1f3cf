"""What mixture-of-experts routing moves per rank: the tokens a rank dispatches, the (token, expert) pairs its local
experts compute, the all-to-all bytes inside the stage's ep group, and the load-imbalance allowance they are
priced at.

The expert layout folds etp x ep x expert-dp over a stage's tp x cp x dp ranks (`ParallelLayout.expert_dp`).
A tp group's tokens are shared out over its tp / etp expert-tp groups, so a rank dispatches `tokens * etp / tp` of
its micro-batch share (with etp = tp: all of them, each rank of the expert-tp group sending its copy). Dropless
routing sends each (token, expert) pair whose expert lives on another ep rank once there (dispatch) and once back
(combine) in the forward; the backward sends the gradients of both the same way. Under uniform routing a pair
stays on its rank with probability 1/ep.
"""

from __future__ import annotations

from heteroflow.layout.parallel import MoEShape, ModelShape

ALLTOALLS_PER_LAYER = (2, 2)
"""All-to-alls of one MoE layer in the (forward, backward): dispatch and combine, and their adjoints."""


def dispatched_tokens(tokens: float, *, tp: int, etp: int) -> float:
    """Tokens one rank routes per MoE layer and micro-batch, out of `tokens` its tp group holds."""
    return tokens * etp / tp


def routed_pairs_per_rank(model: ModelShape, tokens: float, *, tp: int, etp: int) -> float:
    """(token, expert) pairs one rank's local experts compute per MoE layer and micro-batch under uniform routing:
    each of the ep ranks sends each of its num_experts / ep local experts top_k / num_experts of its dispatched
    tokens, `dispatched_tokens * top_k` in all (each at width ffn_hidden_size / etp)."""
    return dispatched_tokens(tokens, tp=tp, etp=etp) * model.moe.top_k


def alltoall_bytes_per_rank(model: ModelShape, tokens: float, *, tp: int, ep: int, etp: int,
                            dtype_bytes: int) -> float:
    """Bytes one rank sends in one all-to-all of a MoE layer (the dispatch; the combine sends as many back, and the
    backward repeats both, `ALLTOALLS_PER_LAYER`), expected under uniform routing: its dispatched tokens x top_k x
    (ep - 1) / ep of the pairs leave the rank, hidden_size elements each."""
    if ep <= 1:
        return 0.0
    pairs = routed_pairs_per_rank(model, tokens, tp=tp, etp=etp)
    return pairs * (ep - 1) / ep * model.hidden_size * dtype_bytes


def load_allowance(moe: MoEShape, ep: int) -> float:
    """The factor an ep rank's expert work and all-to-all time are priced at over the uniform-routing mean: the
    busiest ep rank sets the pace (`model.moe.load_imbalance`, the max-over-mean tokens per ep rank), capped by a
    capacity factor, which drops what exceeds it. One rank holding every expert (ep = 1) computes every pair
    whatever the balance, so its allowance is 1."""
    if ep <= 1:
        return 1.0
    if moe.capacity_factor is not None:
        return min(moe.load_imbalance, max(1.0, moe.capacity_factor))
    return moe.load_imbalance
