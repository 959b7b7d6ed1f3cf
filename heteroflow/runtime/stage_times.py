"""Measured per-stage step times: each rank's parts of a step, gathered on rank 0 as the `stages` value of
the step's metrics record, next to the cost model's figures for the same parts.

A rank times its step with a `PartTimer` (forward, backward, collective, wait in `runtime.pipeline`; dp, sync
and optimizer in the worker); `other_s` is what the parts leave of the rank's step (data, bookkeeping) and
`step_s` the rank's own step time. Rank 0 reports, per stage, the mean over the stage's ranks (the ranks of a
stage run the same actions, so the mean keeps the parts adding up to the mean step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from heteroflow.backends import RankMap
from heteroflow.stagemap.breakdown import PARTS

MEASURED = (*PARTS, "other_s", "step_s")
"""The keys of a stage's `measured` figures: the predicted parts, what they leave of the step, the step."""
PREDICTED = (*PARTS, "step_s")
"""The keys of a stage's `predicted` figures (`stagemap.breakdown`); the parts sum to `step_s`."""

TIMER_PARTS = {"forward": "forward_s", "backward": "backward_s", "collective": "collective_s",
               "alltoall": "alltoall_s", "wait": "wait_s",
               "dp": "dp_s", "optimizer": "optimizer_s", "sync": "sync_s"}
"""`PartTimer` part name -> record key."""


def rank_figures(timed: dict[str, float], *, step_s: float) -> list[float]:
    """This rank's figures in `MEASURED` order, from `PartTimer.collect()` and its step time."""
    unknown = set(timed) - set(TIMER_PARTS)
    assert not unknown, f"untimed parts: {sorted(unknown)}"
    parts = {TIMER_PARTS[name]: seconds for name, seconds in timed.items()}
    values = [parts.get(key, 0.0) for key in PARTS]
    return [*values, step_s - sum(values), step_s]


def gather_stage_figures(figures: list[float], *, rank_map: RankMap, group: dist.ProcessGroup,
                         rank: int) -> list[dict[str, float]] | None:
    """Every rank's `rank_figures` to rank 0 (a collective over `group`, the world); rank 0 gets, per stage, the
    mean over its ranks as `{key: seconds}`, the others None."""
    mine = torch.tensor(figures, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(rank_map.world_size)] if rank == 0 else None
    dist.gather(mine, gathered, dst=0, group=group)
    if gathered is None:
        return None
    out = []
    for stage in rank_map.stages:
        mean = torch.stack([gathered[r] for r in stage.ranks]).mean(dim=0)
        out.append({key: float(value) for key, value in zip(MEASURED, mean.tolist())})
    return out


def stage_records(measured: list[dict[str, float]], predicted: tuple[dict[str, float], ...] | None,
                  device_types: list[str]) -> list[dict]:
    """The `stages` value of a step record: per stage its index, device type, measured and (when the cost
    model priced the plan) predicted figures."""
    out = []
    for k, (figures, device_type) in enumerate(zip(measured, device_types)):
        entry: dict = {"stage": k, "device_type": device_type,
                       "measured": {key: round(value, 6) for key, value in figures.items()}}
        if predicted is not None:
            entry["predicted"] = {key: round(predicted[k][key], 6) for key in PREDICTED}
        out.append(entry)
    return out
