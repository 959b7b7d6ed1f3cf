"""Causal attention of one cp rank's two query chunks over the whole sequence (`context_parallel.py`).

Chunk c (w queries at positions c*w..) attends to the keys before it without a mask and to its own key
chunk with a causal one; the two partial results merge by their log-sum-exp (online softmax). The
backward runs each block's backward with the *merged* output and log-sum-exp, which is exactly that
block's share of the gradient (all a FlashAttention-style backward needs). Chunks after c are skipped,
which is where the causal load balancing pays: every rank computes the same number of blocks.

K and V are all-gathered over cp in the forward and gathered again in the backward (nothing of the
other ranks is kept between the two: activation memory stays that of the rank's own tokens, O(s / cp), as
`stagemap.memory` prices it); their gradients go back to their owners by a reduce-scatter. They stay at the kv
heads (grouped-query attention): the kernels group query heads over them.

Kernels (`Kernel`), fused ones that return the log-sum-exp and whose backward takes it, chosen per device:
- cpu: ATen's flash attention for CPU (what `F.scaled_dot_product_attention` runs there; it groups query heads
  over the kv heads itself);
- cuda (NVIDIA, and AMD through ROCm's build): ATen's flash attention for fp16/bf16 on devices that have it,
  with K/V repeated to the query heads per block;
- math: an exact version in the accumulation dtype with each block's scores materialized, for every other
  case (other vendors, fp32 on CUDA) and as the reference the fused kernels are tested against.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from heteroflow.devices.facade import compute_capability_major
from heteroflow.models.tp_ops import all_gather_dim, reduce_scatter_dim

_SEQ = 2
"""Sequence dim of [batch, heads, seq, head_dim]."""


class Kernel(enum.Enum):
    """The block attention kernels (module doc)."""

    CPU = "cpu"
    CUDA = "cuda"
    MATH = "math"


def choose_kernel(q: torch.Tensor, *, math_kernel: bool = False) -> Kernel:
    """The fused kernel for `q`'s device, dtype and head size, or the math reference (always with `math_kernel`)."""
    if math_kernel:
        return Kernel.MATH
    if q.device.type == "cpu":
        return Kernel.CPU
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and (compute_capability_major(q.device) or 0) >= 8):
        return Kernel.CUDA
    return Kernel.MATH


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, math_kernel: bool = False,
           kernel: Kernel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its log-sum-exp [batch, heads, seq] (in `accumulation_dtype`) for one block
    (causal: top-left aligned); k and v may have fewer (kv) heads than q."""
    kernel = kernel or choose_kernel(q, math_kernel=math_kernel)
    if kernel is Kernel.CPU:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    repeats = q.shape[1] // k.shape[1]
    k, v = _repeat_heads(k, repeats), _repeat_heads(v, repeats)
    if kernel is Kernel.CUDA:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse[..., :q.shape[_SEQ]]
    scores = _scores(q, k, causal)
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ v.to(scores.dtype)
    return out.to(q.dtype), lse


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: softmax statistics and summed gradients."""
    return torch.promote_types(dtype, torch.float32)


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, *, causal: bool, math_kernel: bool = False, kernel: Kernel | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (k and v at their own heads) for one block, given the output and log-sum-exp of the
    whole row."""
    kernel = kernel or choose_kernel(q, math_kernel=math_kernel)
    if kernel is Kernel.CPU:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal)
    repeats = q.shape[1] // k.shape[1]
    k_r, v_r = _repeat_heads(k, repeats), _repeat_heads(v, repeats)
    if kernel is Kernel.CUDA:
        none = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k_r, v_r, out.contiguous(), lse.contiguous(), none, none, q.shape[_SEQ],
            k.shape[_SEQ], 0.0, causal, none, none)
        return dq, _sum_heads(dk, repeats), _sum_heads(dv, repeats)
    acc = accumulation_dtype(q.dtype)
    p = (_scores(q, k_r, causal) - lse[..., None].to(acc)).exp()
    dout_acc = dout.to(acc)
    dv = p.transpose(-1, -2) @ dout_acc
    dp = dout_acc @ v_r.to(acc).transpose(-1, -2)
    row = (dout_acc * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - row) / math.sqrt(q.shape[-1])
    dk = ds.transpose(-1, -2) @ q.to(acc)
    return (ds @ k_r.to(acc)).to(q.dtype), _sum_heads(dk, repeats).to(k.dtype), _sum_heads(dv, repeats).to(v.dtype)


def _repeat_heads(t: torch.Tensor, repeats: int) -> torch.Tensor:
    """kv heads repeated to the query heads (query head j uses kv head j // repeats)."""
    return t.repeat_interleave(repeats, dim=1) if repeats > 1 else t


def _sum_heads(t: torch.Tensor, repeats: int) -> torch.Tensor:
    """The inverse for gradients: query heads that shared a kv head add theirs."""
    return t.unflatten(1, (t.shape[1] // repeats, repeats)).sum(2) if repeats > 1 else t


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    acc = accumulation_dtype(q.dtype)
    scores = q.to(acc) @ k.to(acc).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    acc = lse.dtype
    out = out_a.to(acc) * (lse_a - lse).exp()[..., None] + out_b.to(acc) * (lse_b - lse).exp()[..., None]
    return out.to(out_a.dtype), lse


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (of `2 * cp`) that cp rank `cp_rank` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def _sequence_order(t: torch.Tensor, cp: int, w: int) -> torch.Tensor:
    """Gathered blocks (rank i's two chunks at 2i, 2i+1) put in sequence order."""
    parts = t.split(w, dim=_SEQ)
    by_chunk = {c: parts[2 * i + j] for i in range(cp) for j, c in enumerate(chunk_ids(cp, i))}
    return torch.cat([by_chunk[c] for c in range(2 * cp)], dim=_SEQ)


def _rank_order(t: torch.Tensor, cp: int, w: int) -> torch.Tensor:
    """The inverse of `_sequence_order`."""
    parts = t.split(w, dim=_SEQ)
    return torch.cat([parts[c] for i in range(cp) for c in chunk_ids(cp, i)], dim=_SEQ)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, math_kernel):
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        w = q.shape[_SEQ] // 2
        kernel = choose_kernel(q, math_kernel=math_kernel)
        k_all, v_all = _gather_keys(k, v, group, cp, w)
        outs, lses = [], []
        for j, c in enumerate(chunk_ids(cp, cp_rank)):
            q_c = q[:, :, j * w:(j + 1) * w]
            result = attend(q_c, k_all[:, :, c * w:(c + 1) * w], v_all[:, :, c * w:(c + 1) * w], causal=True,
                            kernel=kernel)
            if c > 0:
                earlier = attend(q_c, k_all[:, :, :c * w], v_all[:, :, :c * w], causal=False, kernel=kernel)
                result = _merge(earlier, result)
            outs.append(result[0])
            lses.append(result[1])
        out, lse = torch.cat(outs, dim=_SEQ), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel = group, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        w = q.shape[_SEQ] // 2
        k_all, v_all = _gather_keys(k, v, group, cp, w)
        dk_all = torch.zeros(k_all.shape, dtype=accumulation_dtype(k.dtype), device=k.device)
        dv_all = torch.zeros_like(dk_all)
        dqs = []
        for j, c in enumerate(chunk_ids(cp, cp_rank)):
            rows = slice(j * w, (j + 1) * w)
            args = (dout[:, :, rows], q[:, :, rows])
            stats = (out[:, :, rows], lse[:, :, rows])
            own = slice(c * w, (c + 1) * w)
            dq, dk, dv = attend_backward(*args, k_all[:, :, own], v_all[:, :, own], *stats, causal=True,
                                         kernel=kernel)
            dq = dq.to(dk_all.dtype)
            dk_all[:, :, own] += dk
            dv_all[:, :, own] += dv
            if c > 0:
                before = slice(0, c * w)
                dq2, dk, dv = attend_backward(*args, k_all[:, :, before], v_all[:, :, before], *stats, causal=False,
                                              kernel=kernel)
                dq += dq2
                dk_all[:, :, before] += dk
                dv_all[:, :, before] += dv
            dqs.append(dq)
        grads = [reduce_scatter_dim(_rank_order(d_all, cp, w).contiguous(), group, _SEQ).to(like.dtype)
                 for d_all, like in ((dk_all, k), (dv_all, v))]
        return torch.cat(dqs, dim=_SEQ).to(q.dtype), grads[0], grads[1], None, None


def _gather_keys(k, v, group, cp, w):
    return [_sequence_order(all_gather_dim(t.contiguous(), group, _SEQ), cp, w) for t in (k, v)]


def context_parallel_attention(q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                               group: ProcessGroup, *, math_kernel: bool = False) -> torch.Tensor:
    """Causal attention of this cp rank's queries (its two chunks) over every cp rank's keys (math_kernel: the
    reference kernel whatever the device)."""
    return _ContextParallelAttention.apply(q_BNSD, k_BKSD, v_BKSD, group, math_kernel)
