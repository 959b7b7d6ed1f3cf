"""Fault injection into swap files: a block overwritten with zeros or with one flipped bit after it was
written is a `StateCorrupted` error naming the file and block on the next read, never silent garbage.
"""

from __future__ import annotations

import os

import pytest
import torch

from heteroflow.devices import Device
from heteroflow.errors import StateCorrupted, UserError
from heteroflow.offload.optimizer import StreamedAdamW
from heteroflow.offload.store import TieredStore
from heteroflow.offload.swap import SWAP_BLOCK_BYTES, SwapChecksums
from offload_testkit import aio_kind, swap  # noqa: F401  (fixtures)

NUMEL = 3 * SWAP_BLOCK_BYTES // 4 + 1000  # fp32: three whole checksum blocks and a partial last one


def zero_bytes(path: str, offset: int, nbytes: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * nbytes)
        f.flush()
        os.fsync(f.fileno())


def flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x04]))
        f.flush()
        os.fsync(f.fileno())


DAMAGE = {
    "zeros-whole-file": (lambda path: zero_bytes(path, 0, os.path.getsize(path)), 0),
    "zeros-one-block": (lambda path: zero_bytes(path, SWAP_BLOCK_BYTES, SWAP_BLOCK_BYTES), 1),
    "flip-one-bit": (lambda path: flip_bit(path, 2 * SWAP_BLOCK_BYTES + 12345), 2),
    "flip-bit-in-last-partial-block": (lambda path: flip_bit(path, 3 * SWAP_BLOCK_BYTES + 17), 3),
}


def ramp(seed: int = 0) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + seed + 1  # no zeros: zeroing always changes bytes


@pytest.mark.parametrize("kind", list(DAMAGE))
@pytest.mark.parametrize("read", ["host", "get", "prefetch-then-host"])
def test_damaged_swap_block_is_caught_on_the_next_read(swap, aio_kind, kind, read):
    damage, block = DAMAGE[kind]
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        store.add("state", [ramp()], "ssd")
        assert torch.equal(store.host("state"), ramp())  # intact: reads back fine
        store.host("state").add_(1.0)
        store.write_back("state")  # damage after a write-back, as mid-run
        store.release("state")
        store.wait_all()
        path = store._files["state"]
        damage(path)
        with pytest.raises(StateCorrupted) as caught:
            if read == "prefetch-then-host":
                store.prefetch("state", to="host")
            getattr(store, "get" if read == "get" else "host")("state")
        message = str(caught.value)
        assert path in message and "'state'" in message and f"block {block} " in message
        assert "fails its checksum" in message and "last checkpoint" in message
        assert isinstance(caught.value, UserError)


def test_partial_writes_keep_checksums_right_and_check_the_rest_of_the_block(swap):
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        store.add("p", [ramp()], "ssd")
        # Slices on the engine's I/O grid (4 KiB, or a multiple with DeepSpeed's threads) but not on the checksum
        # grid: each re-reads its blocks' other bytes.
        a, block = store.engine.alignment // 4, SWAP_BLOCK_BYTES // 4  # fp32 elements
        assert 4 * a < block, "the I/O grid must be finer than the checksum grid for this test"
        slices = [(a, 2 * a), (block + 3 * a, block + 4 * a), (NUMEL - 1000, NUMEL)]
        for start, stop in slices:
            store.write_slice("p", start, -ramp()[start:stop])
        want = ramp()
        for start, stop in slices:
            want[start:stop] *= -1
        assert torch.equal(store.host("p"), want)
        store.release("p")
        store.wait_all()
        flip_bit(store._files["p"], 100)  # in block 0, outside the next slice
        with pytest.raises(StateCorrupted, match="block 0 "):
            store.write_slice("p", a, ramp()[a:2 * a])  # the damage is found before it gets a new checksum


def test_optimizer_step_on_zeroed_swap_state_fails_instead_of_training_on_garbage(swap):
    params = {"g": [torch.randn(300, 100), torch.randn(4000)]}
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        opt = StreamedAdamW(params, store=store, tier="ssd", chunk_numel=8192, impl="torch")
        opt.add_grads("g", [torch.ones(300, 100), torch.ones(4000)])
        opt.step(1e-3)
        store.wait_all()
        files = sorted(store._files.values())
        zero_bytes(files[-1], 0, os.path.getsize(files[-1]))
        opt.add_grads("g", [torch.ones(300, 100), torch.ones(4000)])
        with pytest.raises(StateCorrupted, match="fails its checksum"):
            opt.step(1e-3)
        opt.close()


def test_checksums_off_reads_whatever_is_on_disk(swap):
    with TieredStore(device=Device.cpu(), swap=swap, checksums=False) as store:
        store.add("x", [ramp()], "ssd")
        store.wait_all()
        zero_bytes(store._files["x"], 0, 4096)
        assert store.host("x")[:1024].eq(0).all()  # what the benchmark's baseline measures: no checks


def test_swap_checksums_on_their_own(tmp_path):
    path = str(tmp_path / "f.swp")
    data = bytes(range(256)) * 40  # 10240 bytes, blocks of 4096: 2 whole and one partial
    with open(path, "wb") as f:
        f.write(data)
    sums = SwapChecksums(block_bytes=4096)
    sums.track(path, len(data))
    sums.record(path, 0, data)
    sums.verify(path, 0, data)
    new = b"\xff" * 2048
    with open(path, "r+b") as f:  # as the store does: the checksum first, then the write lands
        sums.record(path, 5120, new)
        f.seek(5120)
        f.write(new)
    after = data[:5120] + new + data[7168:]
    sums.verify(path, 0, after)
    with pytest.raises(StateCorrupted, match=r"block 1 \(bytes 4096-8192\)"):
        sums.verify(path, 0, data)
    assert sums.span(path, 5120, 7168) == (4096, 8192) and sums.span(path, 9000, 10240) == (8192, 10240)


@pytest.mark.parametrize("read", ["host", "write_back-then-host"])
def test_a_swap_directory_removed_mid_run_is_one_clear_error(swap, aio_kind, read):
    import shutil
    with TieredStore(device=Device.cpu(), swap=swap) as store:
        store.add("state", [ramp()], "ssd")
        if read == "write_back-then-host":
            store.host("state").add_(1.0)
            store.write_back("state")
        else:
            store.release("state")
        store.wait_all()
        shutil.rmtree(swap.path)  # a temporary-files cleaner, mid-run
        with pytest.raises(UserError) as info:
            store.host("state")
    message = str(info.value)
    assert message.startswith(f"swap file {swap.path}/") and f"is gone: {swap.path} was removed while the run used it" \
        in message and "--resume" in message, message
