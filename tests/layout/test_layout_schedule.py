"""The pipeline schedules of the layout core: action lists that the runtime executes and the planner times."""

from __future__ import annotations

import contextlib
import itertools
import random
import types

import pytest

import torch

from heteroflow.layout.schedule import BACKWARD, FORWARD, in_flight, max_in_flight, stage_actions
from heteroflow.runtime import pipeline as runtime_pipeline
from heteroflow.runtime.memory import SavedActivationMeter
from heteroflow.stagemap.pipeline import simulate

SHAPES = list(itertools.product(["1f1b", "gpipe"], [1, 2, 3, 5], [1, 2, 4, 7]))


def runs_without_deadlock(schedule: str, num_stages: int, num_micro_batches: int) -> bool:
    """Execute every stage's list with blocking receives and non-blocking sends; True if all finish.

    F(m) on stage k needs F(m) done on k - 1; B(m) on stage k needs B(m) done on k + 1 (and its own F(m)).
    """
    lists = [stage_actions(schedule, num_stages, k, num_micro_batches) for k in range(num_stages)]
    position = [0] * num_stages
    done: set[tuple[str, int, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        for k in range(num_stages):
            if position[k] == len(lists[k]):
                continue
            action = lists[k][position[k]]
            m = action.micro_batch
            if action.kind == FORWARD:
                ready = k == 0 or (FORWARD, k - 1, m) in done
            else:
                ready = (FORWARD, k, m) in done and (k == num_stages - 1 or (BACKWARD, k + 1, m) in done)
            if ready:
                done.add((action.kind, k, m))
                position[k] += 1
                progressed = True
    return all(position[k] == len(lists[k]) for k in range(num_stages))


@pytest.mark.parametrize("schedule,num_stages,num_micro_batches", SHAPES)
def test_every_micro_batch_runs_once_forward_before_backward(schedule, num_stages, num_micro_batches):
    for k in range(num_stages):
        actions = stage_actions(schedule, num_stages, k, num_micro_batches)
        forwards = [a.micro_batch for a in actions if a.kind == FORWARD]
        backwards = [a.micro_batch for a in actions if a.kind == BACKWARD]
        assert sorted(forwards) == sorted(backwards) == list(range(num_micro_batches))
        for m in range(num_micro_batches):
            order = [str(a) for a in actions]
            assert order.index(f"F{m}") < order.index(f"B{m}")


@pytest.mark.parametrize("schedule,num_stages,num_micro_batches", SHAPES)
def test_schedules_cannot_deadlock(schedule, num_stages, num_micro_batches):
    assert runs_without_deadlock(schedule, num_stages, num_micro_batches)


def test_1f1b_bounds_micro_batches_in_flight():
    for k in range(4):
        assert max_in_flight(stage_actions("1f1b", 4, k, 8)) == 4 - k
        assert max_in_flight(stage_actions("gpipe", 4, k, 8)) == 8
    assert [str(a) for a in stage_actions("1f1b", 3, 0, 4)] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_closed_form_in_flight_equals_the_action_lists():
    for schedule, p, m in SHAPES:
        for k in range(p):
            assert in_flight(schedule, p, k, m) == max_in_flight(stage_actions(schedule, p, k, m))


class _Handle:
    def __init__(self, tensor=None):
        self.tensor = tensor

    def wait(self):
        return self.tensor


class _RecordingBoundary:
    """A stage boundary that hands out tagged tensors and records what the stage sends, in order."""

    def __init__(self, log: list, shape: tuple):
        self.log, self.shape, self.received = log, shape, 0
        self.link = types.SimpleNamespace(backend="gloo")

    def recv_activation(self):
        self.received += 1
        return _Handle(torch.full(self.shape, float(self.received - 1)))

    def recv_grad(self):
        return _Handle(torch.ones(self.shape))

    def together(self):  # gloo: the send and the receive posted in one batch run as posted alone
        return contextlib.nullcontext()

    def send_activation(self, tensor):
        self.log.append((FORWARD, int(tensor.flatten()[0].item())))
        return _Handle()

    def send_grad(self, tensor):
        self.log.append((BACKWARD, len([e for e in self.log if e[0] == BACKWARD])))
        return _Handle()

    def together(self):
        """A send and the next receive batched (`StageBoundary.together`): the order of the log is unchanged."""
        return contextlib.nullcontext()


def _runtime_order(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """The order in which the runtime's pipeline step runs a middle stage's forwards and backwards, read from
    what it sends: each forward sends its activation (tagged with the micro-batch), each backward its gradient."""
    log: list = []
    shape = (1, 2)
    backward_order: list[int] = []

    class Tag(torch.nn.Module):
        def forward(self, x):
            m = int(x.detach().flatten()[0].item())
            out = x * 1.0
            out.register_hook(lambda g, m=m: backward_order.append(m))
            return out

    boundary = _RecordingBoundary(log, shape)
    rt = types.SimpleNamespace(
        plan=types.SimpleNamespace(stages=[None] * num_stages, schedule=schedule),
        info=types.SimpleNamespace(stage=stage), is_first=False, is_last=False, prev=boundary, next=boundary,
        device=types.SimpleNamespace(torch_device=torch.device("cpu")), autocast_dtype=None, model=Tag(),
        activation_dtype=torch.float32, meter=SavedActivationMeter(torch.device("cpu")),
        stage=types.SimpleNamespace(layout=types.SimpleNamespace(offload=types.SimpleNamespace(activations="device"))))
    batches = [runtime_pipeline.MicroBatch(tokens=torch.zeros(1, 2), labels=torch.zeros(1, 2))] * num_micro_batches
    runtime_pipeline.run_pipeline_step(rt, batches, global_tokens=1)
    forwards = iter(m for kind, m in log if kind == FORWARD)
    backwards = iter(backward_order)
    return [(kind, next(forwards) if kind == FORWARD else next(backwards)) for kind, _ in log]


@pytest.mark.parametrize("schedule,num_stages,num_micro_batches",
                         [s for s in SHAPES if s[1] >= 3])
def test_the_runtime_runs_the_lists_the_planner_times(schedule, num_stages, num_micro_batches):
    """One call builds both: the runtime's executed order and the simulator's timed order are
    `stage_actions(schedule, p, k, m)` for the same arguments."""
    rng = random.Random(num_stages * 100 + num_micro_batches)
    compute_f = [rng.uniform(0.5, 2.0) for _ in range(num_stages)]
    compute_b = [rng.uniform(0.5, 3.0) for _ in range(num_stages)]
    _, events = simulate(compute_f, compute_b, [0.0] * (num_stages - 1), num_micro_batches, schedule)
    k = 1  # a middle stage: it receives and sends in both directions
    expected = [(a.kind, a.micro_batch) for a in stage_actions(schedule, num_stages, k, num_micro_batches)]
    timed = [(FORWARD if e.kind == "forward" else BACKWARD, e.micro_batch)
             for e in sorted(events, key=lambda e: e.start_s) if e.stage == k and e.kind in ("forward", "backward")]
    assert timed == expected
    assert _runtime_order(schedule, num_stages, k, num_micro_batches) == expected
