"""Streamed AdamW equals torch.optim.AdamW: bit for bit with torch's kernel, within 1e-6 with DeepSpeed's."""

from __future__ import annotations

import pytest
import torch

from heteroflow.devices import Device
from heteroflow.offload.optimizer import StreamedAdamW
from heteroflow.offload.store import TieredStore
from offload_testkit import swap, use_adam, use_aio  # noqa: F401  (fixture)

SHAPES = {"block0": [(300, 70), (70,)], "block1": [(5000, 3), (17,)], "head": [(33, 9)]}
LR = [1e-2, 5e-3, 2e-3, 1e-3, 1e-2, 3e-3]  # varying, as a schedule would


def _init() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {name: [torch.randn(s, generator=g) for s in shapes] for name, shapes in SHAPES.items()}


def _grads(step: int, dtype: torch.dtype = torch.float32) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: [torch.randn(s, generator=g).to(dtype) for s in shapes] for name, shapes in SHAPES.items()}


def _assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], exact: bool) -> None:
    for a, b in zip(got, want):
        if exact:
            assert torch.equal(a, b)
        else:  # rounding differs element by element (a few ulps); the whole agrees to 1e-6
            assert ((a - b).norm() / b.norm()).item() <= 1e-6


CASES = [  # (state tier, Adam kernel, SSD engine): every kernel on every tier it can run on
    ("device", "torch", "threads"), ("cpu", "torch", "threads"), ("cpu", "deepspeed", "threads"),
    ("ssd", "torch", "threads"), ("ssd", "torch", "deepspeed"), ("ssd", "deepspeed", "threads"),
    ("ssd", "deepspeed", "deepspeed"),
]


@pytest.mark.parametrize("tier, adam_impl, aio_kind", CASES)
def test_equals_torch_adamw_over_steps(tier, adam_impl, aio_kind, swap, monkeypatch):
    use_adam(adam_impl, monkeypatch)
    use_aio(aio_kind, monkeypatch)
    init = _init()
    ref = [torch.nn.Parameter(t.clone()) for ts in init.values() for t in ts]
    ref_opt = torch.optim.AdamW(ref, lr=LR[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model = {name: [t.clone() for t in ts] for name, ts in init.items()}
    with TieredStore(device=Device.cpu(), swap=swap, max_in_flight=3) as store:
        # Small chunks: parameters straddle chunk boundaries and the stream has many chunks.
        opt = StreamedAdamW(model, store=store, tier=tier, betas=(0.9, 0.95), weight_decay=0.1, chunk_numel=8192)
        assert opt.which == ("torch-adamw" if adam_impl == "torch" or tier == "device" else "deepspeed-cpu-adam")
        for step, lr in enumerate(LR):
            grads = _grads(step)
            for p, g in zip(ref, (g for gs in grads.values() for g in gs)):
                p.grad = g.clone()
            for group in ref_opt.param_groups:
                group["lr"] = lr
            ref_opt.step()
            for name, gs in grads.items():
                opt.add_grads(name, gs)
            opt.step(lr)
        exact = opt.which == "torch-adamw"
        _assert_matches([t for ts in model.values() for t in ts], list(ref), exact)
        state = opt.state_of("block1")
        ref_state = [ref_opt.state[p] for p in ref[2:4]]
        _assert_matches(state["exp_avg"], [s["exp_avg"] for s in ref_state], exact)
        _assert_matches(state["exp_avg_sq"], [s["exp_avg_sq"] for s in ref_state], exact)
        _assert_matches(state["master"], list(ref[2:4]), exact)
        if tier == "ssd":
            assert store.stats.max_in_flight <= 3 and store.stats.bytes_read > 0
        opt.close()


def test_accumulation_clipping_and_low_precision_grads(swap):
    init = _init()
    ref = [torch.nn.Parameter(t.clone()) for ts in init.values() for t in ts]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    model = {name: [t.clone() for t in ts] for name, ts in init.items()}
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        opt = StreamedAdamW(model, store=store, tier="ssd", weight_decay=0.1, chunk_numel=8192, impl="torch")
        for step in range(3):
            micro = [_grads(10 * step + k, torch.bfloat16) for k in range(3)]  # bf16 grads, 3 micro-batches
            for k, grads in enumerate(micro):
                for p, g in zip(ref, (g for gs in grads.values() for g in gs)):
                    p.grad = g.float() if k == 0 else p.grad + g.float()
                for name, gs in grads.items():
                    opt.add_grads(name, gs)
            want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
            got = opt.clip_grad_norm_(1.0)
            assert torch.equal(got, want) and got > 1.0  # clipping really scaled
            ref_opt.step()
            opt.step(1e-2)
        _assert_matches([t for ts in model.values() for t in ts], list(ref), exact=True)


def test_updates_a_bf16_parameter_tier(swap):
    init = _init()
    with TieredStore(device=Device.cpu(), swap=swap) as store, \
            TieredStore(device=Device.cpu(), swap=swap) as params:
        params.add("block0", init["block0"], "ssd", dtype=torch.bfloat16)
        model = {name: [t.clone() for t in ts] for name, ts in init.items()}
        opt = StreamedAdamW(model, store=store, tier="cpu", chunk_numel=8192, param_store=params, impl="torch")
        for name, gs in _grads(0).items():
            opt.add_grads(name, gs)
        opt.step(1e-2)
        master = opt.state_of("block0")["master"]
        stored = params.unflatten("block0", params.get("block0"))
        assert all(torch.equal(s, m.to(torch.bfloat16)) for s, m in zip(stored, master))
        assert all(torch.equal(a, b) for a, b in zip(model["block0"], init["block0"]))  # tier, not tensors
        assert not all(torch.equal(a, b) for a, b in zip(model["head"], init["head"]))
