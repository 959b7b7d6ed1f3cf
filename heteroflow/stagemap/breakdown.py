"""`step_breakdown`: the predicted step time, and each stage's share of it by part.

The planner's step time is built here (`estimate.assemble` calls it): the pipeline's makespan (closed form,
or shared cores when emulated) plus the slowest stage's tail. Each stage's view of that step splits into the
parts the runtime measures (`runtime.timing`), so that a metrics record can set the two side by side:

- `forward_s`, `backward_s`: compute of its micro-batches' forwards and backwards (loss included);
- `collective_s`: the exposed tp collectives inside them (the cp ring is priced as overlapped with attention);
- `alltoall_s`: a MoE stage's token all-to-alls inside them (dispatch and combine over the ep group; the
  runtime's `PartTimer` part `alltoall`);
- `wait_s`: the rest of the pipeline's makespan, in which the stage waits on its neighbours: boundary
  transfers and the pipeline bubble;
- `dp_s`: the dp gradient reduction after the flush; `optimizer_s`: the optimizer step (with ZeRO's parameter
  all-gather and any offload traffic);
- `sync_s`: waiting for the slowest stage's tail (the global gradient norm synchronizes the stages).

Every stage's parts sum to the step time. Emulated, each operation computes as long as the shared-core
simulation says; its transfers and collectives block without a core and take their priced time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from heteroflow.stagemap.costs import MicroBatchParts
from heteroflow.stagemap.pipeline import pipeline_time, run_shared, shared_ends

PARTS = ("forward_s", "backward_s", "collective_s", "alltoall_s", "wait_s", "dp_s", "optimizer_s", "sync_s")
"""The parts of a stage's step time, in the order tables show them."""


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds of one optimizer step of one stage, by part (see the module docstring)."""

    forward_s: float
    backward_s: float
    collective_s: float
    alltoall_s: float
    wait_s: float
    dp_s: float
    optimizer_s: float
    sync_s: float

    @property
    def total_s(self) -> float:
        """The step time from this stage's view: the sum of its parts."""
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, float]:
        """`{part: seconds}` in `PARTS` order."""
        return {name: getattr(self, name) for name in PARTS}


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """The predicted step: pipeline makespan, step time, and every stage's parts of it."""

    pipeline_s: float
    step_s: float
    stages: tuple[StageTimes, ...]


def step_breakdown(parts: list[MicroBatchParts], recv_forward: list[float], recv_backward: list[float],
                   num_micro_batches: int, schedule: str, *,
                   shared: tuple[list[int], int, tuple[tuple[float, float], ...]] | None = None) -> StepBreakdown:
    """The step of stages priced at `parts` (per micro-batch, `StageCosts.parts`) that receive for `recv_forward[k]`
    before each forward and `recv_backward[k]` before each backward, under `schedule`. `shared=(threads, cores,
    oversubscribed)`: stage k's ranks keep `threads[k]` threads busy and all share `cores` cores, slowed by the
    host's measured oversubscription (`pipeline.sharing_speed`; emulation)."""
    m = num_micro_batches
    fwd_wait = [p.forward_comm_s + p.forward_alltoall_s + r for p, r in zip(parts, recv_forward)]
    bwd_wait = [p.backward_comm_s + p.backward_alltoall_s + r for p, r in zip(parts, recv_backward)]
    fwd = [p.forward_s + w for p, w in zip(parts, fwd_wait)]
    bwd = [p.backward_s + w for p, w in zip(parts, bwd_wait)]
    tails = [p.dp_s + p.optimizer_s for p in parts]
    if shared is not None:  # computing shares the cores; blocking transfers take none and are not slowed
        threads, cores, oversubscribed = shared
        run = run_shared(fwd, bwd, m, schedule, threads=threads, cores=cores, oversubscribed=oversubscribed,
                         waits=(fwd_wait, bwd_wait))
        pipe = run.makespan_s
        f_scale = [_scale(w, p.forward_s) for w, p in zip(run.forward_wall_s, parts)]
        b_scale = [_scale(w, p.backward_s) for w, p in zip(run.backward_wall_s, parts)]
        tail_wall = shared_ends(tails, threads=threads, cores=cores, oversubscribed=oversubscribed)
    else:
        pipe = pipeline_time(fwd, bwd, m, schedule)
        f_scale, b_scale, tail_wall = [float(m)] * len(parts), [float(m)] * len(parts), tails
    step = pipe + max(tail_wall, default=0.0)
    stages = []
    for k, p in enumerate(parts):
        f, b, t = f_scale[k], b_scale[k], _scale(tail_wall[k], tails[k])
        collective = m * (p.forward_comm_s + p.backward_comm_s)
        alltoall = m * (p.forward_alltoall_s + p.backward_alltoall_s)
        busy = p.forward_s * f + p.backward_s * b + collective + alltoall  # the transfers received count as waiting
        stages.append(StageTimes(forward_s=p.forward_s * f, backward_s=p.backward_s * b,
                                 collective_s=collective, alltoall_s=alltoall,
                                 wait_s=pipe - busy, dp_s=p.dp_s * t, optimizer_s=p.optimizer_s * t,
                                 sync_s=step - pipe - tail_wall[k]))
    return StepBreakdown(pipeline_s=pipe, step_s=step, stages=tuple(stages))


def _scale(wall_s: float, alone_s: float) -> float:
    """How many wall seconds one priced second of an operation took (its count, times any slowdown)."""
    return wall_s / alone_s if alone_s > 0 else 0.0
