"""Fault injection into checkpoints: every kind of damage to the newest one is found by its checksums
before anything loads it, reported with the file and the problem, moved aside (never deleted), and the
run falls back to the previous intact checkpoint.

Checkpoints come from two fake ranks (threads, as in test_checkpoint_roundtrip) at steps 10 and 20,
with the same shapes, so files of one can stand in for files of the other.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from conftest import REPO
from heteroflow.checkpoint.files import MARKER, clean_incomplete, complete_checkpoints
from heteroflow.checkpoint.pieces import CheckpointReader, Piece
from heteroflow.checkpoint.save import save_checkpoint
from heteroflow.checkpoint.verify import (CheckpointDamaged, NoIntactCheckpoint, checkpoint_to_resume, newest_intact,
                                          verify_checkpoint)
from heteroflow.errors import UserError

RANK0, RANK1 = "rank-00000.safetensors", "rank-00001.safetensors"


def value(step: int, rank: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32).view(16, 16) + 1000 * rank + step


def save(root, step: int):
    """Checkpoint `step` written by 2 fake ranks, each storing half of `w`'s rows."""
    barrier = threading.Barrier(2, timeout=60)
    out, errors = [None, None], []

    def rank_main(rank):
        try:
            piece = Piece("param", "w", (32, 16), ((16 * rank, 16 * rank + 16), (0, 16)), value(step, rank))
            meta = {"model": {}, "optimizer_steps": step, "plan": {"stages": [{}]}}
            out[rank] = save_checkpoint(root, step, [piece], meta, rank=rank, world_size=2, barrier=barrier.wait,
                                        scratch_id="e5")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out[0]


def read_w(step_dir) -> torch.Tensor:
    with CheckpointReader(step_dir) as reader:
        return reader.read("param", "w", ((0, 32), (0, 16)), shape=(32, 16), dtype=torch.float32)


def flip_bit(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


def random_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start:start + 64] = random.Random(7).randbytes(64)
    path.write_bytes(bytes(data))


def edit_optimizer_steps(step_dir) -> None:
    path = step_dir / "metadata.json"
    text = path.read_text()
    assert '"optimizer_steps": 20' in text
    path.write_text(text.replace('"optimizer_steps": 20', '"optimizer_steps": 99'))  # same size


def edit_marker(step_dir) -> None:
    path = step_dir / MARKER
    marker = json.loads(path.read_text())
    marker["saved_unix_s"] += 1
    path.write_text(json.dumps(marker))


def copy_from_older(name: str):
    def damage(step_dir):
        (step_dir / name).write_bytes((step_dir.parent / "step-000010" / name).read_bytes())
    return damage


