"""`train.compile: true`: each block compiled with torch.compile trains to the eager run's losses; where the device's
compiler does not work the run stops with a `train.compile: ...` error instead of a traceback."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import problems
from heteroflow.config import PRESETS, parse_job
from heteroflow.errors import UserError
from heteroflow.models import build_stage_model
from heteroflow.models import compile as compile_module
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing.training import run_training

JOB = {"cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 2}]},
       "model": {"preset": "micro-llama"},
       "train": {"global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32", "steps": 3, "lr": 3e-3,
                 "min_lr": 3e-4, "warmup_steps": 1},
       "plan": {"schedule": "1f1b", "micro_batch_size": 2,
                "stages": [{"devices": ["host:0-0"], "layers": 2}, {"devices": ["host:1-1"], "layers": 2}]}}


def test_compile_is_a_boolean_and_off_by_default():
    assert parse_job(JOB).train.compile is False
    assert parse_job({**JOB, "train": {**JOB["train"], "compile": True}}).train.compile is True
    assert problems({**JOB, "train": {**JOB["train"], "compile": "yes"}})[0] == \
        "train.compile: expected true or false, got a string 'yes'"


def test_a_device_without_a_working_compiler_is_a_user_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    compile_module.compiler_problem.cache_clear()
    model = build_stage_model(PRESETS["micro-llama"], first_layer=0, last_layer=2, is_first=True, is_last=False)
    try:
        with pytest.raises(UserError) as error:
            compile_module.compile_blocks(model, device_type="cpu")
    finally:
        compile_module.compiler_problem.cache_clear()
    message = str(error.value)
    assert message.startswith("train.compile: torch.compile cannot compile for the cpu device here")
    assert "No working C++ compiler found" in message and "more detail" not in message
    assert message.endswith("install a C++ compiler (g++ or clang) for inductor's CPU code, or set train.compile: false")


@pytest.mark.slow
def test_compiled_blocks_train_to_the_eager_losses(tmp_path):
    """Two pipeline stages of micro-llama, fp32, three steps: the same losses within float tolerance."""
    losses = {}
    for compiled in (False, True):
        job = parse_job({**JOB, "train": {**JOB["train"], "compile": compiled}})
        args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=3, show_progress=False,
                          data_dir=os.path.join(tmp_path, "data"), timeout_s=900)
        losses[compiled] = run_training(args, timeout_s=900)[0].losses
    assert len(losses[True]) == 3 and losses[True][-1] < losses[True][0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
