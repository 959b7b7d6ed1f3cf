"""Per-step metrics: one JSON record per step to a JSONL file, and a progress line on rank 0.

A metrics file starts with a header record, `{"header": {"version": 1, "job": ..., "plan": ..., "emulate": ...,
"predicted_step_time_s": ...}}`, which says what was measured; a resumed run appends a new header before its
steps. Readers take step records with `read_step_records` (or skip lines that hold a `header` key).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO

HEADER_VERSION = 1
"""Version of the header record's schema."""

WARMUP_STEPS = 2
WARMUP_FRACTION = 0.2
"""A run's first steps that measure start-up rather than training: the first `WARMUP_STEPS` or the first
`WARMUP_FRACTION` of its steps, whichever is more (left out by `heteroflow calibrate` and the stage table)."""


def warmup_count(num_steps: int) -> int:
    """How many of a run's `num_steps` steps are its warm-up."""
    return max(WARMUP_STEPS, math.ceil(WARMUP_FRACTION * num_steps))


def header_record(*, job: dict, plan: dict, emulate: bool, predicted_step_time_s: float | None) -> dict:
    """The header record of a run: the job (`JobConfig.to_dict()`) and plan (`PlanSpec.to_dict()`) as plain
    data, whether it was emulated and the cost model's step time for it."""
    return {"header": {"version": HEADER_VERSION, "job": job, "plan": plan, "emulate": emulate,
                       "predicted_step_time_s": predicted_step_time_s}}


def is_header(record: object) -> bool:
    """Whether a parsed metrics line is a header record (not a step)."""
    return isinstance(record, dict) and "header" in record


def read_metrics(path: str | os.PathLike) -> list[tuple[dict | None, list[dict]]]:
    """The runs in a metrics file: (header, its step records) per header, in file order; step records
    before any header (files written before headers existed) come with header None. Raises ValueError
    (with the line number) on a line that is not a JSON object."""
    runs: list[tuple[dict | None, list[dict]]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"line {number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"line {number}: expected a JSON object")
            if is_header(record):
                runs.append((record["header"], []))
            else:
                if not runs:
                    runs.append((None, []))
                runs[-1][1].append(record)
    return runs


def read_step_records(path: str | os.PathLike) -> list[dict]:
    """Every step record of a metrics file, in order, header records skipped."""
    return [record for _, steps in read_metrics(path) for record in steps]


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
    aux_loss: float | None = None
    """MoE models: the load-balancing loss, mean over MoE layers, before its coefficient (not in `loss`)."""
    stages: list[dict] | None = None
    """Per stage, measured and predicted seconds of this step by part (`runtime.stage_times`)."""
    memory: dict | None = None
    """Every rank's measured bytes next to the planner's figure (`heteroflow.runtime.memory.memory_record`)."""

    def to_json(self) -> str:
        """One JSONL line (strict JSON: a non-finite figure is written as null)."""
        fields = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                  for k, v in asdict(self).items() if v is not None}
        return json.dumps(fields, allow_nan=False)


class MetricsWriter:
    """Appends `StepRecord`s to a JSONL file, flushing each line so a crash loses nothing written; `header`
    (from `header_record`) is written first, also when appending to an earlier run's file."""

    def __init__(self, path: str | os.PathLike | None, header: dict | None = None):
        self.file: IO[str] | None = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")
            if header is not None:
                self.file.write(json.dumps(header, allow_nan=False, default=float) + "\n")
                self.file.flush()

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
