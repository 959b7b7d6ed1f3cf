"""Pipeline time of 1F1B and GPipe with unequal stage times: a closed form and a discrete-event simulator.

The simulators time the action lists of `layout.schedule`, the lists the runtime executes, so the planner
prices the schedule that runs; the closed form is checked against them.

Stage k takes `F[k]` per micro-batch forward and `B[k]` backward, each including the boundary transfer
it receives (the receiver pays, see comm.py); there are m micro-batches. 1F1B is Megatron's schedule:
stage k runs w_k = min(p-1-k, m) warm-up forwards, then alternates one forward and one backward, then
drains its w_k remaining backwards.

Closed form (derived from the schedule's dependency graph; it equals the simulator's makespan):
- GPipe: sum(F) + (m-1) max(F) + sum(B) + (m-1) max(B)  (two flow shops of identical jobs).
- 1F1B: T = max_j cand_j. With FS(k, i) = sum_{l<=k} F_l + i * max_{l<=k} F_l (the forward flow shop,
  end of forward i on stage k) and u_k = min(w_k, m-1):
    A_j = max_{k>=j} [FS(k, u_k) + sum_{j<l<=k} B_l]   (when stage j can start its first backward)
    D_j = the same with F and B swapped                 (the schedule is symmetric under time reversal)
    cand_j = A_j + (m - w_j - 1)(F_j + B_j) + D_j       if m - w_j - 1 >= 1,
    cand_j = A_j + sum_{l<=j} B_l + (m-1) max_{l<=j} B_l  otherwise (stage j runs all forwards first).
  cand_j is the longest path that spends the steady state on stage j.
  Every cand_j is a path of the schedule's dependency graph, so T never exceeds the makespan; it equals it
  when no stage's backward is faster than its forward (B_k >= F_k, as training stages are; checked on random
  stage times). Where some B_k < F_k the longest path can zigzag between stages in the steady state, and
  `pipeline_time` times the action lists instead (`longest_path`); the planner's dynamic program keeps the
  closed form as its objective (a lower bound there) and its plans are priced with `pipeline_time`.

Shared cores (emulation: every rank a local process): `simulate_shared` runs the same schedule when the
stages' threads share a few cores. F and B are then each operation's time with its threads to itself; while
n threads are busy in all, each runs at min(1, cores / n) of its speed (processor sharing, what the OS
scheduler approximates), and slower still by the host's measured slowdown at n / cores threads per core when
there are more threads than cores (`sharing_speed`). Ranks waiting for a neighbour use no core. With enough
cores it equals `simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.layout.schedule import BACKWARD, FORWARD, in_flight, stage_actions, warmup_forwards
from heteroflow.stagemap.profile import per_core_value

__all__ = ["Event", "SharedRun", "in_flight", "longest_path", "one_f_one_b_closed_form", "pipeline_time", "run_shared", "shared_ends", "shared_makespan",
           "sharing_speed", "simulate", "simulate_shared"]


def pipeline_time(F: list[float], B: list[float], m: int, schedule: str) -> float:
    """Makespan of one step's forward and backward passes (closed form; for 1F1B with a stage whose backward
    is faster than its forward, the longest path of the schedule's actions)."""
    if schedule == "gpipe":
        return sum(F) + (m - 1) * max(F) + sum(B) + (m - 1) * max(B)
    if any(b < f for f, b in zip(F, B)):
        return longest_path(F, B, m, schedule)
    return one_f_one_b_closed_form(F, B, m)


def one_f_one_b_closed_form(F: list[float], B: list[float], m: int) -> float:
    """The 1F1B closed form (the module docstring): the makespan when every B_k >= F_k, a lower bound on it
    otherwise."""
    p = len(F)
    a = _first_backward_start(F, B, m)
    d = _first_backward_start(B, F, m)
    best = 0.0
    pre_b = max_b = 0.0
    for j in range(p):
        pre_b += B[j]
        max_b = max(max_b, B[j])
        steady = m - warmup_forwards(p, j, m) - 1
        if steady >= 1:
            cand = a[j] + steady * (F[j] + B[j]) + d[j]
        else:
            cand = a[j] + pre_b + (m - 1) * max_b
        best = max(best, cand)
    return best


def _first_backward_start(F: list[float], B: list[float], m: int) -> list[float]:
    """A_j: the time stage j may start backward 0 (longest path to it)."""
    p = len(F)
    fs = []
    pre = mx = 0.0
    for k in range(p):
        pre += F[k]
        mx = max(mx, F[k])
        fs.append(pre + min(warmup_forwards(p, k, m), m - 1) * mx)
    a = [0.0] * p
    end_next = 0.0
    for k in range(p - 1, -1, -1):
        a[k] = fs[k] if k == p - 1 else max(fs[k], end_next)
        end_next = a[k] + B[k]
    return a


