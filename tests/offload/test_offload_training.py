"""Training with any offload setting reproduces the no-offload losses and weights.

Bit for bit with torch's AdamW kernel; within 1e-6 relative with DeepSpeedCPUAdam. The model is a
stack of blocks plus a head that stays on the device, trained with gradient accumulation over two
micro-batches, global-norm clipping and a changing learning rate, as the runtime will.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from heteroflow.devices import Device
from heteroflow.offload.budget import DeviceBudget
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.stage import StageOffload
from heteroflow.offload.swap import live_swap_dirs
from offload_testkit import block_bytes, make_blocks, use_adam, use_aio

HIDDEN, VOCAB, BLOCKS, STEPS = 32, 50, 3, 3
LRS = [3e-3, 2e-3, 1e-3]


def _model():
    blocks = make_blocks(BLOCKS, HIDDEN, seed=3)
    torch.manual_seed(4)
    head = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB))
    return blocks, head


def _data(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(2, 5, HIDDEN, generator=g).requires_grad_(), torch.randint(0, VOCAB, (2, 5), generator=g)


def _forward(blocks, head, x, y, recompute: bool) -> torch.Tensor:
    h = x
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=True) if recompute else block(h)
    return nn.functional.cross_entropy(head(h).flatten(0, 1), y.flatten()) / 2  # mean over 2 micro-batches


@functools.lru_cache(maxsize=None)  # one reference run per recompute setting serves every test
def _reference(recompute: bool):
    blocks, head = _model()
    params = list(blocks.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=LRS[0], betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(2):
            loss = _forward(blocks, head, *_data(step, micro), recompute)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        for group in opt.param_groups:
            group["lr"] = LRS[step]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, [p.detach().clone() for p in params]


def _offloaded(policy: OffloadPolicy, recompute: bool, budget: DeviceBudget | None = None):
    blocks, head = _model()
    losses = []
    with StageOffload(policy, device=Device.cpu(), blocks=blocks, other_params={"head": list(head.parameters())},
                      betas=(0.9, 0.95), weight_decay=0.1, budget=budget) as offload:
        for step in range(STEPS):
            total = 0.0
            for micro in range(2):
                with offload.activation_context():
                    loss = _forward(blocks, head, *_data(step, micro), recompute)
                loss.backward()
                total += loss.item()
            offload.collect_grads()
            offload.clip_grad_norm_(0.5)
            offload.step(LRS[step])
            losses.append(total)
        weights = [w for i in range(BLOCKS) for w in offload.params.gather(i)] if offload.params else \
            [p.detach().clone() for p in blocks.parameters()]
        weights += [p.detach().clone() for p in head.parameters()]
        which = offload.which
    return losses, weights, which


SETTINGS = list(itertools.product(["device", "cpu", "ssd"], ["device", "cpu", "ssd"], ["device", "cpu"]))


@pytest.mark.parametrize("optimizer, params, activations", SETTINGS)
def test_every_setting_reproduces_losses_bit_for_bit(optimizer, params, activations, tmp_path, monkeypatch):
    use_adam("torch", monkeypatch)
    recompute = activations == "cpu"  # checkpointed activations are the ones the cpu tier holds
    want_losses, want_weights = _reference(recompute)
    policy = OffloadPolicy(optimizer=optimizer, params=params, activations=activations,
                           swap_root=str(tmp_path), chunk_numel=4096)
    losses, weights, which = _offloaded(policy, recompute)
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, want_weights))
    assert which["adam"] == "torch-adamw"
    assert not list(tmp_path.glob("heteroflow-swap-*")) and not live_swap_dirs()


@pytest.mark.parametrize("aio", ["threads", "deepspeed"])
def test_deepspeed_adam_within_1e6_and_budget_held(aio, tmp_path, monkeypatch):
    use_adam("deepspeed", monkeypatch)
    use_aio(aio, monkeypatch)
    want_losses, want_weights = _reference(recompute=True)
    blocks, head = _model()
    one_block = block_bytes(blocks[0])
    head_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    # Fully offloaded: two blocks' parameters, one block's gradients, and the head's parameters and grads.
    budget = DeviceBudget(3 * one_block + 2 * head_bytes)
    policy = OffloadPolicy(optimizer="ssd", params="ssd", activations="cpu", swap_root=str(tmp_path),
                           chunk_numel=4096)
    losses, weights, which = _offloaded(policy, recompute=True, budget=budget)
    assert which == {"adam": "deepspeed-cpu-adam", "io": "deepspeed-aio" if aio == "deepspeed" else "threads-odirect"}
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 1e-6 * abs(want)
    for a, b in zip(weights, want_weights):
        assert ((a - b).norm() / b.norm()).item() <= 1e-6
    assert budget.peak_bytes <= budget.limit_bytes and budget.resident_bytes == 0
