"""Layer-by-layer parameters: gradients equal the no-offload run bit for bit; the budget holds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from heteroflow.devices import Device
from heteroflow.offload.activations import ActivationOffload, activation_context
from heteroflow.offload.budget import DeviceBudget, DeviceBudgetExceeded
from heteroflow.offload.params import OffloadedParams
from heteroflow.offload.store import TieredStore
from offload_testkit import block_bytes, make_blocks, swap, use_aio  # noqa: F401  (fixture)

NUM_BLOCKS, HIDDEN = 5, 48


def _loss(blocks, x: torch.Tensor, recompute: str) -> torch.Tensor:
    h = x
    for block in blocks:
        if recompute == "reentrant":
            h = checkpoint(block, h, use_reentrant=True)
        elif recompute == "non-reentrant":
            h = checkpoint(block, h, use_reentrant=False)
        else:
            h = block(h)
    return (h.float() ** 2).mean()


def _reference(recompute: str, micro_batches: list[torch.Tensor]):
    blocks = make_blocks(NUM_BLOCKS, HIDDEN)
    losses = []
    for x in micro_batches:
        loss = _loss(blocks, x, recompute)
        loss.backward()
        losses.append(loss.detach())
    return blocks, losses


def _micro_batches(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, HIDDEN, generator=g).requires_grad_() for _ in range(n)]


@pytest.mark.parametrize("tier, aio", [("cpu", "threads"), ("ssd", "threads"), ("ssd", "deepspeed")])
@pytest.mark.parametrize("recompute", ["none", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("device_copies", [None, True], ids=["lent", "copied"])  # CPU device / accelerator path
def test_gradients_bit_identical_and_budget_held(tier, aio, recompute, device_copies, swap, monkeypatch):
    use_aio(aio, monkeypatch)
    micro_batches = _micro_batches()
    ref_blocks, ref_losses = _reference(recompute, micro_batches)
    blocks = make_blocks(NUM_BLOCKS, HIDDEN)
    one = block_bytes(blocks[0])
    # Two blocks' parameters (current + prefetched) and one block's gradients: nothing more may stay.
    budget = DeviceBudget(3 * one)
    grads: dict[str, list[torch.Tensor]] = {}

    def sink(name, block_grads):  # accumulate like autograd does across micro-batches
        if name in grads:
            for acc, g in zip(grads[name], block_grads):
                acc.add_(g)
        else:
            grads[name] = [g.clone() for g in block_grads]

    with TieredStore(device=Device.cpu(), swap=swap, budget=budget, device_copies=device_copies) as store:
        offloaded = OffloadedParams(blocks, store=store, tier=tier, grad_sink=sink)
        for x, ref_loss in zip(micro_batches, ref_losses):
            loss = _loss(blocks, x, recompute)
            loss.backward()
            assert torch.equal(loss, ref_loss)
            assert budget.resident_bytes == 0  # everything released after backward
        assert 0 < budget.peak_bytes <= budget.limit_bytes
        for i, ref_block in enumerate(ref_blocks):
            for p_ref, g in zip(ref_block.parameters(), grads[f"block{i}"]):
                assert torch.equal(p_ref.grad, g)
            assert all(torch.equal(a, b) for a, b in zip(ref_block.parameters(), offloaded.gather(i)))
        assert all(p.numel() == 0 for p in blocks.parameters())  # placeholders between uses
        offloaded.close()


def test_budget_too_small_raises_before_allocating(swap):
    blocks = make_blocks(3, HIDDEN)
    one = block_bytes(blocks[0])  # measured before offloading turns the parameters into placeholders
    budget = DeviceBudget(one + 100)  # one block fits, the prefetched next does not
    # Separate device copies, as on an accelerator (a CPU device lends the host copy and prefetches nothing).
    with TieredStore(device=Device.cpu(), swap=swap, budget=budget, device_copies=True) as store:
        OffloadedParams(blocks, store=store, tier="cpu", grad_sink=lambda n, g: None)
        with pytest.raises(DeviceBudgetExceeded, match="params needs"):
            _loss(blocks, _micro_batches(1)[0], "none")
    no_prefetch = make_blocks(3, HIDDEN)
    with TieredStore(device=Device.cpu(), swap=swap, budget=DeviceBudget(one + 100)) as store:
        OffloadedParams(no_prefetch, store=store, tier="ssd", prefetch=False)
        with torch.no_grad():  # inference: one block at a time fits
            _loss(no_prefetch, _micro_batches(1)[0], "none")
        assert store.budget.peak_bytes == one


def test_activations_on_cpu_are_exact_and_counted():
    device = Device.cpu()
    micro_batches = _micro_batches(1)
    ref_blocks, ref_losses = _reference("reentrant", micro_batches)
    blocks = make_blocks(NUM_BLOCKS, HIDDEN)
    with activation_context("cpu", device) as hooks:
        loss = _loss(blocks, micro_batches[0], "reentrant")
    assert isinstance(hooks, ActivationOffload)
    x_bytes = micro_batches[0].numel() * 4
    # Exactly the checkpointed block inputs, plus the last output that the loss's square saves.
    assert hooks.stats.bytes_saved == (NUM_BLOCKS + 1) * x_bytes
    loss.backward()
    assert hooks.stats.live_bytes == 0
    assert torch.equal(loss, ref_losses[0])
    for a, b in zip(ref_blocks.parameters(), blocks.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("activations", ["device", "cpu"])
def test_forward_keeps_no_parameter_copy_alive(activations, swap):
    """`F.linear` saves `weight.t()`, a view that would keep each fetched copy alive until backward."""
    from torch.multiprocessing.reductions import StorageWeakRef

    micro_batches = _micro_batches(1)
    ref_blocks, ref_losses = _reference("none", micro_batches)
    blocks = make_blocks(NUM_BLOCKS, HIDDEN)
    one = block_bytes(blocks[0])
    # Separate device copies (the accelerator path): each must be freed when its block is released.
    with TieredStore(device=Device.cpu(), swap=swap, budget=DeviceBudget(3 * one), device_copies=True) as store:
        copies = []
        real_get = store.get

        def get(name):
            flat = real_get(name)
            copies.append(StorageWeakRef(flat.untyped_storage()))
            return flat

        store.get = get
        grads: dict[str, list] = {}
        offloaded = OffloadedParams(blocks, store=store, tier="cpu",
                                    grad_sink=lambda name, g: grads.setdefault(name, [t.clone() for t in g]))
        with activation_context(activations, Device.cpu()) as hooks:
            loss = _loss(blocks, micro_batches[0], "none")
        assert len(copies) == NUM_BLOCKS and all(ref.expired() for ref in copies)  # freed after each block
        if hooks is not None:  # the weights were not copied to the host as activations either
            assert hooks.stats.bytes_saved < NUM_BLOCKS * one
        loss.backward()
        assert torch.equal(loss, ref_losses[0])
        for i, ref_block in enumerate(ref_blocks):
            for p_ref, g in zip(ref_block.parameters(), grads[f"block{i}"]):
                assert torch.equal(p_ref.grad, g)
        offloaded.close()
