"""RemapExecutor without processes: the messages it posts and the mistakes it refuses."""

from __future__ import annotations

import pytest
import torch

from heteroflow.remap import TensorLayout, box_slices, plan_transfer
from heteroflow.remap.executor import RemapExecutor


class RecordingTransport:
    """Keeps posted messages; its work never completes (nothing is on the other side)."""

    kind = "recording"

    def __init__(self):
        self.posts = []

    def post(self, sends, recvs):
        self.posts.append((list(sends), list(recvs)))
        return self

    def wait(self):
        pass

    def is_completed(self):
        return False


SRC = TensorLayout.activation((4, 6, 2), ranks=(0, 1), dp=1, tp=2)
DST = TensorLayout.activation((4, 6, 2), ranks=(2, 3), dp=1, tp=2, sp=True)


def test_a_source_posts_its_stripe_as_contiguous_messages():
    plan = plan_transfer(SRC, DST)
    transport = RecordingTransport()
    x = torch.arange(48.0).reshape(4, 6, 2)
    RemapExecutor(plan, rank=1, transport=transport, dtype=torch.float32).start(x)
    (sends, recvs), = transport.posts
    assert recvs == []
    assert [(m.peer, m.tag) for m in sends] == [(p.dst, i) for i, p in plan.sends_of(1)]
    for message, (_, piece) in zip(sends, plan.sends_of(1)):
        assert not x[box_slices(piece.box)].is_contiguous()  # a seq slice of the share...
        assert message.tensor.is_contiguous()  # ...is packed into a reused buffer first
        assert torch.equal(message.tensor, x[box_slices(piece.box)])


def test_a_destination_posts_receives_for_its_pieces():
    plan = plan_transfer(SRC, DST)
    transport = RecordingTransport()
    handle = RemapExecutor(plan, rank=3, transport=transport, dtype=torch.float32, tag_base=1 << 20).start()
    (sends, recvs), = transport.posts
    assert sends == [] and not handle.is_completed()
    assert [(m.peer, m.tag, tuple(m.tensor.shape)) for m in recvs] == \
           [(p.src, (1 << 20) + i, tuple(b - a for a, b in p.box)) for i, p in plan.recvs_of(3)]


def test_mistakes_are_refused_with_what_to_do():
    plan = plan_transfer(SRC, DST)
    transport = RecordingTransport()
    source = RemapExecutor(plan, rank=0, transport=transport, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"local on rank 0 must be \[4, 6, 2\] torch.float32 on cpu, got \[4, 6\]"):
        source.start(torch.zeros(4, 6))
    with pytest.raises(ValueError, match="pass it to start"):
        source.start()
    dest = RemapExecutor(plan, rank=2, transport=transport, dtype=torch.float32)
    with pytest.raises(ValueError, match="not a source of this remap"):
        dest.start(torch.zeros(4, 6, 2))
    dest.start()
    dest.start()
    with pytest.raises(RuntimeError, match="already has 2 remaps in flight"):
        dest.start()
    fan_plan = plan_transfer(DST, SRC)  # back to replicas: rank 0 takes part in fan-outs
    with pytest.raises(ValueError, match="pass the process group of its destination replica set"):
        RemapExecutor(fan_plan, rank=0, transport=transport, dtype=torch.float32)
    partial = plan_transfer(SRC, DST, source_replicas="partial")
    with pytest.raises(ValueError, match="as reduce_group"):
        RemapExecutor(partial, rank=0, transport=transport, dtype=torch.float32)
