"""A lock left by a killed DeepSpeed op build must never make a later load wait forever; a live build is waited
for up to a limit, then given up with its processes named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from heteroflow.offload.ops import build_lock_path, build_turn, clear_stale_lock


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


def _aged(path, seconds: float):
    path.touch()
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_lock_no_process_builds_under_is_removed_once_past_the_start_window(tmp_path):
    lock = _aged(tmp_path / "lock", 40)  # a build killed 40 s after it started: not 20 minutes of waiting
    said = []
    start = time.monotonic()
    assert clear_stale_lock(lock, say=said.append) == ""
    assert time.monotonic() - start < 1.0 and not lock.exists()
    assert len(said) == 1 and said[0].startswith(f"removed {lock}: a build of this DeepSpeed op") and "killed" in said[0]


def test_lock_of_a_live_build_is_waited_for_then_given_up_with_its_processes_named(tmp_path):
    lock = _aged(tmp_path / "lock", 3600)  # old, but a compiler still works in the build directory
    compiler = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    try:
        said = []
        start = time.monotonic()
        why = clear_stale_lock(lock, timeout_s=1.0, poll_s=0.05, say=said.append)
        assert time.monotonic() - start < 5.0
        assert f"processes {compiler.pid} work in {tmp_path}" in why and "If no build is running, delete that" in why
        assert lock.exists()  # a live build's lock is never taken away
        assert said == [f"waiting for a build of this DeepSpeed op in progress (processes {compiler.pid}, lock {lock}; "
                        "at most 1 s)"]
    finally:
        compiler.kill()
        compiler.wait()
    assert clear_stale_lock(lock, poll_s=0.05, say=lambda line: None) == "" and not lock.exists()  # now it is stale


def test_a_live_build_that_releases_its_lock_is_waited_for(tmp_path):
    lock = _aged(tmp_path / "lock", 0)
    build = subprocess.Popen(["sh", "-c", "sleep 0.5; rm lock"], cwd=tmp_path)
    said = []
    assert clear_stale_lock(lock, poll_s=0.05, timeout_s=30, say=said.append) == ""
    build.wait()
    assert not lock.exists() and said and said[0].startswith("waiting for a build")


def test_heteroflow_processes_take_turns_and_a_dead_holder_frees_the_turn(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import fcntl, os, time
        fd = os.open({str(tmp_path / "heteroflow-turn")!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with build_turn(tmp_path, timeout_s=0.5, poll_s=0.05) as busy:
            assert "another heteroflow process has been building in" in busy
    finally:
        holder.kill()  # SIGKILL: the kernel lets go of its flock
        holder.wait()
    with build_turn(tmp_path, timeout_s=5, poll_s=0.05) as busy:
        assert busy == ""


@pytest.mark.slow
def test_a_stale_lock_does_not_hold_up_loading_a_built_op(tmp_path):
    """The real op: a copy of this machine's built cpu_adam with a lock left by a killed build loads in seconds."""
    built = build_lock_path("cpu_adam")
    if built is None or not (built.parent / "cpu_adam.so").exists():
        pytest.skip("DeepSpeed's cpu_adam is not built on this machine (building it takes minutes)")
    shutil.copytree(built.parent, tmp_path / "cpu_adam", ignore=shutil.ignore_patterns("lock", "heteroflow-turn"))
    _aged(tmp_path / "cpu_adam" / "lock", 120)
    code = ("from heteroflow.offload.ops import load_deepspeed_op\n"
            "module, why = load_deepspeed_op('CPUAdamBuilder')\n"
            "print('loaded' if module is not None else 'not loaded: ' + why)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.stdout.strip().endswith("loaded"), result.stdout + result.stderr[-3000:]
    assert f"heteroflow: removed {tmp_path / 'cpu_adam' / 'lock'}: a build of this DeepSpeed op" in result.stderr
