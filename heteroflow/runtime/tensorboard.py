"""TensorBoard scalars of each step, written by rank 0 (`train.tensorboard_dir` or `train --tensorboard-dir`).

The scalars are those of the step's metrics record (`runtime.metrics.StepRecord`), under these tags, at the
record's step (0-based, as in the metrics file); a figure that is not finite (the gradient norm of a
step skipped for an inf) is left out:

    train/loss  train/lr  train/grad_norm  train/loss_scale (1 without loss scaling)  train/tokens_per_s
    train/step_time_s  train/predicted_step_time_s (when priced)  train/aux_loss (MoE)  train/skipped (loss scaling)
    stage{k}/measured/{part}_s  stage{k}/predicted/{part}_s           each part of `runtime.stage_times`
    stage{k}/memory/measured_{kind}_bytes  stage{k}/memory/planned_{kind}_bytes
                                       the largest over the stage's ranks (params, grads, optimizer, ..., peak)

tensorboard is an optional dependency (`pip install 'heteroflow[tensorboard]'`).
"""

from __future__ import annotations

import math
import os

from heteroflow.errors import UserError
from heteroflow.runtime.metrics import StepRecord

INSTALL = "pip install 'heteroflow[tensorboard]' (or pip install tensorboard)"


def require_tensorboard(what: str) -> None:
    """A `UserError` naming `what` asked for TensorBoard when the package is missing."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        raise UserError(f"{what} needs the tensorboard package, which is not installed: {INSTALL}; or remove "
                        f"{what}") from None


def step_scalars(record: StepRecord) -> dict[str, float]:
    """Every scalar of one step by tag (see the module docstring)."""
    out = {"train/loss": record.loss, "train/lr": record.lr, "train/grad_norm": record.grad_norm,
           "train/loss_scale": record.loss_scale if record.loss_scale is not None else 1.0,
           "train/tokens_per_s": record.tokens_per_s, "train/step_time_s": record.step_time_s}
    if record.predicted_step_time_s is not None:
        out["train/predicted_step_time_s"] = record.predicted_step_time_s
    if record.aux_loss is not None:
        out["train/aux_loss"] = record.aux_loss
    if record.skipped is not None:
        out["train/skipped"] = float(record.skipped)
    for stage in record.stages or ():
        for kind in ("measured", "predicted"):
            for part, seconds in stage.get(kind, {}).items():
                out[f"stage{stage['stage']}/{kind}/{part}"] = seconds
    for rank in (record.memory or {}).get("ranks", ()):
        for kind in ("measured", "planned"):
            for what, num_bytes in rank[kind].items():
                tag = f"stage{rank['stage']}/memory/{kind}_{what}_bytes"
                out[tag] = max(out.get(tag, 0.0), float(num_bytes))
    return {tag: float(value) for tag, value in out.items() if value is not None and math.isfinite(value)}


class TensorBoardWriter:
    """Rank 0's event file in `log_dir`: the scalars of every `interval`-th step."""

    def __init__(self, log_dir: str | os.PathLike, *, interval: int = 1):
        require_tensorboard("train.tensorboard_dir")
        from torch.utils.tensorboard import SummaryWriter
        self.interval = interval
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: StepRecord) -> None:
        """Add the step's scalars (on its interval), flushed so a stopped run keeps them."""
        if record.step % self.interval:
            return
        for tag, value in step_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=record.step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
