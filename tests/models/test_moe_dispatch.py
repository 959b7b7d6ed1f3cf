"""The all-to-all dispatcher moves exactly the rows the routing asks for and gives the single-rank MoE's outputs
and gradients; the row collectives used with etp 1 are each other's adjoints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heteroflow.config.moe import MoESpec
from heteroflow.layout.routing import alltoall_bytes_per_rank
from heteroflow.layout.shards import local_experts
from heteroflow.models.moe import Experts, Router
from heteroflow.testing import run_ranks

H, E, K, TOKENS = 12, 8, 2, 10
SPEC = MoESpec(num_experts=E, top_k=K, ffn_hidden_size=6)


def _experts() -> Experts:
    torch.manual_seed(0)
    experts = Experts(H, SPEC)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.5)
    return experts


def _tokens(rank: int):
    """Rank `rank`'s tokens and the router's top-k weights and indices for them (one router on every rank, sharp
    enough that some experts get no token from a rank)."""
    x = torch.randn(TOKENS + rank, H, generator=torch.Generator().manual_seed(100 + rank))
    router = Router(H, SPEC)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(1)) * 2)
        routing = router(x)
    return x, routing.weights_TK, routing.indices_TK


def _dispatch_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from heteroflow.models.moe_dispatch import AllToAllDispatcher

    reference = _experts()
    x, weights, indices = _tokens(rank)
    x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y_ref = reference(x_ref, w_ref, indices)
    y_ref.pow(2).sum().backward()

    experts = _experts()
    held = local_experts(E, world_size, rank)
    for key in [k for k in experts.keys() if int(k) not in held]:
        del experts[key]
    experts.dispatcher = AllToAllDispatcher(dist.group.WORLD, num_experts=E)
    x_ep, w_ep = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = experts(x_ep, w_ep, indices)
    y.pow(2).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x_ep.grad, x_ref.grad)
    torch.testing.assert_close(w_ep.grad, w_ref.grad)
    # An expert's gradient here is that of every rank's tokens: the reference's, summed over the ranks (in another
    # order: float32 rounding of sums of ~1 entries).
    for param in reference.parameters():
        dist.all_reduce(param.grad)
    for name, param in experts.named_parameters():
        torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    return experts.dispatcher.counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_matches_local_experts_and_sends_each_assignment_once(world_size):
    counts = run_ranks(_dispatch_rank, world_size, timeout_s=120)
    row_bytes = H * 4
    for rank, c in enumerate(counts):
        _, _, indices = _tokens(rank)
        owner = indices // (E // world_size)  # the ep rank holding each chosen expert
        assert c.routed == indices.numel() and c.forwards == 1
        assert c.sent_rows == int((owner != rank).sum())  # own rows stay; each remote assignment goes once
        assert c.sent_bytes == c.sent_rows * row_bytes
        received = sum(int((_tokens(src)[2] // (E // world_size) == rank).sum())
                       for src in range(world_size) if src != rank)
        assert (c.received_rows, c.received_bytes) == (received, received * row_bytes)
    assert sum(c.sent_rows for c in counts) == sum(c.received_rows for c in counts)


def _rows_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from heteroflow.models.moe_dispatch import gather_rows, split_rows

    x = torch.arange(7 * 3, dtype=torch.float32).view(7, 3).requires_grad_()  # replicated; 7 rows split 4 / 3
    mine = split_rows(x, dist.group.WORLD)
    assert mine.shape[0] == (4 if rank == 0 else 3)
    back = gather_rows(mine * (rank + 1), dist.group.WORLD, 7)
    torch.testing.assert_close(back[:4], x[:4].detach() * 1)
    torch.testing.assert_close(back[4:], x[4:].detach() * 2)
    back.sum().backward()  # the gradient of the replicated output is replicated: each share comes back whole
    torch.testing.assert_close(x.grad, torch.tensor([1.0] * 4 + [2.0] * 3)[:, None].expand(7, 3))


def test_split_and_gather_rows_are_adjoint():
    run_ranks(_rows_rank, 2, timeout_s=60)


def _uniform_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from heteroflow.models.moe_dispatch import AllToAllDispatcher

    tokens = 4 * E  # every expert gets the same number of (token, slot) pairs
    indices = (torch.arange(tokens)[:, None] * K + torch.arange(K)[None, :] + rank) % E
    experts = _experts()
    for key in [k for k in experts.keys() if int(k) not in local_experts(E, world_size, rank)]:
        del experts[key]
    experts.dispatcher = AllToAllDispatcher(dist.group.WORLD, num_experts=E)
    experts(torch.randn(tokens, H), torch.full((tokens, K), 1.0 / K), indices)
    return tokens, experts.dispatcher.counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_planner_prices_the_bytes_the_dispatcher_sends_under_uniform_routing(world_size):
    """`layout.routing.alltoall_bytes_per_rank` (the planner's all-to-all volume) is what the runtime sends."""
    model = SimpleNamespace(hidden_size=H, moe=SPEC)
    for tokens, counts in run_ranks(_uniform_rank, world_size, timeout_s=120):
        priced = alltoall_bytes_per_rank(model, tokens, tp=1, ep=world_size, etp=1, dtype_bytes=4)
        assert counts.sent_bytes == counts.received_bytes == priced > 0
