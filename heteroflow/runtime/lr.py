"""Learning-rate schedule: linear warmup to the peak, then cosine decay to `min_lr` at the last step."""

from __future__ import annotations

import math

from heteroflow.config import TrainSpec


def learning_rate(step: int, train: TrainSpec) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))
