"""The strict NCCL/HCCL stand-ins (`heteroflow.testing.strict`) and the bridge between a staging side and a side
that does not stage (issue 25, defect 1: an 8 MiB message in 4 MiB chunks on one side, whole on the other)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from heteroflow.backends.transport import HostBridge
from heteroflow.remap.executor import Message
from heteroflow.testing import run_ranks
from heteroflow.testing.multiproc import MultiprocError
from heteroflow.testing.strict import TIMEOUT_ENVIRONMENT, StrictError, install, is_host

MIB = 1 << 20


def _bridge_rank(rank: int, world_size: int, *, staging_rank: int, nbytes: int) -> bool:
    """Rank 0 sends `nbytes` to rank 1 and gets it back plus one; only `staging_rank` stages through host buffers."""
    bridge = HostBridge(dist.group.WORLD, chunk_bytes=4 * MIB, stage_host_tensors=rank == staging_rank)
    n = nbytes // 4
    sent = torch.arange(n, dtype=torch.float32)
    if rank == 0:
        bridge.post([Message(1, sent, 0)], []).wait()
        back = torch.empty(n)
        bridge.post([], [Message(1, back, 1)]).wait()
        return torch.equal(back, sent + 1)
    got = torch.full((n,), -1.0)
    bridge.post([], [Message(0, got, 0)]).wait()
    bridge.post([Message(0, got + 1, 1)], []).wait()
    return torch.equal(got, sent)


@pytest.mark.parametrize("staging_rank", [0, 1], ids=["sender-stages", "receiver-stages"])
def test_a_bridge_over_4_mib_between_a_staging_and_a_direct_side_delivers_every_byte(staging_rank):
    assert run_ranks(_bridge_rank, 2, staging_rank=staging_rank, nbytes=8 * MIB + 12, timeout_s=60) == [True, True]


def _deadlock_rank(rank: int, world_size: int) -> None:
    install("nccl")
    group = dist.new_group([0, 1], backend="strict_nccl")
    out, inp = torch.empty(1024, device="cpu"), torch.ones(1024, device="cpu")
    # Both ranks send first, each posted alone: on an in-order, rendezvous communicator neither send completes.
    send = dist.isend(inp, 1 - rank, group=group)
    recv = dist.irecv(out, 1 - rank, group=group)
    send.wait()
    recv.wait()


def test_a_deadlock_fails_within_the_timeout_naming_each_rank_and_its_operation():
    with pytest.raises(MultiprocError) as caught:
        run_ranks(_deadlock_rank, 2, timeout_s=60, env={TIMEOUT_ENVIRONMENT: "3"})
    text = str(caught.value)
    assert "made no progress in 3 s" in text
    for rank in (0, 1):
        assert f"global rank {rank}: waits in #1 send [1024] float32 (4096 B) to group rank {1 - rank} tag 0" in text


def _batched_rank(rank: int, world_size: int) -> list[float]:
    install("hccl")
    group = dist.new_group([0, 1], backend="strict_hccl")
    out, inp = torch.empty(4, device="cpu"), torch.full((4,), float(rank + 1), device="cpu")
    ops = [dist.P2POp(dist.isend, inp, 1 - rank, group=group), dist.P2POp(dist.irecv, out, 1 - rank, group=group)]
    for work in dist.batch_isend_irecv(ops):  # one group call: the sends and receives run together
        work.wait()
    return out.tolist()


def test_batched_sends_and_receives_run_together():
    assert run_ranks(_batched_rank, 2, timeout_s=60) == [[2.0] * 4, [1.0] * 4]


def _rules_rank(rank: int, world_size: int) -> dict:
    # Rank 0 is a CUDA rank, rank 1 an Ascend one: each registers only its own vendor's stand-in, and each creates
    # the other's group as a non-member without having its backend.
    install("nccl" if rank == 0 else "hccl")
    cuda = dist.new_group([0], backend="strict_nccl")
    npu = dist.new_group([1], backend="strict_hccl")
    both = dist.new_group([0, 1])  # gloo, strict on accelerator ranks
    mine = cuda if rank == 0 else npu
    found = {}
    counts = torch.tensor([1, 2])  # no device: host memory on a card
    found["host tagged"] = is_host(counts) and is_host(counts.view(2, 1)) and is_host(counts.cpu())
    device = torch.zeros(2, device="cpu")
    found["device untagged"] = not is_host(device) and not is_host(counts.to(device.device))
    found["host copy tagged"] = is_host(device.cpu()) and not is_host(device)
    for name, call in (("vendor refuses host", lambda: dist.all_reduce(counts, group=mine)),
                       ("gloo refuses device", lambda: dist.all_reduce(device, group=both))):
        try:
            call()
            found[name] = False
        except StrictError:
            found[name] = True
    dist.all_reduce(device, group=mine)
    host = device.cpu()
    dist.all_reduce(host, group=both)
    found["sums"] = host.tolist()
    return found


def test_vendor_groups_refuse_host_tensors_and_gloo_refuses_device_tensors():
    for found in run_ranks(_rules_rank, 2, timeout_s=60):
        assert found == {"host tagged": True, "device untagged": True, "host copy tagged": True,
                         "vendor refuses host": True, "gloo refuses device": True, "sums": [0.0, 0.0]}


def test_host_tags_follow_what_real_code_makes_host():
    """No processes: the torch function mode's rules, one by one."""
    from heteroflow.testing.strict import HostTags

    with HostTags():
        device = torch.zeros(3, device="cpu")  # the stage's device (an explicit device argument)
        counts = torch.tensor([1, 2, 3])  # no device: host
        pinned = torch.empty(3, pin_memory=False)
        assert not is_host(device) and is_host(counts) and is_host(pinned)
        assert is_host(counts[1:]) and is_host(counts.view(3, 1))  # views of host memory
        assert is_host(counts.sum(0)) and is_host(counts.float())  # computed from host tensors only
        assert not is_host(device + counts)  # a device result (real code would have moved counts first)
        staged = device.cpu()
        assert is_host(staged) and staged is not device and not is_host(device)  # a copy, as a card makes
        moved = counts.to(device.device)
        assert not is_host(moved) and moved is not counts  # a device copy
        assert is_host(torch.empty_like(counts)) and not is_host(torch.empty_like(device))
