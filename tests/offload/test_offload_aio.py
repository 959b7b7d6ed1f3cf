"""SSD engines: both paths move bytes exactly, at offsets, asynchronously; misuse fails loudly."""

from __future__ import annotations

import os

import pytest
import torch

from heteroflow.offload.aio import ALIGN_BYTES, aligned_empty, odirect_supported, open_engine, round_up
from heteroflow.errors import UserError
from offload_testkit import aio_kind  # noqa: F401  (fixture)


def test_aligned_empty_is_page_aligned():
    for n in (4096, 12288, 1 << 20):
        buf = aligned_empty(n)
        assert buf.numel() == n and buf.data_ptr() % ALIGN_BYTES == 0
    assert round_up(1) == 4096 and round_up(8192) == 8192


def test_engine_round_trip_at_offsets(tmp_path, aio_kind):
    engine = open_engine(str(tmp_path), max_in_flight=3)
    try:
        assert engine.which == ("deepspeed-aio" if aio_kind == "deepspeed" else "threads-odirect")
        path = str(tmp_path / "data.swp")
        size = 4 * engine.alignment * 64
        parts = [engine.alloc(size) for _ in range(3)]
        for k, part in enumerate(parts):
            part.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(k)))
        writes = [engine.write(part, path, k * size) for k, part in enumerate(parts)]  # three in flight
        for request in writes:
            request.wait()
            assert request.done()
        assert os.path.getsize(path) == 3 * size
        back = [engine.alloc(size) for _ in range(3)]
        reads = [engine.read(b, path, k * size) for k, b in enumerate(back)]
        for request in reversed(reads):  # waiting out of order is fine
            request.wait()
        for part, b in zip(parts, back):
            assert torch.equal(part, b)
    finally:
        engine.close()


def test_engine_rejects_short_file_and_misalignment(tmp_path, aio_kind):
    engine = open_engine(str(tmp_path))
    try:
        path = str(tmp_path / "short.swp")
        buf = engine.alloc(engine.alignment * 2)
        engine.write(buf[:engine.alignment], path).wait()
        with pytest.raises(OSError, match="past the end"):
            engine.read(buf, path)  # DeepSpeed's op would abort the process here; we raise instead
        with pytest.raises(AssertionError):
            engine.write(buf[:100], path)
    finally:
        engine.close()


def test_engine_choice_and_bad_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROFLOW_AIO", "threads")
    engine = open_engine(str(tmp_path))
    assert engine.which == "threads-odirect"
    engine.close()
    with pytest.raises(UserError, match="expected auto, deepspeed or threads"):
        open_engine(str(tmp_path), prefer="libaio")
    assert odirect_supported(str(tmp_path))


def test_buffered_fallback_where_odirect_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("heteroflow.offload.aio.odirect_supported", lambda d: False)
    engine = open_engine(str(tmp_path), prefer="auto")
    try:
        assert engine.which == "threads-buffered"
        buf = engine.alloc(8192)
        buf.fill_(7)
        engine.write(buf, str(tmp_path / "b.swp")).wait()
        out = engine.alloc(8192)
        engine.read(out, str(tmp_path / "b.swp")).wait()
        assert torch.equal(buf, out)
    finally:
        engine.close()


def test_small_memlock_limit_picks_the_thread_pool(tmp_path, monkeypatch):
    # DeepSpeed's op aborts the process when mlock fails; a small `ulimit -l` must route around it.
    monkeypatch.setattr("heteroflow.offload.aio.memlock_limit_bytes", lambda: float(8 << 20))
    engine = open_engine(str(tmp_path), prefer="auto")
    try:
        assert engine.which == "threads-odirect"
    finally:
        engine.close()
    with pytest.raises(UserError, match="RLIMIT_MEMLOCK"):
        open_engine(str(tmp_path), prefer="deepspeed")
