"""The chunked cross entropy: the loss and logits' gradient of PyTorch's fp32 cross entropy, without ever making an
fp32 tensor the size of all logits (forward or backward); vocabulary-parallel slices give the same over tp."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from heteroflow.models import cross_entropy
from heteroflow.models.cross_entropy import IGNORE_INDEX, chunked_loss_sum
from heteroflow.testing.multiproc import run_ranks


class _LargestFloat32(TorchDispatchMode):
    """The most elements of any fp32 tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _case(dtype: torch.dtype, n: int = 96, vocab: int = 200):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_and_gradient_match_fp32_cross_entropy(monkeypatch, dtype):
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 4 * 200 * 10)  # 10 rows a chunk: 10 chunks here
    logits, labels = _case(dtype)
    ref = F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
    (ref_grad,) = torch.autograd.grad(ref * 0.5, logits)
    loss = chunked_loss_sum(logits, labels)
    (grad,) = torch.autograd.grad(loss * 0.5, logits)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert grad[::7].abs().sum() == 0  # ignored tokens


def test_no_fp32_tensor_holds_all_logits_in_forward_or_backward(monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 4 * 200 * 16)
    logits, labels = _case(torch.bfloat16)
    with _LargestFloat32() as mode:
        loss = chunked_loss_sum(logits, labels)
        loss.backward()
    assert 0 < mode.largest <= 16 * 200  # one chunk in fp32, never the 96 x 200 logits
    with _LargestFloat32() as mode:  # what it replaced
        F.cross_entropy(logits.float(), labels, reduction="sum").backward()
    assert mode.largest == logits.numel()


def _vocab_parallel(rank: int, world_size: int) -> None:
    logits, labels = _case(torch.float32)
    ref = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    bounds = [0, 120, 200]  # uneven slices, as `even_split` may give
    mine = logits.detach()[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
    loss = chunked_loss_sum(mine, labels, vocab_start=bounds[rank], group=dist.group.WORLD)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(mine.grad, ref_grad[:, bounds[rank]:bounds[rank + 1]])


@pytest.mark.slow
def test_vocabulary_parallel_slices_give_the_whole_loss_and_their_gradient():
    run_ranks(_vocab_parallel, 2, timeout_s=120)
