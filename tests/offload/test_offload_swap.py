"""Swap directories are scratch: removed on exit, on errors and on SIGTERM; never inside a checkpoint;
free space is checked with a clear message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest

from heteroflow.errors import UserError
from heteroflow.offload.swap import SCRATCH_MARKER, SwapDir, live_swap_dirs, sweep_stale

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time, torch
from heteroflow.devices import Device
from heteroflow.offload.store import TieredStore
from heteroflow.offload.swap import SwapDir

swap = SwapDir(sys.argv[1], headroom_bytes=0)
store = TieredStore(device=Device.cpu(), swap=swap)
store.add("w", [torch.ones(100000)], "ssd")
store.wait_all()
print(swap.path, flush=True)
mode = sys.argv[2]
if mode == "with-error":
    with SwapDir(sys.argv[1], headroom_bytes=0) as inner:
        print(inner.path, flush=True)
        raise RuntimeError("boom inside with")
if mode == "error":
    raise RuntimeError("boom")
if mode == "wait":
    time.sleep(60)
"""


def _child(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = dict(os.environ, PYTHONPATH=str(REPO), HETEROFLOW_AIO="threads")
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "root"), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _swap_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("heteroflow-swap-*"))


@pytest.mark.parametrize("mode, code", [("normal", 0), ("error", 1), ("with-error", 1)])
def test_removed_after_exit_and_after_an_exception(tmp_path, mode, code):
    child = _child(tmp_path, mode)
    out, err = child.communicate(timeout=120)
    assert child.returncode == code, err
    paths = [Path(line) for line in out.split()]
    assert paths and all(p.parent == tmp_path / "root" for p in paths)
    assert not any(p.exists() for p in paths), "swap directory left behind"
    assert _swap_dirs(tmp_path / "root") == []
    if mode != "normal":
        assert "boom" in err


def test_removed_after_sigterm(tmp_path):
    child = _child(tmp_path, "wait")
    try:
        path = Path(child.stdout.readline().strip())
        assert path.is_dir() and (path / SCRATCH_MARKER).is_file() and any(path.glob("*.swp"))
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM  # still dies by the signal, as the parent expects
    assert not path.exists()


def test_stale_directories_of_dead_processes_are_swept(tmp_path):
    root = tmp_path / "root"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f"heteroflow-swap-{dead.pid}-abc"
    stale.mkdir(parents=True)
    (stale / SCRATCH_MARKER).write_text("x")
    (stale / "w.swp").write_bytes(b"0" * 10)
    unmarked = root / f"heteroflow-swap-{dead.pid}-def"  # not ours: no marker, never deleted
    unmarked.mkdir()
    assert sweep_stale(root) == [stale]
    assert not stale.exists() and unmarked.exists()


def test_context_manager_removes_and_unregisters(tmp_path):
    with SwapDir(tmp_path, headroom_bytes=0) as swap:
        assert swap.path in live_swap_dirs()
        Path(swap.file("layer.0/weight")).write_bytes(b"x")
    assert not swap.path.exists() and swap.path not in live_swap_dirs()


def test_free_space_error_names_path_and_numbers(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("heteroflow.offload.swap.shutil.disk_usage", lambda p: usage(10 * 2**30, 0, 3 * 2**30))
    with SwapDir(tmp_path, headroom_bytes=2**30) as swap:
        swap.check_free(2 * 2**30)  # fits exactly with the headroom
        with pytest.raises(UserError) as info:
            swap.reserve(5 * 2**30)
    message = str(info.value)
    assert str(tmp_path.resolve()) in message
    assert "5.00 GiB (5368709120 bytes)" in message and "3.00 GiB (3221225472 bytes)" in message
    assert "1.00 GiB headroom" in message


def test_store_checks_free_space_before_writing(tmp_path, monkeypatch):
    import torch

    from heteroflow.devices import Device
    from heteroflow.offload.store import TieredStore

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("heteroflow.offload.swap.shutil.disk_usage", lambda p: usage(2**20, 0, 2**16))
    with SwapDir(tmp_path, headroom_bytes=0) as swap, TieredStore(device=Device.cpu(), swap=swap) as store:
        with pytest.raises(UserError, match="not enough free disk space"):
            store.add("big", [torch.ones(100000)], "ssd")
        assert not list(swap.path.glob("*.swp"))


def test_refuses_swap_inside_a_checkpoint_dir(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(UserError, match="inside the checkpoint directory"):
        SwapDir(ckpt / "swap", checkpoint_dirs=[ckpt])
    with pytest.raises(UserError, match="inside the checkpoint directory"):
        SwapDir(ckpt, checkpoint_dirs=[str(ckpt)])
    marked = tmp_path / "megatron-run"
    marked.mkdir()
    (marked / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(UserError, match="holds latest_checkpointed_iteration.txt"):
        SwapDir(marked / "scratch")
    with SwapDir(tmp_path / "elsewhere", checkpoint_dirs=[ckpt], headroom_bytes=0) as ok:
        assert ok.path.is_dir()
    assert not (ckpt / "swap").exists()
