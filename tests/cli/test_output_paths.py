"""Output paths are checked before any planning or training: one `NAME: message` line each, exit 2."""

from __future__ import annotations

import os

import pytest

from conftest import REPO
from heteroflow.cli import main
from heteroflow.config.paths import DIR, EXISTING_DIR, FILE, FILE_IN_NEW_DIR, Output, output_problem

PLAN_JOB = str(REPO / "configs" / "jobs" / "emulated-three-vendor.yaml")

TRAIN_JOB = """
    cluster: {nodes: [{name: a, device: cpu, count: 2}]}
    model: {preset: micro-llama}
    train: {global_batch_size: 4, steps: 1%s}
    plan: {micro_batch_size: 2, stages: [{devices: [a], layers: 4, tp: 1, dp: 2}]}
    """


@pytest.fixture
def no_work(monkeypatch):
    """Planning, training, profiling or importing would fail the test: the checks must come first."""
    import heteroflow.launcher.train
    import heteroflow.measure.command
    import heteroflow.megatron
    import heteroflow.stagemap.commands

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the output paths were checked")

    monkeypatch.setattr(heteroflow.stagemap.commands, "plan_command", forbidden)
    monkeypatch.setattr(heteroflow.measure.command, "profile_command", forbidden)
    monkeypatch.setattr(heteroflow.launcher.train, "train_job", forbidden)
    monkeypatch.setattr(heteroflow.megatron, "import_megatron", forbidden)


def run(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()


def test_plan_outputs_into_a_missing_directory(tmp_path, capsys, no_work):
    missing = tmp_path / "missing"
    lines = run(capsys, "plan", PLAN_JOB, "-o", str(missing / "plan.yaml"), "--gantt", str(missing / "g.png"))
    assert lines == [f"-o: cannot write '{missing}/plan.yaml': directory '{missing}' does not exist; create it first",
                     f"--gantt: cannot write '{missing}/g.png': directory '{missing}' does not exist; create it first"]


def test_plan_output_naming_a_directory(tmp_path, capsys, no_work):
    assert run(capsys, "plan", PLAN_JOB, "-o", str(tmp_path)) == [f"-o: '{tmp_path}' is a directory; name a file in it"]


def test_train_metrics_and_log_dir(tmp_path, capsys, write_yaml, no_work):
    job = write_yaml(TRAIN_JOB % "")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    lines = run(capsys, "train", str(job), "--emulate", "--metrics", str(tmp_path), "--log-dir", str(a_file))
    assert lines == [f"--metrics: '{tmp_path}' is a directory; name a file in it",
                     f"--log-dir: '{a_file}' is a file, not a directory; name a directory"]
    lines = run(capsys, "train", str(job), "--emulate", "--metrics", str(a_file / "m.jsonl"))
    assert lines == [f"--metrics: cannot write '{a_file}/m.jsonl': '{a_file}' is not a directory"]


def test_train_job_directories_naming_files(tmp_path, capsys, write_yaml, no_work):
    (tmp_path / "ckpt").write_text("not a directory")
    (tmp_path / "swap").write_text("not a directory")
    job = write_yaml(TRAIN_JOB % ", checkpoint: {dir: ckpt}, offload_dir: swap")
    lines = run(capsys, "train", str(job), "--emulate")
    assert lines == [f"train.checkpoint.dir: '{tmp_path}/ckpt' is a file, not a directory; name a directory",
                     f"train.offload_dir: '{tmp_path}/swap' is a file, not a directory; name a directory"]


def test_train_offload_dir_below_a_file(tmp_path, capsys, write_yaml, no_work):
    (tmp_path / "f").write_text("x")
    job = write_yaml(TRAIN_JOB % ", offload_dir: f/swap")
    assert run(capsys, "train", str(job), "--emulate") == [
        f"train.offload_dir: directory '{tmp_path}/f/swap': cannot create it: '{tmp_path}/f' is not a directory"]


def test_profile_and_import_megatron_outputs(tmp_path, capsys, no_work):
    assert run(capsys, "profile", "-o", str(tmp_path / "no" / "p.yaml"), "--disk-dir", str(tmp_path / "none")) == [
        f"-o: cannot write '{tmp_path}/no/p.yaml': directory '{tmp_path}/no' does not exist; create it first",
        f"--disk-dir: directory '{tmp_path}/none' does not exist"]
    assert run(capsys, "import-megatron", "x.sh", "-o", str(tmp_path), "--plan-out", str(tmp_path / "n" / "p")) == [
        f"-o: '{tmp_path}' is a directory; name a file in it",
        f"--plan-out: cannot write '{tmp_path}/n/p': directory '{tmp_path}/n' does not exist; create it first"]


@pytest.mark.parametrize("kind", [FILE, FILE_IN_NEW_DIR, DIR, EXISTING_DIR])
def test_good_outputs_pass(tmp_path, kind):
    path = tmp_path / "out" if kind in (FILE, DIR) else tmp_path / "new" / "deeper" / "out"
    if kind == EXISTING_DIR:
        path = tmp_path
    assert output_problem(Output("x", str(path), kind)) is None


def test_metrics_directories_are_created_by_the_run(tmp_path):
    assert output_problem(Output("--metrics", str(tmp_path / "runs" / "m.jsonl"), FILE_IN_NEW_DIR)) is None
    assert output_problem(Output("-o", str(tmp_path / "runs" / "p.yaml"), FILE)) is not None


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only directories")
def test_read_only_directories(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        assert output_problem(Output("train.offload_dir", str(ro), DIR)) == f"directory '{ro}' is not writable"
        assert output_problem(Output("train.offload_dir", str(ro / "swap"), DIR)) == (
            f"directory '{ro}/swap': cannot create it: directory '{ro}' is not writable")
        assert "is not writable" in output_problem(Output("-o", str(ro / "p.yaml"), FILE))
    finally:
        ro.chmod(0o700)


def test_read_only_offload_dir_is_reported_before_training(tmp_path, capsys, write_yaml, no_work, monkeypatch):
    (tmp_path / "swap").mkdir()
    job = write_yaml(TRAIN_JOB % ", offload_dir: swap")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == f"{tmp_path}/swap" else real_access(p, mode))
    assert run(capsys, "train", str(job), "--emulate") == [
        f"train.offload_dir: directory '{tmp_path}/swap' is not writable"]
