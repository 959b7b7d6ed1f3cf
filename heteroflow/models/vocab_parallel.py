"""Vocabulary-parallel embedding, LM head and cross entropy over a stage's tp group (Megatron-style).

Rank r of the tp group holds rows `even_split(vocab_size, tp, r)` of the embedding and of the head:
the vocabulary is split into nearly equal contiguous pieces instead of being padded to a multiple of
tp, so there are no padding rows to mask, initialize, load or exclude from the optimizer. Full logits
are never materialized on one rank in training: the loss needs only a max, a sum of exponentials and
the target logit, each all-reduced over tp (`cross_entropy.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from heteroflow.models.cross_entropy import chunked_loss_sum
from heteroflow.models.tp_ops import copy_to_tp, gather_last_dim, gather_seq, reduce_from_tp, reduce_scatter_seq


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                            group: ProcessGroup) -> torch.Tensor:
    """Summed token loss (fp32 scalar, equal on every tp rank) from this rank's vocabulary slice of logits,
    computed in chunks of tokens (`cross_entropy.chunked_loss_sum`)."""
    return chunked_loss_sum(logits.flatten(0, -2), labels.flatten(), vocab_start=vocab_start, group=group)


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
