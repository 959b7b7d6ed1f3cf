"""Pure checks of when the pipeline posts its receives (no processes: handles and links are fakes)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from heteroflow.layout.schedule import FORWARD, stage_actions
from heteroflow.runtime.memory import SavedActivationMeter
from heteroflow.runtime.pipeline import MicroBatch, _Recvs, run_pipeline_step


class _FakeReceives:
    """Posts numbered fake receives and logs every post and wait."""

    def __init__(self):
        self.log: list[str] = []
        self.posted = 0

    def post(self):
        index = self.posted
        self.posted += 1
        self.log.append(f"post{index}")
        log = self.log

        class Handle:
            def wait(self):
                log.append(f"wait{index}")
                return index

        return Handle()


@pytest.mark.parametrize("ahead", [True, False])
def test_receives_come_in_order_and_never_beyond_the_count(ahead):
    fake = _FakeReceives()
    recvs = _Recvs(fake.post, 3, ahead=ahead)
    assert [recvs.take() for _ in range(3)] == [0, 1, 2]
    assert fake.posted == 3
    with pytest.raises(AssertionError):
        recvs.take()


def test_ahead_posts_the_next_receive_as_soon_as_the_previous_arrived():
    fake = _FakeReceives()
    recvs = _Recvs(fake.post, 3, ahead=True)
    assert fake.log == ["post0"]  # posted before the first action needs it
    recvs.take()
    assert fake.log == ["post0", "wait0", "post1"]  # one outstanding at a time
    recvs.take()
    recvs.take()
    assert fake.log == ["post0", "wait0", "post1", "wait1", "post2", "wait2"]


def test_without_ahead_each_receive_is_posted_when_needed():
    fake = _FakeReceives()
    recvs = _Recvs(fake.post, 2, ahead=False)
    assert fake.log == []
    recvs.take()
    recvs.take()
    assert fake.log == ["post0", "wait0", "post1", "wait1"]


def test_post_next_posts_the_next_receive_once_for_a_batch_and_take_uses_it():
    fake = _FakeReceives()
    recvs = _Recvs(fake.post, 2, ahead=False)
    assert fake.log == []  # on NCCL/HCCL nothing is posted before it is needed ...
    recvs.post_next()  # ... or before it goes out with a send (StageBoundary.together)
    recvs.post_next()
    assert fake.log == ["post0"]
    assert recvs.take() == 0 and recvs.take() == 1
    assert fake.log == ["post0", "wait0", "post1", "wait1"]


class _Link:
    """One NCCL link of a middle stage: logs, in posting order, each receive and send posted on it, and in `events`
    (shared by both links and the model) when each receive was posted and waited for."""

    def __init__(self, name: str, events: list[str]):
        self.name, self.events, self.ops = name, events, []
        self.link = types.SimpleNamespace(backend="nccl")
        self.received = 0

    def _recv(self, kind: str):
        index, events = self.received, self.events
        self.received += 1
        self.ops.append(f"recv {kind}{index}")
        events.append(f"post {kind}{index}")

        class Handle:
            def wait(self):
                events.append(f"wait {kind}{index}")
                return torch.ones(1, 2)

        return Handle()

    def recv_activation(self):
        return self._recv("act")

    def recv_grad(self):
        return self._recv("grad")

    def _send(self, kind: str):
        self.ops.append(f"send {kind}")
        return types.SimpleNamespace(wait=lambda: None)

    def send_activation(self, tensor):
        return self._send("act")

    def send_grad(self, tensor):
        return self._send("grad")

    def together(self):
        return contextlib.nullcontext()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_on_nccl_receives_are_posted_early_in_each_links_order(schedule):
    """A middle stage's receives on NCCL links: each link sees its receives and sends in the schedule's order (what
    keeps a communicator that runs them in posting order from deadlocking), and a receive that is its link's next
    message is posted before the compute that precedes it (the step's first activation, consecutive forwards'
    activations, consecutive backwards' gradients)."""
    events: list[str] = []
    prev, nxt = _Link("prev", events), _Link("next", events)

    class Model(torch.nn.Module):
        def forward(self, x):
            events.append("forward")
            return x * 1.0

    rt = types.SimpleNamespace(
        plan=types.SimpleNamespace(stages=[None] * 3, schedule=schedule), info=types.SimpleNamespace(stage=1),
        is_first=False, is_last=False, prev=prev, next=nxt, device=types.SimpleNamespace(torch_device=torch.device("cpu")),
        autocast_dtype=None, model=Model(), activation_dtype=torch.float32,
        meter=SavedActivationMeter(torch.device("cpu")),
        stage=types.SimpleNamespace(layout=types.SimpleNamespace(offload=types.SimpleNamespace(activations="device"))))
    micro_batches = 4
    batches = [MicroBatch(tokens=torch.zeros(1, 2), labels=torch.zeros(1, 2))] * micro_batches
    run_pipeline_step(rt, batches, global_tokens=1)
    actions = stage_actions(schedule, 3, 1, micro_batches)
    # each link in the schedule's order: forwards receive on prev and send on next, backwards the other way
    on_prev = [f"recv act{sum(b.kind == FORWARD for b in actions[:i])}" if a.kind == FORWARD else "send grad"
               for i, a in enumerate(actions)]
    on_next = ["send act" if a.kind == FORWARD else f"recv grad{sum(b.kind != FORWARD for b in actions[:i])}"
               for i, a in enumerate(actions)]
    assert prev.ops == on_prev and nxt.ops == on_next
    # posted early: before the first forward runs, the next forward's activation is on its way already
    assert events[:3] == ["post act0", "wait act0", "post act1"]
    for kind, count in (("act", micro_batches), ("grad", micro_batches)):
        for m in range(count):
            assert events.index(f"post {kind}{m}") < events.index(f"wait {kind}{m}")
    if schedule == "gpipe":  # all forwards, then all backwards: each receive posted one compute ahead
        last_grads = [e for e in events if e.startswith(("post grad", "wait grad"))]
        assert last_grads[:3] == ["post grad0", "wait grad0", "post grad1"]
