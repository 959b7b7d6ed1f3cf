"""Per-step metrics: one JSON record per step to a JSONL file, and a progress line on rank 0."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one optimizer step did. `loss` is the step's batch loss, computed before its update."""

    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    lr: float
    grad_norm: float
    predicted_step_time_s: float | None = None
    loss_scale: float | None = None
    """The loss scale this step's loss was multiplied by (runs with loss scaling only)."""
    skipped: bool | None = None
    """Whether the step was skipped for an inf or nan gradient (runs with loss scaling only)."""

    def to_json(self) -> str:
        """One JSONL line (strict JSON: a non-finite figure is written as null)."""
        fields = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                  for k, v in asdict(self).items() if v is not None}
        return json.dumps(fields, allow_nan=False)


class MetricsWriter:
    """Appends `StepRecord`s to a JSONL file, flushing each line so a crash loses nothing written."""

    def __init__(self, path: str | os.PathLike | None):
        self.file: IO[str] | None = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        """Append one record."""
        if self.file is not None:
            self.file.write(record.to_json() + "\n")
            self.file.flush()

    def close(self) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()
            self.file = None


class ProgressBar:
    """A one-line progress display: redrawn in place on a terminal, a line every few steps otherwise."""

    def __init__(self, total_steps: int, *, first_step: int = 0, stream: IO[str] = sys.stdout):
        self.total = total_steps
        self.first = first_step
        self.stream = stream
        self.tty = stream.isatty()
        self.every = max(1, (total_steps - first_step) // 20)
        self.started = time.perf_counter()

    def update(self, record: StepRecord) -> None:
        """Show the state after `record`."""
        done = record.step + 1
        width = 24
        filled = int(width * done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        predicted = (f" (predicted {record.predicted_step_time_s:.3f}s)"
                     if record.predicted_step_time_s is not None else "")
        loss = f"{record.loss:.4f}" if math.isfinite(record.loss) else str(record.loss)
        scale = ""
        if record.loss_scale is not None:
            scale = f"  scale {record.loss_scale:g}" + (" (skipped: inf/nan gradient)" if record.skipped else "")
        line = (f"[{bar}] step {done}/{self.total}  loss {loss}  {record.tokens_per_s:,.0f} tok/s  "
                f"step {record.step_time_s:.3f}s{predicted}{scale}")
        if self.tty:
            self.stream.write("\r" + line)
            if done == self.total:
                self.stream.write("\n")
        elif (done - self.first) % self.every == 0 or done == self.total or record.step == self.first:
            self.stream.write(line + "\n")
        self.stream.flush()
