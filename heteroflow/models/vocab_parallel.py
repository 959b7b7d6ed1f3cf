"""Vocabulary-parallel embedding, LM head and cross entropy over a stage's tp group (Megatron-style).

Rank r of the tp group holds rows `even_split(vocab_size, tp, r)` of the embedding and of the head:
the vocabulary is split into nearly equal contiguous pieces instead of being padded to a multiple of
tp, so there are no padding rows to mask, initialize, load or exclude from the optimizer. Full logits
are never materialized on one rank in training: the loss needs only a max, a sum of exponentials and
the target logit, each all-reduced over tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from heteroflow.models.llama import IGNORE_INDEX
from heteroflow.models.tp_ops import (all_reduce_max, all_reduce_sum, copy_to_tp, gather_last_dim, gather_seq,
                                      reduce_from_tp, reduce_scatter_seq)


class _VocabParallelLossSum(torch.autograd.Function):
    """Summed cross entropy of logits split over the vocabulary; computed in fp32."""

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, labels_N: torch.Tensor, vocab_start: int, group: ProcessGroup):
        logits = logits_NV.float()
        shifted = logits - all_reduce_max(logits.max(dim=-1).values, group)[:, None]
        valid = labels_N != IGNORE_INDEX
        local = labels_N - vocab_start
        here = valid & (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        target = shifted.gather(1, index[:, None]).squeeze(1) * here
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        target, sum_exp = all_reduce_sum(torch.stack([target, sum_exp]), group).unbind(0)
        loss = ((sum_exp.log() - target) * valid).sum()
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), index, here, valid)
        ctx.dtype = logits_NV.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, here, valid = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target), zero for ignored tokens; a copy, so that a
        # second backward through a retained graph sees the saved softmax unchanged.
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(1, index[:, None], -here.to(softmax.dtype)[:, None])
        grad_logits.mul_((valid.to(softmax.dtype) * grad)[:, None])
        return grad_logits.to(ctx.dtype), None, None, None


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                            group: ProcessGroup) -> torch.Tensor:
    """Summed token loss (fp32 scalar, equal on every tp rank) from this rank's vocabulary slice of logits."""
    return _VocabParallelLossSum.apply(logits.flatten(0, -2), labels.flatten(), vocab_start, group)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over tp; the output is replicated, or sequence-sharded with sp."""

    def __init__(self, weight: nn.Parameter, *, vocab_start: int, group: ProcessGroup, sp: bool):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.group, self.sp = vocab_start, group, sp

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        local = ids_BS - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_scatter_seq(out, self.group) if self.sp else reduce_from_tp(out, self.group)


class VocabParallelHead(nn.Module):
    """LM head whose vocabulary rows are split over tp; returns the summed loss or full logits."""

    def __init__(self, weight: nn.Parameter, *, vocab_start: int, shard_sizes: list[int], group: ProcessGroup,
                 sp: bool):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.shard_sizes, self.group, self.sp = vocab_start, shard_sizes, group, sp

    def forward(self, x_BSH: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x_BSH = gather_seq(x_BSH, self.group) if self.sp else copy_to_tp(x_BSH, self.group)
        logits = F.linear(x_BSH, self.weight)
        if labels is None:
            return gather_last_dim(logits, self.group, self.shard_sizes)
        return vocab_parallel_loss_sum(logits, labels, self.vocab_start, self.group)
