"""Measured bandwidths the planner needs to price offload; `heteroflow profile` calls `measure_offload`.

Disk figures come from the same engine and access pattern the SSD tier uses (aligned chunks,
`max_in_flight` requests outstanding, direct I/O), so the planner prices what training will see.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

from heteroflow.offload.aio import IOEngine, open_engine
from heteroflow.offload.optimizer import StreamedAdamW
from heteroflow.offload.store import TieredStore
from heteroflow.offload.swap import SwapDir


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadBandwidths:
    """What one host measured for the offload tiers (feed `OffloadTraffic.seconds`)."""

    disk_write_gb_per_s: float
    disk_read_gb_per_s: float
    host_copy_gb_per_s: float
    """CPU memory copy bandwidth (staging copies, emulated devices)."""
    cpu_adam_params_per_s: float
    """Parameters per second the CPU AdamW step updates (state already in memory)."""
    io_path: str
    adam_path: str

    def to_dict(self) -> dict:
        """Plain data for the profile file."""
        return asdict(self)


def engine_throughput(engine: IOEngine, path: str, buffers: list[torch.Tensor], nbytes: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) of `engine` writing then reading `nbytes` of `path` in chunks of one buffer,
    cycling `buffers` with at most one request per buffer outstanding, as the SSD tier does; removes `path`."""
    chunk, in_flight = buffers[0].numel(), len(buffers)
    rates = []
    for submit in (engine.write, engine.read):
        pending: list = []
        start = time.perf_counter()
        for k, offset in enumerate(range(0, nbytes, chunk)):
            if len(pending) == in_flight:
                pending.pop(0).wait()
            pending.append(submit(buffers[k % in_flight], path, offset))
        for request in pending:
            request.wait()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    os.unlink(path)
    return rates[0], rates[1]


def store_throughput(store: TieredStore, nbytes: int, chunk_bytes: int, *,
                     read_modify_write: bool = False) -> tuple[float, float, float | None]:
    """(write GB/s, read GB/s, read-modify-write GB/s or None) through `store`: add `nbytes` to its ssd tier in
    fp32 chunks of `chunk_bytes`, then read them back with the fetch-ahead loop the optimizer runs (and, when
    asked, the same loop writing every chunk back); checks the data read back."""
    source = torch.randn(chunk_bytes // 4)
    names = [f"c{i}" for i in range(nbytes // chunk_bytes)]
    start = time.perf_counter()
    for name in names:
        store.add(name, [source], "ssd")
    store.wait_all()
    write = nbytes / (time.perf_counter() - start) / 1e9
    rates = []
    for modify in (False, True) if read_modify_write else (False,):
        start = time.perf_counter()
        store.prefetch(names[0], to="host")
        for k, name in enumerate(names):
            if k + 1 < len(names):
                store.prefetch(names[k + 1], to="host")
            flat = store.host(name)
            if modify:
                flat[:1] += 0.0
                store.write_back(name)
            store.release(name)
        store.wait_all()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    assert torch.equal(store.host(names[-1]), source), "read back wrong data"
    store.release(names[-1])
    return write, rates[0], rates[1] if read_modify_write else None

def measure_offload(directory: str, *, nbytes: int = 512 << 20, chunk_bytes: int = 64 << 20,
                    max_in_flight: int = 3, adam_params: int = 1 << 24) -> OffloadBandwidths:
    """Measure disk write/read (in a scratch directory under `directory`), host copies and CPU Adam."""
    from heteroflow.devices import Device

    nbytes = max(chunk_bytes, nbytes // chunk_bytes * chunk_bytes)
    with SwapDir(directory) as swap:
        swap.check_free(nbytes)
        engine = open_engine(str(swap.path), max_in_flight=max_in_flight)
        try:
            buffers = [engine.alloc(chunk_bytes) for _ in range(max_in_flight)]
            rates = engine_throughput(engine, str(swap.path / "measure.swp"), buffers, nbytes)
            io_path = engine.which
        finally:
            engine.close()
    src, dst = torch.empty(chunk_bytes, dtype=torch.uint8), torch.empty(chunk_bytes, dtype=torch.uint8)
    dst.copy_(src)  # first touch
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    copy_gb_per_s = 4 * chunk_bytes / (time.perf_counter() - start) / 1e9
    params = {"p": [torch.zeros(adam_params)]}
    with TieredStore(device=Device.cpu()) as store:
        opt = StreamedAdamW(params, store=store, tier="cpu", chunk_numel=1 << 22)
        opt.add_grads("p", [torch.ones(adam_params)])
        opt.step(1e-3)  # warm-up (first-touch of the state)
        start = time.perf_counter()
        opt.step(1e-3)
        adam_rate = adam_params / (time.perf_counter() - start)
        adam_path = opt.which
        opt.close()
    return OffloadBandwidths(disk_write_gb_per_s=rates[0], disk_read_gb_per_s=rates[1],
                             host_copy_gb_per_s=copy_gb_per_s, cpu_adam_params_per_s=adam_rate,
                             io_path=io_path, adam_path=adam_path)
