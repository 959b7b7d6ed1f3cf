"""`train.loss_scale` and the dynamic scaler's settings: strictly checked, each problem with its path."""

from __future__ import annotations

import pytest

from heteroflow.config import parse_job
from conftest import problems

BASE = {"cluster": {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 1}]},
        "model": {"preset": "micro-llama"}}


def job_problems(**train) -> list[str]:
    return problems({**BASE, "train": {"global_batch_size": 8, **train}})


def test_defaults_and_accepted_values():
    train = parse_job({**BASE, "train": {"global_batch_size": 8}}).train
    assert (train.loss_scale, train.initial_loss_scale, train.min_loss_scale) == (None, 2.0**32, 1.0)
    assert (train.loss_scale_window, train.hysteresis) == (1000, 2)
    assert "loss_scale" not in train.to_dict()  # unset: chosen from the stages' precisions at run time
    for value in ("dynamic", 1, 0.25, 65536):
        assert job_problems(loss_scale=value) == []
    train = parse_job({**BASE, "train": {"global_batch_size": 8, "loss_scale": 128}}).train
    assert train.loss_scale == 128.0
    train = parse_job({**BASE, "train": {"global_batch_size": 8, "loss_scale_window": 2.0}}).train
    assert train.loss_scale_window == 2 and isinstance(train.loss_scale_window, int)


@pytest.mark.parametrize("train,expected", [
    ({"loss_scale": "dynmic"}, "train.loss_scale: must be one of dynamic; got 'dynmic' (did you mean 'dynamic'?)"),
    ({"loss_scale": float("inf")}, "train.loss_scale: must be a finite number above 0 and at most 1e+30, got inf"),
    ({"loss_scale": 0}, "train.loss_scale: must be above 0 and at most 1e+30, got 0"),
    ({"loss_scale": True}, "train.loss_scale: expected a number, got a boolean True"),
    ({"initial_loss_scale": float("nan")}, "train.initial_loss_scale: must be a finite number above 0 and at most 1e+30, got nan"),
    ({"initial_loss_scale": 1e999}, "train.initial_loss_scale: must be a finite number above 0 and at most 1e+30, got inf"),
    ({"min_loss_scale": -1}, "train.min_loss_scale: must be above 0 and at most 1e+30, got -1"),
    ({"loss_scale_window": 0}, "train.loss_scale_window: must be between 1 and 1000000000, got 0"),
    ({"hysteresis": 1.5}, "train.hysteresis: expected an integer, got a number 1.5"),
    ({"hysteresis": "2"}, "train.hysteresis: expected an integer, got a string '2'"),
    ({"initial_loss_scale": 4, "min_loss_scale": 8},
     "train.min_loss_scale: 8 is above initial_loss_scale 4; min_loss_scale must not exceed it"),
    ({"loss_scale": 4, "hysteresis": 3}, "train.hysteresis: applies to dynamic loss scaling only, but loss_scale "
                                         "is the static 4; remove it, or set loss_scale: dynamic"),
])
def test_bad_values_name_the_path(train, expected):
    assert job_problems(**train) == [expected]


def test_every_problem_at_once():
    found = job_problems(loss_scale="x", hysteresis=0, loss_scale_window=-3, min_loss_scale=0)
    assert [line.split(":")[0] for line in found] == ["train.loss_scale", "train.min_loss_scale",
                                                      "train.loss_scale_window", "train.hysteresis"]
