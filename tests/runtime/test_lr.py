"""The learning-rate schedule: warmup, then cosine decay to min_lr."""

from __future__ import annotations

import math

import pytest

from heteroflow.config import TrainSpec
from heteroflow.runtime.lr import learning_rate


def test_learning_rate_warmup_then_cosine_to_min():
    train = TrainSpec(global_batch_size=8, steps=110, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert learning_rate(0, train) == pytest.approx(1e-4)
    assert learning_rate(9, train) == pytest.approx(1e-3)
    assert learning_rate(10, train) == pytest.approx(1e-3)
    assert learning_rate(60, train) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(110, train) == pytest.approx(1e-4)
    rates = [learning_rate(s, train) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