# (damage applied to step-000020, the file the report must name, the reason in the moved directory's name)
DAMAGE = {
    "flip-bit-rank-file-data": (lambda d: flip_bit(d / RANK1, -5), RANK1, "checksum"),
    "flip-bit-rank-file-header": (lambda d: flip_bit(d / RANK0, 40), RANK0, "checksum"),
    "flip-bit-index": (lambda d: flip_bit(d / "index.json", 100), "index.json", "checksum"),
    "flip-bit-metadata": (lambda d: flip_bit(d / "metadata.json", 200), "metadata.json", "checksum"),
    "flip-bit-marker": (lambda d: flip_bit(d / MARKER, 30), MARKER, "marker"),
    "random-bytes-rank-file": (lambda d: random_bytes(d / RANK0), RANK0, "checksum"),
    "truncate-rank-file": (lambda d: os.truncate(d / RANK1, os.path.getsize(d / RANK1) // 2), RANK1, "truncated"),
    "truncate-metadata": (lambda d: os.truncate(d / "metadata.json", 10), "metadata.json", "truncated"),
    "append-to-rank-file": (lambda d: open(d / RANK0, "ab").write(b"\0" * 8), RANK0, "size"),
    "delete-rank-file": (lambda d: os.unlink(d / RANK1), RANK1, "missing-file"),
    "delete-index": (lambda d: os.unlink(d / "index.json"), "index.json", "missing-file"),
    "older-rank-file": (copy_from_older(RANK1), RANK1, "stale-file"),
    "older-index": (copy_from_older("index.json"), "index.json", "checksum"),
    "older-metadata": (copy_from_older("metadata.json"), "metadata.json", "checksum"),
    "edit-optimizer-steps": (edit_optimizer_steps, "metadata.json", "checksum"),
    "edit-marker": (edit_marker, MARKER, "marker"),
    "remove-marker": (lambda d: os.unlink(d / MARKER), MARKER, "no-marker"),
}


@pytest.fixture
def two_checkpoints(tmp_path):
    """`root` holding intact checkpoints at steps 10 and 20."""
    root = tmp_path / "ckpt"
    save(root, 10)
    save(root, 20)
    return root


def test_intact_checkpoints_verify(two_checkpoints):
    for _, step_dir in complete_checkpoints(two_checkpoints):
        assert verify_checkpoint(step_dir) is None
    lines = []
    assert newest_intact(two_checkpoints, report=lines.append) == two_checkpoints / "step-000020"
    assert lines == [] and torch.equal(read_w(two_checkpoints / "step-000020")[16:], value(20, 1))


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_reported_moved_aside_and_skipped(two_checkpoints, kind):
    damage, file, reason = DAMAGE[kind]
    newest = two_checkpoints / "step-000020"
    damage(newest)
    with pytest.raises(CheckpointDamaged) as caught:
        verify_checkpoint(newest)
    assert (caught.value.file, caught.value.reason) == (file, reason), str(caught.value)
    lines = []
    assert newest_intact(two_checkpoints, report=lines.append) == two_checkpoints / "step-000010"
    assert len(lines) == 1, lines
    assert f"checkpoint {newest} is damaged: {file}:" in lines[0]
    assert f"moved aside to step-000020.damaged-{reason}" in lines[0] and "falling back" in lines[0]
    moved = two_checkpoints / f"step-000020.damaged-{reason}"
    assert not newest.exists() and moved.is_dir() and any(moved.iterdir())  # kept, not deleted
    assert [s for s, _ in complete_checkpoints(two_checkpoints)] == [10]
    assert torch.equal(read_w(two_checkpoints / "step-000010")[:16], value(10, 0))


def test_resume_falls_back_past_several_damaged_and_never_overwrites_a_moved_copy(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    flip_bit(tmp_path / "step-000030" / RANK0, -1)
    flip_bit(tmp_path / "step-000020" / "metadata.json", 50)
    lines = []
    assert checkpoint_to_resume(tmp_path, report=lines.append) == tmp_path / "step-000010"
    assert len(lines) == 2
    assert "step-000030 is damaged: rank-00000.safetensors: checksum mismatch" in lines[0]
    assert "step-000020 is damaged: metadata.json: checksum mismatch" in lines[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010", "step-000020.damaged-checksum",
                                                          "step-000030.damaged-checksum"]
    save(tmp_path, 30)  # damaged the same way again: the first copy moved aside stays as it is
    flip_bit(tmp_path / "step-000030" / RANK0, -1)
    assert checkpoint_to_resume(tmp_path, report=lines.append) == tmp_path / "step-000010"
    assert (tmp_path / "step-000030.damaged-checksum-2").is_dir() and (tmp_path / "step-000030.damaged-checksum").is_dir()


def test_resume_with_every_checkpoint_damaged_is_a_user_error(tmp_path):
    assert checkpoint_to_resume(tmp_path / "missing") is None and checkpoint_to_resume(tmp_path) is None
    save(tmp_path, 10)
    os.unlink(tmp_path / "step-000010" / MARKER)
    assert checkpoint_to_resume(tmp_path) is None  # unmarked: never a checkpoint; start at step 0
    save(tmp_path, 20)
    os.truncate(tmp_path / "step-000020" / RANK0, 100)
    with pytest.raises(NoIntactCheckpoint, match="every checkpoint in .* is damaged") as caught:
        checkpoint_to_resume(tmp_path, report=lambda line: None)
    assert isinstance(caught.value, UserError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010.damaged-no-marker",
                                                          "step-000020.damaged-truncated"]
    assert complete_checkpoints(tmp_path) == []  # a fresh run may now start in this directory


def test_cleaning_moves_an_unmarked_step_dir_aside_instead_of_deleting_it(tmp_path):
    save(tmp_path, 10)
    os.unlink(tmp_path / "step-000010" / MARKER)
    (tmp_path / "step-000011.tmp-ab").mkdir()
    clean_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010.damaged-no-marker"]


def test_checkpoints_without_checksums_still_load_with_a_note(two_checkpoints):
    newest = two_checkpoints / "step-000020"
    (newest / MARKER).write_text(json.dumps({"format": "heteroflow-checkpoint", "version": 1, "step": 20}))
    lines = []
    assert newest_intact(two_checkpoints, report=lines.append) == newest
    assert len(lines) == 1 and "before checkpoints had checksums" in lines[0]


@pytest.mark.slow
def test_train_resume_from_the_cli_skips_a_damaged_newest_checkpoint(tmp_path, write_yaml):
    pytest.importorskip("heteroflow.stagemap", reason="heteroflow train needs heteroflow.stagemap (cost model)")
    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
    job = write_yaml("""
        cluster: {nodes: [{name: a, device: cpu, count: 2}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, micro_batch_size: 2, precision: fp32, steps: 3, warmup_steps: 1,
                checkpoint: {dir: ckpt, interval: 1, keep: 2}}
        plan: {micro_batch_size: 2, stages: [{devices: ["a:0-0"], layers: 1}, {devices: ["a:1-1"], layers: 3}]}
        """)
    ckpt = tmp_path / "ckpt"

    def heteroflow(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                              timeout=600, cwd=REPO, env=env)

    first = heteroflow("train", str(job), "--emulate", "--steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    flip_bit(ckpt / "step-000002" / RANK1, -3)
    resumed = heteroflow("train", str(job), "--emulate", "--resume")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert f"checkpoint {ckpt / 'step-000002'} is damaged: {RANK1}: checksum mismatch" in output
    assert "done, 2 steps (resumed at step 1)" in resumed.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002", "step-000002.damaged-checksum", "step-000003"]
