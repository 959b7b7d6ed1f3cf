"""Summed next-token cross entropy computed in chunks of tokens, so that no fp32 copy of all logits exists.

Forward: per chunk of rows, the fp32 row max and sum of exponentials, and the target logit; saved for the
backward are the logits in their own dtype and one fp32 log-sum-exp per row. Backward: per chunk, softmax minus
one-hot in fp32, written into the logits' gradient in the logits' dtype. Beyond the logits themselves, the
memory is their gradient (the logits' dtype) and one chunk in fp32 (`CHUNK_BYTES`); the planner prices the two
logit-sized tensors (`stagemap.memory.logit_bytes`).

Vocabulary-parallel logits (each tp rank holds a contiguous slice of the vocabulary, Megatron's layout) pass
their `group` and `vocab_start`: the row max, the sums of exponentials and the target logits are all-reduced over
it, so every rank gets the whole vocabulary's loss and its slice of the gradient.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from heteroflow.models.tp_ops import all_reduce_max, all_reduce_sum

IGNORE_INDEX = -100
"""Label value whose token does not count in the loss (as in PyTorch and Hugging Face)."""

CHUNK_BYTES = 32 << 20
"""fp32 bytes of one chunk of logits worked on at a time."""


def chunk_rows(vocab: int) -> int:
    """Rows (tokens) per chunk of a [tokens, vocab] logits tensor."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class _ChunkedLossSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, labels_N: torch.Tensor, vocab_start: int,
                group: ProcessGroup | None) -> torch.Tensor:
        n, vocab = logits_NV.shape
        rows = chunk_rows(vocab)
        valid = labels_N != IGNORE_INDEX
        local = labels_N - vocab_start
        here = valid & (local >= 0) & (local < vocab)
        index = local.clamp(0, vocab - 1)
        row_max = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        for start in range(0, n, rows):  # the max of the logits' own dtype is exact
            row_max[start:start + rows] = logits_NV[start:start + rows].amax(dim=-1).float()
        if group is not None:
            row_max = all_reduce_max(row_max, group)
        sum_exp = torch.empty_like(row_max)
        for start in range(0, n, rows):
            chunk = logits_NV[start:start + rows].to(torch.float32, copy=True).sub_(row_max[start:start + rows, None])
            sum_exp[start:start + rows] = chunk.exp_().sum(dim=-1)
        target = logits_NV.gather(1, index[:, None]).squeeze(1).float() * here
        if group is not None:
            target, sum_exp = all_reduce_sum(torch.stack([target, sum_exp]), group).unbind(0)
        lse = sum_exp.log_().add_(row_max)
        ctx.save_for_backward(logits_NV, lse, index, here, valid)
        return ((lse - target) * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits_NV, lse, index, here, valid = ctx.saved_tensors
        rows = chunk_rows(logits_NV.shape[1])
        scale = valid.to(torch.float32) * grad
        minus_one = -here.to(torch.float32)[:, None]
        grad_logits = torch.empty_like(logits_NV)
        for start in range(0, logits_NV.shape[0], rows):  # d loss / d logit = softmax - onehot(target)
            end = start + rows
            chunk = logits_NV[start:end].to(torch.float32, copy=True).sub_(lse[start:end, None]).exp_()
            chunk.scatter_add_(1, index[start:end, None], minus_one[start:end])
            grad_logits[start:end] = chunk.mul_(scale[start:end, None])
        return grad_logits, None, None, None


def chunked_loss_sum(logits_NV: torch.Tensor, labels_N: torch.Tensor, *, vocab_start: int = 0,
                     group: ProcessGroup | None = None) -> torch.Tensor:
    """Summed cross entropy (fp32 scalar) of [tokens, vocab] logits against [tokens] labels (`IGNORE_INDEX`: not
    counted); with `group`, the logits are this rank's vocabulary slice starting at `vocab_start`."""
    return _ChunkedLossSum.apply(logits_NV, labels_N, vocab_start, group)
