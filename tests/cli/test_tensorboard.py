"""TensorBoard scalars from rank 0: every scalar of every step read back from the event file, the missing
package named in a clear error, the log interval."""

from __future__ import annotations

import sys

import pytest

from conftest import run_heteroflow
from heteroflow.cli import main
from heteroflow.runtime.metrics import StepRecord, read_step_records
from heteroflow.runtime.tensorboard import step_scalars

JOB = """\
cluster: {nodes: [{name: a, device: cpu, count: 2}]}
model: {preset: micro-llama}
train: {global_batch_size: 4, steps: 4, precision: fp32, tensorboard_dir: tb}
plan: {micro_batch_size: 2, stages: [{devices: ["a:0"], layers: 2}, {devices: ["a:1"], layers: 2}]}
"""


def _event_scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


@pytest.mark.slow
def test_every_scalar_of_every_step_is_in_the_event_file(write_yaml, tmp_path, cache_env):
    pytest.importorskip("tensorboard")
    job = write_yaml(JOB)
    metrics = tmp_path / "metrics.jsonl"
    result = run_heteroflow("train", str(job), "--emulate", "--metrics", str(metrics), env=cache_env, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = _event_scalars(tmp_path / "tb")
    records = read_step_records(metrics)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for required in ("train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/tokens_per_s",
                     "train/step_time_s", "stage0/measured/forward_s", "stage1/predicted/backward_s",
                     "stage0/measured/step_s", "stage1/memory/measured_peak_bytes",
                     "stage0/memory/planned_peak_bytes"):
        assert required in found, sorted(found)
    for record in records:
        want = step_scalars(StepRecord(**record))
        assert set(want) <= set(found)
        for tag, value in want.items():
            assert found[tag][record["step"]] == pytest.approx(value, rel=1e-6), tag  # stored as float32
    assert set(found) == set(want)  # nothing else written
    # the memory figure is the largest of the stage's ranks; here one rank per stage
    assert found["stage1/memory/measured_peak_bytes"][3] == records[3]["memory"]["ranks"][1]["measured"]["peak"]


def test_the_log_interval_thins_the_steps(tmp_path):
    """train.tensorboard_log_interval (Megatron's --tensorboard-log-interval): every interval-th step."""
    pytest.importorskip("tensorboard")
    from heteroflow.runtime.tensorboard import TensorBoardWriter
    writer = TensorBoardWriter(tmp_path / "tb", interval=3)
    for step in range(7):
        writer.write(StepRecord(step=step, loss=5.0 - step, tokens_per_s=1.0, step_time_s=0.5, lr=1e-3,
                                grad_norm=1.0))
    writer.close()
    found = _event_scalars(tmp_path / "tb")
    assert sorted(found["train/loss"]) == [0, 3, 6] and found["train/loss"][3] == 2.0


def test_missing_tensorboard_is_a_clear_error(write_yaml, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    job = write_yaml(JOB)
    assert main(["train", str(job), "--emulate"]) == 2
    err = capsys.readouterr().err
    assert "train.tensorboard_dir needs the tensorboard package, which is not installed: pip install " \
           "'heteroflow[tensorboard]'" in err and "Traceback" not in err
    assert main(["train", str(job), "--emulate", "--tensorboard-dir", str(tmp_path / "x")]) == 2
    assert "--tensorboard-dir needs the tensorboard package" in capsys.readouterr().err
