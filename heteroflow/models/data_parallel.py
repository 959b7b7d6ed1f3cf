"""Gradient reduction inside a stage and its AdamW step: dp all-reduce, or ZeRO-1, with fp32 masters.

Per optimizer step, after every micro-batch's backward (the runtime scales each loss by
1 / global tokens, so gradients are *summed* over micro-batches and dp ranks, never averaged):

    sync_tied_grads(model, group=tied_group, tp_rank=..., dp_rank=...)   # only when tied across stages
    opt.reduce_grads()            # sum partial grads over tp, then sum over dp (reduce-scatter with ZeRO)
    share = opt.grad_sq_norm_share()      # all-reduce the shares over the world -> global norm^2
    opt.step(lr=..., grad_scale=clip_coef)
    opt.zero_grad()

Everything lives in flat fp32 buffers (one bucket, no overlap with backward: simple and exact; the
cost is one extra fp32 copy of the gradients). ZeRO stage 1 and 2 behave the same here: gradients
are reduce-scattered, and each dp rank keeps fp32 master weights and Adam moments for its 1/dp of
the flat buffer only, then all-gathers the updated weights. Weight decay skips 1-D parameters
(norm weights and biases), as Megatron-LM does. The update itself is `heteroflow.optim.adamw_step`
(torch's functional AdamW), the one `OffloadedAdamW` runs too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from heteroflow.layout.shards import counted_once, zero_flat_range
from heteroflow.models.shard import shard_of
from heteroflow.models.tp_ops import _ALL_GATHER, _REDUCE_SCATTER
from heteroflow.optim.adamw import adamw_step


def all_reduce_partial_grads(model: nn.Module, tp_group: ProcessGroup | None) -> None:
    """Sum over tp the gradients marked `partial_grad` (norms under sp, q/k norms, replicated kv weights)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [p.grad for p in model.parameters() if shard_of(p).partial_grad and p.grad is not None]
    if grads:
        flat = torch.cat([g.flatten().float() for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


@torch.no_grad()
def sync_tied_grads(model: nn.Module, *, group: ProcessGroup, tp_rank: int, dp_rank: int) -> None:
    """Sum the tied embedding's gradient (first stage) with the head copy's (last stage).

    Call on every rank of the first and the last stage, with `group` holding exactly those ranks,
    before `reduce_grads`. Afterwards dp rank 0 of each stage holds its slice of the total and the
    other dp ranks zeros, so the following dp sum leaves every rank of both stages with the total.
    Each stage may use its own tp and dp: the exchange goes through the full logical tensor.
    """
    for name in model.tied_parameter_names():
        param = model.get_parameter(name)
        shard = shard_of(param)
        full = torch.zeros(shard.full_shape, dtype=torch.float32, device=param.device)
        if param.grad is not None and counted_once(split_over_tp=shard.dim is not None, tp_rank=tp_rank):
            shard.take(full).copy_(param.grad)
        dist.all_reduce(full, group=group)
        total = shard.take(full)
        param.grad = total.to(param.dtype, copy=True) if dp_rank == 0 else torch.zeros_like(param)


@dataclass(frozen=True, slots=True)
class _Segment:
    """Where a parameter sits in the flat buffer, and how it is treated."""

    param: nn.Parameter
    offset: int
    numel: int
    decay: bool
    counted: bool
    """Counts toward the global gradient norm on this rank (`layout.shards.counted_once`: tp-replicated
    values on tp rank 0, unsharded state on dp rank 0, an embedding tied across stages on the first stage)."""


class DataParallelAdamW:
    """AdamW with fp32 master weights over one stage's parameters, gradients summed over `dp_group`
    (a `heteroflow.optim.StageOptimizer`).

    zero=0: every dp rank keeps all masters and moments; zero=1 (or 2): each keeps 1/dp of them.
    Build it after the weights are initialized or loaded (the masters copy the current values).
    """

    def __init__(self, model: nn.Module, *, dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None,
                 zero: int = 0, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        if zero not in (0, 1, 2):
            raise ValueError(f"DataParallelAdamW implements ZeRO 0, 1 and 2, not {zero}")
        self.model, self.dp_group, self.tp_group = model, dp_group, tp_group
        self.zero, self.betas, self.eps, self.weight_decay = zero, betas, eps, weight_decay
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        is_last = getattr(model, "is_last", False)
        head_copy = {n for n in getattr(model, "tied_parameter_names", tuple)() if is_last}
        self.segments: list[_Segment] = []
        offset = 0
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            counted = counted_once(split_over_tp=shard_of(param).dim is not None, tp_rank=tp_rank,
                                   dp_rank=self.dp_rank, split_over_dp=bool(zero), tied_head_copy=name in head_copy)
            self.segments.append(_Segment(param, offset, param.numel(), param.dim() >= 2, counted))
            offset += param.numel()
        self.numel = offset
        # With ZeRO this rank owns [lo, hi) of the flat buffer; without, all of it.
        self.lo, self.hi, self.padded = zero_flat_range(offset, dp=self.dp, dp_rank=self.dp_rank, zero=zero)
        self.master = self._flat_params()[self.lo:self.hi].clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.grad: torch.Tensor | None = None
        self.steps = 0
        self._runs = self._owned_runs()

    def _flat_params(self) -> torch.Tensor:
        device = self.segments[0].param.device if self.segments else None
        flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for s in self.segments:
            flat[s.offset:s.offset + s.numel].copy_(s.param.detach().flatten())
        return flat

    def _owned(self, s: _Segment) -> tuple[int, int] | None:
        """The part of segment `s` inside this rank's range, relative to `lo`."""
        a, b = max(s.offset, self.lo), min(s.offset + s.numel, self.hi)
        return (a - self.lo, b - self.lo) if a < b else None

    def _owned_runs(self) -> list[tuple[int, int, bool]]:
        """The owned parts of the segments as `(a, b, decay)`, adjacent ones with the same decay merged: one
        tensor op per run instead of per parameter."""
        runs: list[tuple[int, int, bool]] = []
        for s in self.segments:
            part = self._owned(s)
            if part is None:
                continue
            if runs and runs[-1][1] == part[0] and runs[-1][2] == s.decay:
                runs[-1] = (runs[-1][0], part[1], s.decay)
            else:
                runs.append((*part, s.decay))
        return runs

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum partial grads over tp, then sum over dp into this rank's fp32 gradient (shard)."""
        all_reduce_partial_grads(self.model, self.tp_group)
        device = self.master.device
        flat = torch.empty(self.padded, dtype=torch.float32, device=device)
        flat[self.numel:].zero_()
        for s in self.segments:
            part = flat[s.offset:s.offset + s.numel]
            if s.param.grad is None:
                part.zero_()
            else:
                part.view_as(s.param.grad).copy_(s.param.grad)
        if self.dp > 1 and self.zero:
            self.grad = torch.empty(self.hi - self.lo, dtype=torch.float32, device=device)
            _REDUCE_SCATTER(self.grad, flat, group=self.dp_group)
        else:
            if self.dp > 1:
                dist.all_reduce(flat, group=self.dp_group)
            self.grad = flat[self.lo:self.hi]
        if self.zero >= 2:  # ZeRO-2: the reduced shard is all that is kept
            self.zero_grad()

    @torch.no_grad()
    def grad_sq_norm_share(self) -> torch.Tensor:
        """This rank's part of the global squared gradient norm: the sum of every rank's share, over
        all stages, is the squared norm of the whole model's gradient (each value counted once)."""
        assert self.grad is not None, "call reduce_grads() first"
        total = torch.zeros((), dtype=torch.float32, device=self.master.device)
        # Parameter by parameter, in model order: the offloaded optimizer sums the same terms in the same
        # order, so a plan trains bit for bit alike with and without offload.
        for s in self.segments:
            part = self._owned(s)
            if s.counted and part is not None:
                total += self.grad[part[0]:part[1]].pow(2).sum()
        return total

    @torch.no_grad()
    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on this rank's masters (gradient times `grad_scale`, e.g. a clip coefficient),
        then write the new weights into the model (all-gathered from the dp ranks with ZeRO)."""
        assert self.grad is not None, "call reduce_grads() first"
        self.steps += 1
        grad = self.grad.mul_(grad_scale) if grad_scale != 1.0 else self.grad  # ours, read only here
        runs = [slice(a, b) for a, b, _ in self._runs]
        adamw_step([self.master[r] for r in runs], [grad[r] for r in runs], [self.exp_avg[r] for r in runs],
                   [self.exp_avg_sq[r] for r in runs], decays=[decay for _, _, decay in self._runs],
                   step=self.steps, lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        self.grad = None
        full = self.master
        if self.zero and self.dp > 1:
            full = torch.empty(self.padded, dtype=torch.float32, device=self.master.device)
            _ALL_GATHER(full, self.master, group=self.dp_group)
        for s in self.segments:
            s.param.copy_(full[s.offset:s.offset + s.numel].view_as(s.param))

    def zero_grad(self) -> None:
        """Drop the model's gradients (the next backward starts from zero)."""
        for s in self.segments:
            s.param.grad = None

    def state_views(self, *, writable: bool = False):
        """For checkpoints: per parameter, the part of its fp32 state this rank keeps, as
        `(param, start, stop, {"master": t, "exp_avg": t, "exp_avg_sq": t})`; `[start, stop)` indexes the
        flattened local parameter and each `t` is a 1-D view of that range of the state. The views are the
        state itself, so `writable` (asked for when loading; `OffloadedAdamW` needs it) changes nothing here."""
        for s in self.segments:
            part = self._owned(s)
            if part is not None:
                a, b = part
                start = a + self.lo - s.offset
                yield s.param, start, start + b - a, {"master": self.master[a:b], "exp_avg": self.exp_avg[a:b],
                                                      "exp_avg_sq": self.exp_avg_sq[a:b]}

    def named_weights(self):
        """For checkpoints: `(name, tensor)` of every parameter's current value (the model's own tensors)."""
        return self.model.named_parameters()

    @torch.no_grad()
    def load_weights(self, values: dict[str, torch.Tensor]) -> None:
        """For checkpoints: set every parameter to `values[name]` (shaped like the local shard)."""
        for name, param in self.model.named_parameters():
            param.copy_(values[name])

    @torch.no_grad()
    def reload_from_model(self) -> None:
        """Take the masters from the model's current weights again (after loading a checkpoint)."""
        self.master.copy_(self._flat_params()[self.lo:self.hi])