def longest_path(F: list[float], B: list[float], m: int, schedule: str) -> float:
    """Makespan of the schedule's action lists with per-stage times `F`, `B` (transfers included): `simulate`
    without transfers of their own or events, for pricing."""
    p = len(F)
    orders = [stage_actions(schedule, p, k, m) for k in range(p)]
    ends = {FORWARD: [[None] * m for _ in range(p)], BACKWARD: [[None] * m for _ in range(p)]}
    position, free = [0] * p, [0.0] * p
    progressed = True
    while progressed:
        progressed = False
        for k in range(p):
            order = orders[k]
            while position[k] < len(order):
                action = order[position[k]]
                kind, i = action.kind, action.micro_batch
                if kind == FORWARD:
                    ready = 0.0 if k == 0 else ends[FORWARD][k - 1][i]
                else:
                    ready = ends[FORWARD][k][i] if k == p - 1 else ends[BACKWARD][k + 1][i]
                if ready is None:
                    break
                free[k] = max(free[k], ready) + (F[k] if kind == FORWARD else B[k])
                ends[kind][k][i] = free[k]
                position[k] += 1
                progressed = True
    assert all(position[k] == len(orders[k]) for k in range(p)), "the schedule deadlocked"
    return max(free)


@dataclass(frozen=True, slots=True)
class Event:
    """One operation of the simulated schedule."""

    stage: int
    kind: str
    """`recv_fwd`, `forward`, `recv_bwd`, `backward`."""
    micro_batch: int
    start_s: float
    end_s: float


