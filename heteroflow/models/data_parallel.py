"""Gradient reduction inside a stage and its AdamW step: dp all-reduce, or ZeRO-1/2, in Megatron's state layout.

Per optimizer step, after every micro-batch's backward (the runtime scales each loss by
1 / global tokens, so gradients are *summed* over micro-batches and dp ranks, never averaged):

    sync_tied_grads(model, group=tied_group, tp_rank=..., dp_rank=..., grad_of=opt.grad_of)  # tied across stages
    opt.reduce_grads()            # sum partial grads over tp, then sum over dp (reduce-scatter with ZeRO)
    share = opt.grad_sq_norm_share()      # all-reduce the shares over the world -> global norm^2
    opt.step(lr=..., grad_scale=clip_coef)
    opt.zero_grad()

The state is what `heteroflow.layout.state_bytes` prices for the stage's compute precision (read from the
parameters' dtype): the parameters live in one flat buffer of that dtype (the model's tensors become views
into it); each backward's gradient is added, as soon as autograd has accumulated it, into one flat fp32
gradient buffer (Megatron's `main_grad`; a post-accumulate-grad hook adds it and frees the parameter's own
`.grad`); the optimizer keeps an fp32 master copy (16-bit parameters only: fp32 parameters are their own
master) and the Adam moments. ZeRO stage 1 and 2 behave the same: the gradient buffer is reduce-scattered,
each dp rank keeps the master and moments of its 1/dp of the flat buffers only, updates that part of the
parameters and all-gathers the rest. Weight decay skips 1-D parameters (norm weights and biases), as
Megatron-LM does. The update itself is `heteroflow.optim.adamw_step` (torch's functional AdamW), the one
`OffloadedAdamW` runs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from heteroflow.layout.shards import counted_once, zero_flat_range
from heteroflow.layout.state import GRAD_REDUCE_BYTES, state_bytes
from heteroflow.models.shard import shard_of
from heteroflow.models.tp_ops import _ALL_GATHER, _REDUCE_SCATTER
from heteroflow.optim.adamw import adamw_step

PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The compute precision a parameter dtype stands for (the key of `heteroflow.layout.state_bytes`)."""


