"""Checkpoint directories: a killed save leaves the previous checkpoint intact, pruning keeps N, loading
refuses files outside the checkpoint, and the resume checks the CLI runs before launching."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from heteroflow.checkpoint import MARKER, complete_checkpoints, latest_checkpoint
from heteroflow.checkpoint import save as save_module
from heteroflow.checkpoint.pieces import CheckpointReader, Piece
from heteroflow.checkpoint.save import save_checkpoint
from heteroflow.config import parse_job
from heteroflow.errors import UserError
from heteroflow.launcher.prepare import prepare_resume


def value(step: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).view(3, 4) + step


def save(root, step: int, **kwargs):
    piece = Piece("param", "w", (3, 4), ((0, 3), (0, 4)), value(step))
    return save_checkpoint(root, step, [piece], {"model": {}, "optimizer_steps": step}, scratch_id="c3", **kwargs)


def read_w(step_dir) -> torch.Tensor:
    with CheckpointReader(step_dir) as reader:
        return reader.read("param", "w", ((0, 3), (0, 4)), shape=(3, 4), dtype=torch.float32)


def test_failure_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    first = save(tmp_path, 10)

    def fail(*args):
        raise OSError("disk on fire")

    monkeypatch.setattr(save_module, "publish", fail)
    with pytest.raises(OSError, match="disk on fire"):
        save(tmp_path, 20)
    assert latest_checkpoint(tmp_path) == first
    assert (tmp_path / "step-000020.tmp-c3").is_dir()  # the partial save is there, but not a checkpoint
    assert torch.equal(read_w(first), value(10))
    assert latest_checkpoint(tmp_path, clean=True) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010"]


KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from heteroflow.checkpoint import save as save_module
    from heteroflow.checkpoint.pieces import Piece
    root, where = sys.argv[1], sys.argv[2]
    def save(step):
        piece = Piece("param", "w", (3, 4), ((0, 3), (0, 4)), torch.arange(12.0).view(3, 4) + step)
        save_module.save_checkpoint(root, step, [piece], {"model": {}, "optimizer_steps": step}, scratch_id="d4")
    save(10)
    real = getattr(save_module, where)
    def killed(*args, **kwargs):
        if where == "write_json" and not str(args[0]).endswith("heteroflow-checkpoint.json"):
            return real(*args, **kwargs)  # die on the marker, after the index and metadata are written
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(save_module, where, killed)
    save(20)
    """)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write_rank_file", "write_json", "publish"])
def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, where):
    result = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path), where], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert (tmp_path / "step-000020.tmp-d4").is_dir()
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-000010"
    assert torch.equal(read_w(latest), value(10))
    latest_checkpoint(tmp_path, clean=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010"]


def test_keep_n_prunes_the_oldest_complete_checkpoints(tmp_path):
    for step in (3, 6, 9, 12, 15):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [12, 15]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000012", "step-000015"]
    again = save(tmp_path, 15, keep=2)  # a second save of the same step replaces it
    assert torch.equal(read_w(again), value(15))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000012", "step-000015"]


def test_unmarked_and_symlinked_step_dirs_are_not_checkpoints(tmp_path):
    real = save(tmp_path / "elsewhere", 50)
    root = tmp_path / "ckpt"
    good = save(root, 5)
    (root / "step-000099").mkdir()  # no marker: e.g. copied by hand, half done
    (root / "step-000077").symlink_to(real, target_is_directory=True)
    assert latest_checkpoint(root) == good
    latest_checkpoint(root, clean=True)
    assert not (root / "step-000099").exists() and (root / "step-000077").is_symlink() and real.is_dir()


def _tamper_index(step_dir, file_name: str) -> None:
    index_path = step_dir / "index.json"
    index = json.loads(index_path.read_text())
    index["entries"][0]["file"] = file_name
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_index_names_outside_the_checkpoint_are_refused(tmp_path, name):
    step_dir = save(tmp_path / "ckpt", 1)
    save(tmp_path, 1)  # a real safetensors file one level up, where '..' would lead
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "step-000001" / "rank-00000.safetensors").read_bytes())
    _tamper_index(step_dir, name)
    with pytest.raises(UserError, match="refusing file"):
        CheckpointReader(step_dir)


def test_symlink_escaping_the_checkpoint_is_refused(tmp_path):
    step_dir = save(tmp_path / "ckpt", 1)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((step_dir / "rank-00000.safetensors").read_bytes())
    (step_dir / "link.safetensors").symlink_to(outside)
    _tamper_index(step_dir, "link.safetensors")
    with pytest.raises(UserError, match="outside the checkpoint directory"):
        CheckpointReader(step_dir)


def test_a_pickle_named_in_the_index_is_never_unpickled(tmp_path):
    step_dir = save(tmp_path, 1)
    torch.save({"w": value(1)}, step_dir / "weights.pt")
    _tamper_index(step_dir, "weights.pt")
    with CheckpointReader(step_dir) as reader, pytest.raises(UserError, match="not a readable safetensors file"):
        reader.read("param", "w", ((0, 3), (0, 4)), shape=(3, 4), dtype=torch.float32)


def test_missing_pieces_are_reported(tmp_path):
    piece = Piece("param", "w", (3, 4), ((0, 2), (0, 4)), value(0)[:2])
    step_dir = save_checkpoint(tmp_path, 1, [piece], {"model": {}, "optimizer_steps": 1})
    with CheckpointReader(step_dir) as reader, pytest.raises(UserError, match="cover 8 of the 12 elements"):
        reader.read("param", "w", ((0, 3), (0, 4)), shape=(3, 4), dtype=torch.float32)


JOB = {"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 1}]}, "model": {"preset": "micro-llama"},
       "train": {"global_batch_size": 4}}


def test_resume_checks_before_launch(tmp_path):
    bare = parse_job(JOB)
    with pytest.raises(UserError, match="--resume needs a checkpoint directory"):
        prepare_resume(bare, resume=True)
    assert prepare_resume(bare, resume=False) is None
    job = parse_job({**JOB, "train": {**JOB["train"], "checkpoint": {"dir": str(tmp_path), "interval": 2}}})
    assert "no complete checkpoint" in prepare_resume(job, resume=True)
    meta = {"model": job.model.to_dict(), "optimizer_steps": 4, "plan": {"stages": [{}, {}]}}
    piece = Piece("param", "w", (3, 4), ((0, 3), (0, 4)), value(0))
    save_checkpoint(tmp_path, 4, [piece], meta)
    assert "resuming from" in prepare_resume(job, resume=True) and "2-stage" in prepare_resume(job, resume=True)
    with pytest.raises(UserError, match="already holds checkpoints.*--resume"):
        prepare_resume(job, resume=False)
    other = parse_job({**JOB, "model": {"preset": "micro-llama", "num_layers": 3},
                       "train": job.train.to_dict()})
    with pytest.raises(UserError, match=r"another model[\s\S]*num_layers: checkpoint 4, job 3"):
        prepare_resume(other, resume=True)
    assert MARKER == "heteroflow-checkpoint.json" and os.path.isfile(tmp_path / "step-000004" / MARKER)
