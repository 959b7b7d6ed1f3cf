"""Context parallelism (cp) for one stage: the sequence split over the stage's cp ranks, attention over
the whole sequence. Applied by `parallelize.py`; the model code only asks its modules for token positions.

Layout (the one `remap.TensorLayout.activation` describes for boundaries): the sequence is cut into
`2 * cp` chunks of `w` tokens and cp rank r holds chunks r and `2cp - 1 - r`, stored one after the other.
Under a causal mask the early chunks see few keys and the late ones many, so pairing a chunk from each
end gives every rank the same attention work (Megatron-LM's and Transformer Engine's load balancing).
Under sp, the tp ranks split that local sequence again (`TensorLayout`'s inner axes).

Attention (`cp_attention.py`): each rank all-gathers K and V (kv heads only) over cp and runs causal
attention of its two query chunks against the keys up to each chunk, block by block with an
online-softmax merge; the backward gathers K and V again and reduce-scatters their gradients. Why
all-gather and not a ring of K/V: the bytes per rank are the same ((cp - 1) K/V chunks in the forward;
as many in, and as many gradient chunks out, in the backward), the collectives are ones every backend
has (all-gather, reduce-scatter), and the ring's gain, hiding each transfer behind one block's compute,
needs a stream per direction that this runtime does not drive. The planner prices exactly this
(`stagemap/costs.py`: the all-gather forward, all-gather plus reduce-scatter backward, not overlapped).

RoPE and learned position embeddings use the tokens' global positions (`ChunkPositions`).
Gradients of the stage's (replicated) weights are partial sums over cp, summed by `all_reduce_cp_grads`.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from heteroflow.models.cp_attention import chunk_ids, context_parallel_attention
from heteroflow.models.llama import AttentionCore, StageModel


def split_sequence(x: torch.Tensor, *, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's share of a full-sequence tensor (token ids, labels): its two chunks, concatenated."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence of {x.shape[dim]} tokens does not split into 2 * cp = {2 * cp} chunks")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp, cp_rank)], dim=dim).contiguous()


def local_positions(local_len: int, *, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of the `local_len` tokens a cp rank holds (its two chunks)."""
    w = local_len // 2
    return torch.cat([torch.arange(c * w, (c + 1) * w, device=device) for c in chunk_ids(cp, cp_rank)])


@dataclass(frozen=True, slots=True)
class ChunkPositions:
    """`positions(seq_len, device)` of a module that sees one cp rank's tokens (replaces the model's
    0..seq_len-1; see `Attention.positions`)."""

    cp: int
    cp_rank: int

    def __call__(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return local_positions(seq_len, cp=self.cp, cp_rank=self.cp_rank, device=device)


class ContextParallelCore(AttentionCore):
    """Causal attention of this cp rank's query chunks over the whole sequence's keys (module doc)."""

    def __init__(self, group: ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> torch.Tensor:
        return context_parallel_attention(q_BNSD, k_BKSD, v_BKSD, self.group)


def apply_context_parallel(model: StageModel, group: ProcessGroup) -> None:
    """Make `model` run on one cp rank's chunks: global positions, attention over the whole sequence."""
    positions = ChunkPositions(cp=dist.get_world_size(group), cp_rank=dist.get_rank(group))
    for block in model.layers.values():
        block.attn.core = ContextParallelCore(group)
        block.attn.positions = positions
    if model.pos_embed is not None:
        model.pos_embed.positions = positions


@torch.no_grad()
def all_reduce_cp_grads(model: nn.Module, group: ProcessGroup,
                        grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad) -> None:
    """Sum the weights' gradients over the cp group (each rank saw only its tokens), one flat buffer per dtype;
    `grad_of(param)` is where the parameter's accumulated gradient lives (the optimizer's `grad_of`)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        grad = grad_of(param)
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