def param_grad(param: nn.Parameter) -> torch.Tensor:
    """`param.grad`, created as zeros when absent: a gradient accumulated by autograd, without an optimizer buffer."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def all_reduce_partial_grads(model: nn.Module, tp_group: ProcessGroup | None,
                             grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda p: p.grad) -> None:
    """Sum over tp the gradients marked `partial_grad` (norms under sp, q/k norms, replicated kv weights);
    `grad_of(param)` is where the parameter's accumulated gradient lives (None: it has none)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [g for p in model.parameters() if shard_of(p).partial_grad and (g := grad_of(p)) is not None]
    if grads:
        flat = torch.cat([g.flatten().float() for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def all_reduce_via_host(t: torch.Tensor, group: ProcessGroup) -> None:
    """Sum device tensor `t` over gloo group `group` in place through a host copy (pinned where the device has
    pinned memory): gloo takes no NPU tensors."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type != "cpu")
    host.copy_(t)
    dist.all_reduce(host, group=group)
    t.copy_(host)


@torch.no_grad()
def sync_tied_grads(model: nn.Module, *, group: ProcessGroup, tp_rank: int, dp_rank: int,
                    grad_of: Callable[[nn.Parameter], torch.Tensor] = param_grad, on_host: bool = False) -> None:
    """Sum the tied embedding's gradient (first stage) with the head copy's (last stage).

    Call on every rank of the first and the last stage, with `group` holding exactly those ranks,
    before `reduce_grads`; `grad_of(param)` is the writable tensor holding the parameter's accumulated
    gradient (the optimizer's `grad_of`). Afterwards dp rank 0 of each stage holds its slice of the total
    and the other dp ranks zeros, so the following dp sum leaves every rank of both stages with the total.
    Each stage may use its own tp and dp: the exchange goes through the full logical tensor. `on_host`: `group`
    is gloo on accelerator ranks, so the sum runs on a host copy (`all_reduce_via_host`).
    """
    for name in model.tied_parameter_names():
        param = model.get_parameter(name)
        shard = shard_of(param)
        grad = grad_of(param)
        full = torch.zeros(shard.full_shape, dtype=torch.float32, device=param.device)
        if counted_once(split_over_tp=shard.dim is not None, tp_rank=tp_rank):
            shard.take(full).copy_(grad)
        all_reduce_via_host(full, group) if on_host else dist.all_reduce(full, group=group)
        if dp_rank == 0:
            grad.copy_(shard.take(full))
        else:
            grad.zero_()


@dataclass(frozen=True, slots=True)
class _Segment:
    """Where a parameter sits in the flat buffers, and how it is treated."""

    param: nn.Parameter
    offset: int
    numel: int
    decay: bool
    counted: bool
    """Counts toward the global gradient norm on this rank (`layout.shards.counted_once`: tp-replicated
    values on tp rank 0, unsharded state on dp rank 0, an embedding tied across stages on the first stage)."""


class DataParallelAdamW:
    """AdamW over one stage's parameters in Megatron's state layout, gradients summed over `dp_group`
    (a `heteroflow.optim.StageOptimizer`); see the module docstring.

    zero=0: every dp rank keeps all masters and moments; zero=1 (or 2): each keeps 1/dp of them. `only`: the
    parameters it takes (all by default; `ExpertDataParallelAdamW` gives experts and the rest each their own).
    Build it after the weights are initialized or loaded and cast to the stage's compute dtype: the
    parameters move into the flat buffer and the masters start from their values.
    """

    def __init__(self, model: nn.Module, *, dp_group: ProcessGroup | None, tp_group: ProcessGroup | None = None,
                 zero: int = 0, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, only: Callable[[nn.Parameter], bool] | None = None):
        if zero not in (0, 1, 2):
            raise ValueError(f"DataParallelAdamW implements ZeRO 0, 1 and 2, not {zero}")
        self.model, self.dp_group, self.tp_group, self.only = model, dp_group, tp_group, only
        self.zero, self.betas, self.eps, self.weight_decay = zero, betas, eps, weight_decay
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        is_last = getattr(model, "is_last", False)
        head_copy = {n for n in getattr(model, "tied_parameter_names", tuple)() if is_last}
        self.segments: list[_Segment] = []
        offset = 0
        for name, param in model.named_parameters():
            if not param.requires_grad or (only is not None and not only(param)):
                continue
            counted = counted_once(split_over_tp=shard_of(param).dim is not None, tp_rank=tp_rank,
                                   dp_rank=self.dp_rank, split_over_dp=bool(zero), tied_head_copy=name in head_copy)
            self.segments.append(_Segment(param, offset, param.numel(), param.dim() >= 2, counted))
            offset += param.numel()
        self.numel = offset
        # With ZeRO this rank owns [lo, hi) of the flat buffers; without, all of them.
        self.lo, self.hi, self.padded = zero_flat_range(offset, dp=self.dp, dp_rank=self.dp_rank, zero=zero)
        dtype = self.segments[0].param.dtype if self.segments else torch.float32
        device = self.segments[0].param.device if self.segments else None
        self.state = state_bytes(PRECISION_OF_DTYPE[dtype])
        # The fp32 buffer is what `reduce_grads` sends: the planner prices the traffic at GRAD_REDUCE_BYTES.
        assert torch.finfo(dtype).bits == 8 * self.state.weights and self.state.grads == GRAD_REDUCE_BYTES == 4, (
            dtype, self.state)
        self.params = torch.zeros(self.padded, dtype=dtype, device=device)
        self.main_grad = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self._grads: dict[int, torch.Tensor] = {}
        for s in self.segments:
            view = self.params[s.offset:s.offset + s.numel].view_as(s.param)
            view.copy_(s.param.detach())
            s.param.data = view  # the model's tensor is now a view into the flat buffer
            self._grads[id(s.param)] = self.main_grad[s.offset:s.offset + s.numel].view_as(s.param)
            s.param.register_post_accumulate_grad_hook(self._accumulate)
        own = self.params[self.lo:self.hi]
        # fp32 parameters are the master (state.master == 0): the update runs on them in place.
        self.master = own.float().clone() if self.state.master else own
        self.exp_avg = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.grad: torch.Tensor | None = None
        self.steps = 0
        self._runs = self._owned_runs()

    def _accumulate(self, param: nn.Parameter) -> None:
        """Once autograd has accumulated a backward's gradient into `param.grad`: add it to the fp32 buffer."""
        with torch.no_grad():
            self._grads[id(param)].add_(param.grad)
        param.grad = None

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 gradient accumulated for `param` (a writable view of the gradient buffer)."""
        return self._grads[id(param)]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this rank's training state on the device: `params`, `grads` and `optimizer`."""
        optimizer = self.exp_avg.nbytes + self.exp_avg_sq.nbytes + (self.master.nbytes if self.state.master else 0)
        return {"params": self.params.nbytes, "grads": self.main_grad.nbytes, "optimizer": optimizer}

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
        """Sum partial grads over tp, then the gradient buffer over dp (this rank's shard of it with ZeRO)."""
        for s in self.segments:  # a gradient autograd left on a parameter outside the hooks counts too
            if s.param.grad is not None:
                self._accumulate(s.param)
        all_reduce_partial_grads(self.model, self.tp_group, grad_of=lambda p: self._grads.get(id(p)))
        if self.dp > 1 and self.zero:
            shard = torch.empty(self.hi - self.lo, dtype=torch.float32, device=self.main_grad.device)
            _REDUCE_SCATTER(shard, self.main_grad, group=self.dp_group)
            self.main_grad[self.lo:self.hi].copy_(shard)
        elif self.dp > 1:
            dist.all_reduce(self.main_grad, group=self.dp_group)
        self.grad = self.main_grad[self.lo:self.hi]

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
        then the new weights into the parameters (all-gathered from the dp ranks with ZeRO)."""
        assert self.grad is not None, "call reduce_grads() first"
        self.steps += 1
        grad = self.grad.mul_(grad_scale) if grad_scale != 1.0 else self.grad  # ours, read only here
        runs = [slice(a, b) for a, b, _ in self._runs]
        adamw_step([self.master[r] for r in runs], [grad[r] for r in runs], [self.exp_avg[r] for r in runs],
                   [self.exp_avg_sq[r] for r in runs], decays=[decay for _, _, decay in self._runs],
                   step=self.steps, lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        self.grad = None
        own = self.params[self.lo:self.hi]
        if self.state.master:
            own.copy_(self.master)
        if self.zero and self.dp > 1:
            _ALL_GATHER(self.params, own.clone(), group=self.dp_group)

    def zero_grad(self) -> None:
        """Zero the gradient buffer and drop any gradient left on the model (the next backward starts from zero)."""
        for s in self.segments:
            s.param.grad = None
        self.main_grad.zero_()
        self.grad = None

    def state_views(self, *, writable: bool = False):
        """For checkpoints: per parameter, the part of its fp32 state this rank keeps, as
        `(param, start, stop, {"master": t, "exp_avg": t, "exp_avg_sq": t})`; `[start, stop)` indexes the
        flattened local parameter and each `t` is a 1-D view of that range of the state. The views are the
        state itself; an fp32 master is the parameters, so unless `writable` (loading) it comes as a copy:
        a checkpoint file may not hold two tensors sharing memory."""
        for s in self.segments:
            part = self._owned(s)
            if part is not None:
                a, b = part
                start = a + self.lo - s.offset
                master = self.master[a:b] if writable or self.state.master else self.master[a:b].clone()
                yield s.param, start, start + b - a, {"master": master, "exp_avg": self.exp_avg[a:b],
                                                      "exp_avg_sq": self.exp_avg_sq[a:b]}

    def named_weights(self):
        """For checkpoints: `(name, tensor)` of every parameter's current value (the model's own tensors)."""
        return self.model.named_parameters()

    @torch.no_grad()
    def load_weights(self, values: dict[str, torch.Tensor]) -> None:
        """For checkpoints: set every parameter to `values[name]` (shaped like the local shard)."""
        for name, param in self.model.named_parameters():
            if self.only is None or self.only(param):
                param.copy_(values[name])
