"""The loss scaler's state machine against Megatron's `DynamicGradScaler`, and which jobs scale their loss."""

from __future__ import annotations

import random

import pytest

from heteroflow.config import parse_job
from heteroflow.errors import UserError
from heteroflow.optim.loss_scale import LossScaler

CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 1}]}


class MegatronDynamicGradScaler:
    """Megatron-LM's `DynamicGradScaler.update` (megatron/core/optimizer/grad_scaler.py), with floats for
    its one-element tensors: the semantics the scaler must follow."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self._scale, self.min_scale = initial_scale, min_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor


def test_defaults_are_megatrons():
    job = parse_job({"cluster": CLUSTER, "model": {"preset": "micro-llama"},
                     "train": {"global_batch_size": 8, "precision": "fp16"}})
    scaler = LossScaler.for_job(job.train, ["fp16"])
    assert (scaler.scale, scaler.min_scale, scaler.growth_interval, scaler.hysteresis) == (2.0**32, 1.0, 1000, 2)
    assert (scaler.backoff_factor, scaler.growth_factor, scaler.dynamic) == (0.5, 2.0, True)


def test_hysteresis_backs_off_on_the_second_overflow_then_on_each():
    scaler = LossScaler(scale=1024.0, hysteresis=2, growth_interval=3)
    scaler.update(True)
    assert (scaler.scale, scaler.hysteresis_tracker) == (1024.0, 1)  # the first overflow is tolerated
    scaler.update(False)
    scaler.update(True)
    assert (scaler.scale, scaler.hysteresis_tracker) == (512.0, 0)
    scaler.update(True)  # no growth since: every further overflow halves
    assert scaler.scale == 256.0


def test_window_of_clean_steps_doubles_and_refills_hysteresis():
    scaler = LossScaler(scale=8.0, hysteresis=2, growth_interval=3)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 4.0
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 4.0 and scaler.growth_tracker == 2
    scaler.update(False)
    assert (scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker) == (8.0, 0, 2)
    scaler.update(False)
    scaler.update(True)  # an overflow resets the window
    assert scaler.growth_tracker == 0 and scaler.scale == 8.0


def test_min_scale_bounds_the_back_off_and_counts_stuck_overflows():
    scaler = LossScaler(scale=4.0, min_scale=2.0, hysteresis=1, growth_interval=10)
    scaler.update(True)
    assert scaler.scale == 2.0 and scaler.stuck_overflows == 0  # it could still back off
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 2.0 and scaler.stuck_overflows == 2
    scaler.update(False)
    assert scaler.stuck_overflows == 0


def test_static_scale_never_changes_but_counts_overflows():
    scaler = LossScaler(scale=128.0, dynamic=False)
    for found_inf in (True, False, True, True):
        scaler.update(found_inf)
    assert scaler.scale == 128.0 and scaler.stuck_overflows == 2


@pytest.mark.parametrize("hysteresis,window,p_inf", [(1, 1, 0.5), (2, 3, 0.3), (3, 5, 0.2), (2, 1000, 0.01)])
def test_matches_megatron_on_random_overflow_sequences(hysteresis, window, p_inf):
    rng = random.Random(hysteresis * 100 + window)
    ours = LossScaler(scale=2.0**16, min_scale=4.0, growth_interval=window, hysteresis=hysteresis)
    megatron = MegatronDynamicGradScaler(2.0**16, 4.0, 2.0, 0.5, window, hysteresis)
    for _ in range(5000):
        found_inf = rng.random() < p_inf
        ours.update(found_inf)
        megatron.update(found_inf)
        assert (ours.scale, ours.growth_tracker, ours.hysteresis_tracker) == \
            (megatron._scale, megatron._growth_tracker, megatron._hysteresis_tracker)


def test_state_round_trips_and_bad_state_is_refused():
    scaler = LossScaler(scale=2.0**20, hysteresis=3, growth_interval=4)
    for found_inf in (True, False, False):
        scaler.update(found_inf)
    other = LossScaler(scale=2.0**32, hysteresis=3, growth_interval=4)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict() == {"scale": 2.0**20, "growth_tracker": 2,
                                                         "hysteresis_tracker": 2}
    for bad in ({"scale": float("inf"), "growth_tracker": 0, "hysteresis_tracker": 1},
                {"scale": 0.0, "growth_tracker": 0, "hysteresis_tracker": 1}, {"scale": 1.0}):
        with pytest.raises(UserError, match="loss-scaler state"):
            other.load_state_dict(bad)


@pytest.mark.parametrize("train,precisions,expected", [
    ({"precision": "bf16"}, ["bf16", "bf16"], None),
    ({"precision": "bf16"}, ["bf16", "fp16"], ("dynamic", 2.0**32)),
    ({"precision": "fp16", "loss_scale": 512}, ["fp16"], ("static", 512.0)),
    ({"precision": "bf16", "loss_scale": "dynamic", "initial_loss_scale": 256}, ["bf16"], ("dynamic", 256.0)),
])
def test_which_jobs_scale(train, precisions, expected):
    job = parse_job({"cluster": CLUSTER, "model": {"preset": "micro-llama"},
                     "train": {"global_batch_size": 8, **train}})
    scaler = LossScaler.for_job(job.train, precisions)
    got = None if scaler is None else ("dynamic" if scaler.dynamic else "static", scaler.scale)
    assert got == expected
