"""Pure checks of when the pipeline posts its receives (no processes: handles are fakes)."""

from __future__ import annotations

import pytest

from heteroflow.runtime.pipeline import _Recvs


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