def simulate(compute_f: list[float], compute_b: list[float], recv: list[float], m: int,
             schedule: str) -> tuple[float, list[Event]]:
    """Discrete-event simulation: each stage runs its operations in schedule order, each as soon as the
    stage is free and its input has arrived. `recv[k]` is the transfer between stages k and k+1, paid by
    the receiver before it computes (forward: stage k+1; backward: stage k). Returns (makespan, events)."""
    p = len(compute_f)
    orders = [stage_actions(schedule, p, k, m) for k in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * p
    free = [0.0] * p
    events: list[Event] = []
    progressed = True
    while progressed:
        progressed = False
        for k in range(p):
            while position[k] < len(orders[k]):
                action = orders[k][position[k]]
                kind, i = action.kind, action.micro_batch
                if kind == FORWARD:
                    ready = 0.0 if k == 0 else done.get((FORWARD, k - 1, i))
                    transfer, work = (recv[k - 1] if k > 0 else 0.0), compute_f[k]
                else:
                    ready = done.get((FORWARD, k, i)) if k == p - 1 else done.get((BACKWARD, k + 1, i))
                    transfer, work = (recv[k] if k < p - 1 else 0.0), compute_b[k]
                if ready is None:
                    break
                start = max(free[k], ready)
                if transfer > 0:
                    events.append(Event(k, "recv_fwd" if kind == FORWARD else "recv_bwd", i, start, start + transfer))
                events.append(Event(k, "forward" if kind == FORWARD else "backward", i, start + transfer,
                                    start + transfer + work))
                free[k] = start + transfer + work
                done[(kind, k, i)] = free[k]
                position[k] += 1
                progressed = True
    assert all(position[k] == len(orders[k]) for k in range(p)), "schedule deadlocked"
    return max(free), events


def sharing_speed(busy_threads: int, cores: int, oversubscribed: tuple[tuple[float, float], ...] = ()) -> float:
    """The speed of each of `busy_threads` threads sharing `cores` cores: min(1, cores / threads), divided by
    the host's measured slowdown at that many threads per core (`EmulationProfile.oversubscribed_slowdown`:
    linear from (1, 1.0) through the measured points, the last one beyond them)."""
    per_core = busy_threads / cores
    speed = min(1.0, 1.0 / per_core)
    if per_core <= 1.0 or not oversubscribed:
        return speed
    return speed / per_core_value(((1.0, 1.0), *oversubscribed), per_core)


def simulate_shared(F: list[float], B: list[float], m: int, schedule: str, *, threads: list[int],
                    cores: int, oversubscribed: tuple[tuple[float, float], ...] = (),
                    waits: tuple[list[float], list[float]] | None = None) -> float:
    """Makespan of one step's forward and backward passes when stage k keeps `threads[k]` threads busy while
    it computes and all stages share `cores` cores (see the module docstring), at `sharing_speed`. F and B
    include the receiver-paid transfer, as in `pipeline_time`; `waits` = (forward, backward) seconds of each
    stage's operation that it spends blocked in transfers and collectives (part of F and B): they take no core
    and are not slowed by sharing."""
    return run_shared(F, B, m, schedule, threads=threads, cores=cores, oversubscribed=oversubscribed,
                      waits=waits).makespan_s


@dataclass(frozen=True, slots=True)
class SharedRun:
    """`run_shared`'s result: the makespan and, per stage, the wall seconds its forwards' and its backwards'
    computing took (each slowed by the threads it shared the cores with; the waits not included)."""

    makespan_s: float
    forward_wall_s: tuple[float, ...]
    backward_wall_s: tuple[float, ...]


def run_shared(F: list[float], B: list[float], m: int, schedule: str, *, threads: list[int],
               cores: int, oversubscribed: tuple[tuple[float, float], ...] = (),
               waits: tuple[list[float], list[float]] | None = None) -> SharedRun:
    """`simulate_shared`, also reporting how long each stage's operations computed in wall time. An operation
    computes first, then waits (a stage's blocking transfers, taken together)."""
    p = len(F)
    Fw, Bw = waits if waits is not None else ([0.0] * p, [0.0] * p)
    orders = [stage_actions(schedule, p, k, m) for k in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * p
    left: list[float | None] = [None] * p
    """Seconds at full speed left of the computing of the operation stage k is running; None while it waits
    for a neighbour."""
    blocked = [0.0] * p
    """Seconds left of the operation's blocking wait, once its computing is done."""
    wall = {FORWARD: [0.0] * p, BACKWARD: [0.0] * p}
    now = 0.0
    while True:
        for k in range(p):
            if left[k] is None and position[k] < len(orders[k]):
                action = orders[k][position[k]]
                kind, i = action.kind, action.micro_batch
                if kind == FORWARD:
                    ready = k == 0 or (FORWARD, k - 1, i) in done
                else:
                    ready = (FORWARD, k, i) in done if k == p - 1 else (BACKWARD, k + 1, i) in done
                if ready:
                    wait = Fw[k] if kind == FORWARD else Bw[k]
                    left[k], blocked[k] = max(0.0, (F[k] if kind == FORWARD else B[k]) - wait), wait
        running = [k for k in range(p) if left[k] is not None]
        if not running:
            break
        computing = [k for k in running if left[k] > 0]
        speed = sharing_speed(sum(threads[k] for k in computing), cores, oversubscribed) if computing else 1.0
        step_wall = min([left[k] / speed for k in computing] + [blocked[k] for k in running if k not in computing])
        now += step_wall
        for k in running:
            if left[k] > 0:
                left[k] -= step_wall * speed
                wall[orders[k][position[k]].kind][k] += step_wall
                if left[k] <= 1e-12 * max(1.0, F[k] + B[k]):
                    left[k] = 0.0
            else:
                blocked[k] -= step_wall
            if left[k] == 0.0 and blocked[k] <= 1e-12 * max(1.0, F[k] + B[k]):
                action = orders[k][position[k]]
                done[(action.kind, k, action.micro_batch)] = now
                position[k] += 1
                left[k] = None
    assert all(position[k] == len(orders[k]) for k in range(p)), "schedule deadlocked"
    return SharedRun(makespan_s=now, forward_wall_s=tuple(wall[FORWARD]), backward_wall_s=tuple(wall[BACKWARD]))


def shared_makespan(durations: list[float], *, threads: list[int], cores: int,
                    oversubscribed: tuple[tuple[float, float], ...] = ()) -> float:
    """When independent jobs that start together end, job k taking `durations[k]` with its `threads[k]`
    threads to itself and all of them sharing `cores` cores (processor sharing, at `sharing_speed`)."""
    return max(shared_ends(durations, threads=threads, cores=cores, oversubscribed=oversubscribed), default=0.0)


def shared_ends(durations: list[float], *, threads: list[int], cores: int,
                oversubscribed: tuple[tuple[float, float], ...] = ()) -> list[float]:
    """When each of the jobs of `shared_makespan` ends."""
    left = [d for d in durations]
    ends = [0.0] * len(durations)
    running = [k for k, d in enumerate(left) if d > 0]
    now = 0.0
    while running:
        speed = sharing_speed(sum(threads[k] for k in running), cores, oversubscribed)
        step = min(left[k] for k in running)
        now += step / speed
        for k in running:
            left[k] -= step
            ends[k] = now
        running = [k for k in running if left[k] > 1e-12 * max(1.0, step)]
    return ends
