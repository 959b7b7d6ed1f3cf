"""The per-stage predicted-vs-measured table `heteroflow train` ends with, from the run's step records."""

from __future__ import annotations

import statistics

from heteroflow.runtime.metrics import warmup_count
from heteroflow.stagemap.breakdown import PARTS

ROWS = (*PARTS, "other_s", "step_s")
"""Table rows: the parts, what they leave of the step (measured only), the step."""


def stage_table(records: list[dict]) -> str | None:
    """Parts x stages: the mean over the steps after the warm-up of each stage's predicted and measured seconds,
    and measured / predicted. None when the records carry no per-stage figures."""
    records = [r for r in records if r.get("stages")]
    if not records:
        return None
    drop = warmup_count(len(records))
    used = records[drop:] or records
    first, last = used[0]["step"], used[-1]["step"]
    span = f"steps {first}-{last}" if first != last else f"step {first}"
    note = (f"mean of {span}, after {drop} warm-up steps" if len(used) < len(records)
            else f"mean of {span}; no steps left after the warm-up")
    stages = used[0]["stages"]
    header = ["part"]
    for stage in stages:
        header += [f"s{stage['stage']} pred", "meas", "ratio"]
    rows = [header]
    for key in ROWS:
        row, seen = [key.removesuffix("_s")], False
        for k in range(len(stages)):
            measured = statistics.fmean(r["stages"][k]["measured"][key] for r in used)
            predicted = [r["stages"][k].get("predicted", {}).get(key) for r in used]
            pred = statistics.fmean(predicted) if None not in predicted else None
            row += [_seconds(pred), _seconds(measured), _ratio(measured, pred)]
            seen = seen or measured > 0 or bool(pred)
        if seen or key == "step_s":  # a part no stage has (the all-to-all of a dense model) is left out
            rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    types = ", ".join(f"s{s['stage']} {s['device_type']}" for s in stages)
    return "\n".join([f"per-stage time per step, predicted vs measured ({note}; seconds, measured: mean over each "
                      f"stage's ranks; {types})", *lines])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _ratio(measured: float, predicted: float | None) -> str:
    if predicted is None or predicted <= 1e-9:
        return "-"
    return f"{measured / predicted:.2f}"
