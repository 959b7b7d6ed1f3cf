"""Measured per-stage step times: each rank's parts of a step, gathered on rank 0 as the `stages` value of
the step's metrics record, next to the cost model's figures for the same parts.

A rank times its step with a `PartTimer` (forward, backward, collective, wait in `runtime.pipeline`; dp, sync
and optimizer in the worker); `other_s` is what the parts leave of the rank's step (data, bookkeeping) and
`step_s` the rank's own step time. They reach rank 0 with the rank's measured memory, in one gather. Rank 0
reports, per stage, the mean over the stage's ranks (the ranks of a stage run the same actions, so the mean
keeps the parts adding up to the mean step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from heteroflow.backends import RankMap
from heteroflow.runtime.memory import MEASURED_KEYS
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


def gather_step_figures(figures: list[float], memory: dict[str, int], *, rank_map: RankMap,
                        group: dist.ProcessGroup, rank: int
                        ) -> tuple[list[dict[str, float]], list[dict[str, int]]] | None:
    """Every rank's `rank_figures` and measured memory bytes (`runtime.memory.measured_memory`) to rank 0 in one
    gather over `group` (the world), the step's one collective after its optimizer step. Rank 0 gets, per stage,
    the mean of its ranks' times as `{key: seconds}` and, per rank in rank order, its memory figures; the others
    None. The bytes travel as float64, exact below 2**53."""
    mine = torch.tensor([*figures, *(float(memory[k]) for k in MEASURED_KEYS)], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(rank_map.world_size)] if rank == 0 else None
    dist.gather(mine, gathered, dst=0, group=group)
    if gathered is None:
        return None
    times = []
    for stage in rank_map.stages:
        mean = torch.stack([gathered[r][:len(MEASURED)] for r in stage.ranks]).mean(dim=0)
        times.append({key: float(value) for key, value in zip(MEASURED, mean.tolist())})
    memories = [dict(zip(MEASURED_KEYS, (int(v) for v in t[len(MEASURED):].tolist()))) for t in gathered]
    return times, memories


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
