"""TieredStore: bit-exact round trips on every tier, bounded staging, budget accounting, slices."""

from __future__ import annotations

import pytest
import torch

from heteroflow.devices import Device
from heteroflow.offload.budget import DeviceBudget, DeviceBudgetExceeded
from heteroflow.offload.store import TieredStore
from offload_testkit import aio_kind, swap, use_aio  # noqa: F401  (fixtures)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _tensors(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 11), (5,), (3, 4, 129)]
    if dtype.is_floating_point:
        return [torch.randn(s, generator=g).to(dtype) for s in shapes]
    return [torch.randint(-2**40, 2**40, s, generator=g, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("tier, aio", [("device", "threads"), ("cpu", "threads"), ("ssd", "threads"),
                                       ("ssd", "deepspeed")])
def test_round_trip_every_tier_bit_for_bit(tier, aio, swap, monkeypatch):
    use_aio(aio, monkeypatch)
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        for k, dtype in enumerate(DTYPES):
            tensors = _tensors(dtype, k)
            layout = store.add(f"c{k}", tensors, tier)
            assert layout.nbytes == sum(t.numel() * t.element_size() for t in tensors)
            store.prefetch(f"c{k}")
            got = store.unflatten(f"c{k}", store.get(f"c{k}"))
            assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(tensors, got))
            store.release(f"c{k}")
            if tier != "device":
                host = store.unflatten(f"c{k}", store.host(f"c{k}"))
                assert all(torch.equal(a, b) for a, b in zip(tensors, host))
                store.release(f"c{k}")
        assert store.budget.resident_bytes == (sum(store.layout(n).nbytes for n in store.names())
                                               if tier == "device" else 0)


def test_write_back_and_host_updates_persist(swap, aio_kind):
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        for tier in ("cpu", "ssd"):
            store.add(tier, [torch.zeros(5000)], tier)
            store.host(tier).add_(3.0)  # CPU-side update of the borrowed copy
            store.write_back(tier)
            store.release(tier)
            assert torch.equal(store.host(tier), torch.full((5000,), 3.0))
            store.release(tier)
            flat = store.get(tier)  # device copy, changed on the "device", then stored back
            flat.mul_(2.0)
            store.write_back(tier)
            store.release(tier)
            assert torch.equal(store.get(tier), torch.full((5000,), 6.0))
            store.release(tier)


def test_write_slice_on_every_tier(swap, aio_kind):
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        n = 3 * 4096 + 100  # the last slice ends unaligned, at the chunk's end
        for tier in ("device", "cpu", "ssd"):
            store.add(tier, [torch.zeros(n)], tier)
            for start in range(0, n, 4096):
                piece = torch.arange(start, min(n, start + 4096), dtype=torch.float32)
                store.write_slice(tier, start, piece)
            assert torch.equal(store.get(tier), torch.arange(n, dtype=torch.float32))
            store.release(tier)


def test_staging_buffers_and_transfers_stay_bounded(swap, aio_kind):
    with TieredStore(device=Device.cpu(), swap=swap, max_in_flight=2) as store:
        chunks = {f"c{i}": torch.randn(20000, generator=torch.Generator().manual_seed(i)) for i in range(12)}
        for name, t in chunks.items():
            store.add(name, [t], "ssd")
        names = list(chunks)
        store.prefetch(names[0])
        for i, name in enumerate(names):  # the parameter pattern: fetch i, prefetch i+1, release i
            if i + 1 < len(names):
                store.prefetch(names[i + 1])
            assert torch.equal(store.get(name), chunks[name])
            store.release(name)
        for name in names:  # the optimizer pattern: read, update, write back
            store.prefetch(name, to="host")
            store.host(name).add_(1.0)
            store.write_back(name)
        for name in names:
            assert torch.equal(store.host(name), chunks[name] + 1.0)
            store.release(name)
        assert store.stats.max_buffers <= 2 and store.stats.max_in_flight <= 2
        assert store.stats.max_in_flight == 2  # and the overlap did happen
        with pytest.raises(RuntimeError, match="staging buffers hold borrowed chunks"):
            for name in names[:3]:
                store.prefetch(name, to="host")


def test_budget_is_charged_and_enforced(swap):
    budget = DeviceBudget(3 * 4000 * 4)
    with TieredStore(device=Device.cpu(), swap=swap, budget=budget) as store:
        for i in range(4):
            store.add(f"c{i}", [torch.ones(4000)], "ssd" if i % 2 else "cpu")
        store.get("c0"), store.get("c1"), store.get("c2")
        assert budget.resident_bytes == budget.peak_bytes == 3 * 16000
        with pytest.raises(DeviceBudgetExceeded, match="device budget exceeded: params needs 16000 bytes"):
            store.get("c3")
        store.release("c0")
        store.get("c3")
        assert budget.peak_bytes == 3 * 16000
    assert budget.resident_bytes == 0  # close() releases everything


def test_ssd_without_swap_dir_is_a_user_error():
    from heteroflow.errors import UserError

    with TieredStore(device=Device.cpu()) as store:
        with pytest.raises(UserError, match="needs a swap directory"):
            store.add("x", [torch.ones(3)], "ssd")
