"""A lock left by a killed DeepSpeed op build must never make a later load wait forever."""

from __future__ import annotations

import os
import threading
import time

from heteroflow.offload.ops import build_lock_path, clear_stale_lock


def test_old_lock_is_removed_at_once(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    start = time.monotonic()
    clear_stale_lock(lock, stale_after_s=1200)
    assert not lock.exists()
    assert time.monotonic() - start < 1.0


def test_fresh_lock_is_waited_for_until_its_build_releases_it(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    releaser = threading.Timer(0.3, lock.unlink)
    releaser.start()
    start = time.monotonic()
    clear_stale_lock(lock, stale_after_s=60, poll_s=0.05)
    releaser.join()
    assert 0.25 <= time.monotonic() - start < 5.0
    assert not lock.exists()


def test_fresh_lock_never_released_is_removed_once_it_turns_stale(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    start = time.monotonic()
    clear_stale_lock(lock, stale_after_s=0.5, poll_s=0.05)
    assert not lock.exists()
    assert 0.4 <= time.monotonic() - start < 5.0


def test_no_lock_returns_at_once(tmp_path):
    clear_stale_lock(tmp_path / "lock", stale_after_s=0.1)


def test_lock_path_is_in_torch_extension_build_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = build_lock_path("async_io")
    assert lock is not None and lock.name == "lock" and lock.parent.name == "async_io"
    assert tmp_path in lock.parents
