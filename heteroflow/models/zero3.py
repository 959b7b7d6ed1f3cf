"""ZeRO-3 for one stage: FSDP2 (`fully_shard`) per decoder block over the stage's cp x dp group.

The runtime passes the stage's replica group (`ProcessGroups.replicas`: the cp x dp ranks of one tp rank, its
dp group when cp is 1) as `dp_group`: cp splits only the sequence, so its ranks hold replicas of the weights
whose gradients must be summed, like dp's; sharding over both (as Megatron's distributed optimizer does under
cp) lets one reduce-scatter sum over cp and dp at once. Below, "dp" stands for that group.

What runs, per rank of a stage with dp ranks (after `parallelize_stage` has cut the tp shards):
  * every parameter (its tp-local tensor) is split by rows over dp (FSDP2's `Shard(0)`): the rank keeps
    that 1/dp in fp32, and it *is* the master weight the AdamW step updates (`Zero3AdamW`);
  * forward: each block all-gathers its parameters in the stage's precision (`MixedPrecisionPolicy`
    `param_dtype`), prefetching the next block's, and frees them after the block ran; backward gathers
    them again (one block ahead) and reduce-scatters the block's gradients in fp32, summed (never
    averaged) over dp, into the fp32 gradient shard: after every micro-batch's backward, so no unsharded
    gradient outlives its block. The embedding and the LM head are units of their own; the final norm
    and learned positions stay with the root unit;
  * the AdamW step (`heteroflow.optim.adamw_step`) runs on the local shards only, and nothing is gathered
    after it: the next forward gathers the new values.

Why FSDP2 composes here: heteroflow's tensor parallelism works on plain tensors (`tp_ops`), so FSDP2 sees
each tp shard as an ordinary parameter and shards it again over dp; the tp collectives sit in hooks on the
attention and MLP submodules, which run inside the block's FSDP2 hooks (gathered before, freed after).
Under the 1F1B pipeline several micro-batches' forwards run before their backwards: FSDP2 frees the
gathered weights after each forward and gathers them again in backward, and accumulates the reduce-scattered
gradients of successive micro-batches in the sharded gradient; defaults (`reshard_after_forward`,
`requires_gradient_sync`, `reshard_after_backward` all on) give exactly that, so no manual switching is
needed. In bf16 / fp16 the gathered weights are in that dtype, so norms, embeddings and the residual stream
compute in it (as under torchtitan's FSDP2), where ZeRO 0-2 stages keep fp32 weights under autocast: the same
step, rounded differently. Written here rather than taken from FSDP2: the optimizer (torch's optimizers would
see DTensors, not the tp-local layout the checkpoints and the global norm are keyed on), the tp sum of partial
gradients and the tied-embedding exchange across stages, which work on the local shards.

With optimizer state or parameters offloaded (ZeRO-Infinity) the same sharding runs in the stage's precision
(`shards_on_host` for parameters off the device), with `heteroflow.offload.zero3.Zero3OffloadAdamW` as the
optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from heteroflow.devices.torch_support import fsdp2_for_zero3
from heteroflow.layout.shards import counted_once
from heteroflow.models.data_parallel import all_reduce_via_host
from heteroflow.models.shard import ParamShard, set_shard, shard_of
from heteroflow.optim.adamw import adamw_step


def shard_stage_zero3(model: nn.Module, *, dp_group: ProcessGroup, device_type: str,
                      param_dtype: torch.dtype | None, shards_on_host: bool = False,
                      swapped: bool = False) -> list[nn.Module]:
    """Apply FSDP2 to a parallelized, initialized `StageModel` in place: one unit per block, one for the
    embedding and one for the LM head (unless tied on this stage), the root for the rest. Returns the units in
    the order their forwards start: the root (which encloses the others) first.

    `param_dtype` is what the gathered weights are cast to (None: as stored); gradients are reduced in
    fp32 and summed over `dp_group`. `shards_on_host`: the shards live in host memory between uses (FSDP2's
    `CPUOffloadPolicy`: copied to the device for each all-gather, gradient shards copied back as reduced), in
    pinned memory on an accelerator unless `swapped` (the caller frees and reallocates their storage between
    steps, which pinned memory does not allow). Parameters keep their names and `ParamShard` records.
    A torch older than `devices.torch_support.ZERO3_TORCH` is a `UserError` saying so.
    """
    fsdp = fsdp2_for_zero3()
    shards = {name: shard_of(param) for name, param in model.named_parameters()}
    with unset_fake_temporarily():  # a dry run builds under FakeTensorMode; the mesh's rank table must be real
        mesh = DeviceMesh.from_group(dp_group, device_type)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    units: list[nn.Module] = list(blocks)
    tied_here = model.embed is not None and model.head is not None and model.head.weight is model.embed.weight
    if not tied_here:  # a parameter shared by two units cannot be sharded twice: then the root holds both
        units = [m for m in (model.embed, *blocks, model.head) if m is not None]
    offload = (fsdp.CPUOffloadPolicy(pin_memory=device_type != "cpu" and not swapped) if shards_on_host
               else fsdp.OffloadPolicy())
    for unit in units:
        fsdp.fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True, offload_policy=offload)
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True, offload_policy=offload)
    for unit, after in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([after])
    # Sum over dp (the runtime scales the loss by 1 / global tokens); SUM is also the one op every backend has.
    for unit in (*units, model):  # the setters act on one unit each, not recursively
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    for name, param in model.named_parameters():  # FSDP2 made new Parameters: the tp records go along
        set_shard(param, shards[name])
    return [model, *units]


def gathered_bytes(model: nn.Module) -> int:
    """Bytes FSDP2 holds gathered right now over every unit of `model`: the unsharded parameters of the units
    in use, and the all-gather buffers of prefetched units not yet copied out."""
    total, fsdp = 0, fsdp2_for_zero3()
    for module in model.modules():
        if not isinstance(module, fsdp.FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # private: FSDP2 exposes no census of its buffers
        if group is None:
            continue
        if group.is_unsharded:
            total += sum(p.unsharded_param.numel() * p.unsharded_param.element_size() for p in group.fsdp_params)
        elif group._all_gather_result is not None:
            buffer = group._all_gather_result.all_gather_output
            total += buffer.numel() * buffer.element_size()
    return total


@dataclass(frozen=True, slots=True)
class _Local:
    """One parameter as this rank keeps it: rows `[row_start, row_start + rows)` of its tp-local tensor."""

    name: str
    param: nn.Parameter
    """The FSDP2 parameter (a DTensor over dp; its shape is the tp-local shape)."""
    shard: ParamShard
    start: int
    """First element of this rank's range of the flattened tp-local tensor."""
    decay: bool
    counted: bool

    @property
    def data(self) -> torch.Tensor:
        """The fp32 local rows (1-D view, outside autograd): the parameter's storage and its master weight."""
        return self.param.to_local().detach().view(-1)

    @property
    def stop(self) -> int:
        return self.start + self.param.to_local().numel()


class Zero3AdamW:
    """AdamW over the fp32 parameter shards of a stage under `shard_stage_zero3` (a `StageOptimizer`).

    The shard is the master weight: no separate copy. Moments are kept for the shard only. Gradients arrive
    already reduce-scattered (summed over dp) from FSDP2; `reduce_grads` adds the tp sum of partial ones.
    """

    zero = 3

    def __init__(self, model: nn.Module, *, dp_group: ProcessGroup, tp_group: ProcessGroup | None = None,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):
        self.model, self.dp_group, self.tp_group = model, dp_group, tp_group
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.dp, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        head_copy = set(model.tied_parameter_names()) if model.is_last else set()
        self.locals: list[_Local] = []
        for name, param in model.named_parameters():
            shard = shard_of(param)
            rows = param.shape[0]
            row_numel = param.numel() // rows if rows else 0
            start = min(self.dp_rank * -(-rows // self.dp), rows) * row_numel  # FSDP2 splits rows as torch.chunk
            counted = counted_once(split_over_tp=shard.dim is not None, tp_rank=self.tp_rank, dp_rank=self.dp_rank,
                                   split_over_dp=True, tied_head_copy=name in head_copy)
            self.locals.append(_Local(name, param, shard, start, param.dim() >= 2, counted))
        self.grads: list[torch.Tensor] | None = None
        self._by_param = {id(p.param): p for p in self.locals}
        self._grad_bytes = 0
        self._init_state()

    def _init_state(self) -> None:
        """The Adam moments, next to the shards."""
        self.exp_avg = [torch.zeros_like(p.data) for p in self.locals]
        self.exp_avg_sq = [torch.zeros_like(p.data) for p in self.locals]
        self.steps = 0

    def _set_grad(self, p: _Local, values: torch.Tensor) -> None:
        """Overwrite this rank's gradient shard of `p` (none held: nothing to overwrite)."""
        if p.param.grad is not None:
            p.param.grad.to_local().view(-1).copy_(values)

    def _local_grad(self, p: _Local) -> torch.Tensor:
        grad = p.param.grad
        return torch.zeros_like(p.data) if grad is None else grad.to_local().view(-1)

    @torch.no_grad()
    def sync_tied_grads(self, group: ProcessGroup, *, on_host: bool = False) -> None:
        """`data_parallel.sync_tied_grads` for this stage: sum the tied embedding's gradient with the other end
        stage's through the full logical tensor. Here every rank's shard is already summed over dp, so each
        rank adds its own box (each box once over the stage) and takes its box of the total back. `on_host`: through
        a host copy (`group` is gloo on accelerator ranks)."""
        for name in self.model.tied_parameter_names():
            p = next(local for local in self.locals if local.name == name)
            full = torch.zeros(p.shard.full_shape, dtype=torch.float32, device=p.data.device)
            mine = p.shard.take(full).reshape(-1)[p.start:p.stop]  # tp-local box, then this rank's rows
            if counted_once(split_over_tp=p.shard.dim is not None, tp_rank=self.tp_rank):
                mine.copy_(self._local_grad(p))
            all_reduce_via_host(full, group) if on_host else dist.all_reduce(full, group=group)
            self._set_grad(p, p.shard.take(full).reshape(-1)[p.start:p.stop])

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's fp32 gradient shard of `param` (a writable view; zeros, not kept, before any backward)."""
        return self._local_grad(self._by_param[id(param)])

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this rank's training state: the fp32 parameter shards (the masters), the sharded gradients
        of the last step and the moments (the gathered window is measured by the device, not here)."""
        shards = self.shard_bytes()
        return {"params": shards["params"], "grads": self._grad_bytes, "optimizer": shards["optimizer"]}

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum the partial gradients over tp (dp was summed by FSDP2's reduce-scatter during backward)."""
        self.grads = [self._local_grad(p).float() for p in self.locals]
        self._grad_bytes = sum(g.numel() * g.element_size() for g in self.grads)
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return
        partial = [g for p, g in zip(self.locals, self.grads) if p.shard.partial_grad and g.numel()]
        if partial:  # every tp rank splits these tp-replicated tensors over dp alike: the same elements meet
            flat = torch.cat(partial)
            self._all_reduce(flat, self.tp_group)
            for g, part in zip(partial, flat.split([g.numel() for g in partial])):
                g.copy_(part)

    def _all_reduce(self, flat: torch.Tensor, group: ProcessGroup) -> None:
        """Sum `flat` over `group` in place."""
        dist.all_reduce(flat, group=group)

    @torch.no_grad()
    def grad_sq_norm_share(self) -> torch.Tensor:
        """This rank's part of the global squared gradient norm (each value counted once over the world)."""
        assert self.grads is not None, "call reduce_grads() first"
        total = torch.zeros((), dtype=torch.float32, device=self.grads[0].device if self.grads else None)
        for p, g in zip(self.locals, self.grads):
            if p.counted and g.numel():
                total += g.pow(2).sum()
        return total

    @torch.no_grad()
    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on the local fp32 shards, in place (the next forward gathers the new values)."""
        assert self.grads is not None, "call reduce_grads() first"
        self.steps += 1
        chosen = [i for i, p in enumerate(self.locals) if p.data.numel()]
        grads = [self.grads[i].mul_(grad_scale) if grad_scale != 1.0 else self.grads[i] for i in chosen]
        adamw_step([self.locals[i].data for i in chosen], grads, [self.exp_avg[i] for i in chosen],
                   [self.exp_avg_sq[i] for i in chosen], decays=[self.locals[i].decay for i in chosen],
                   step=self.steps, lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        self.grads = None

    def zero_grad(self) -> None:
        """Drop the sharded gradients (the next backward starts from zero)."""
        for p in self.locals:
            p.param.grad = None
        self.grads = None

    def state_views(self, *, writable: bool = False):
        """Per parameter, `(param, start, stop, {"master", "exp_avg", "exp_avg_sq"})` for this rank's range of the
        flattened tp-local tensor. The views are the state itself ("master" is the parameter shard)."""
        for p, m, v in zip(self.locals, self.exp_avg, self.exp_avg_sq):
            if p.data.numel():
                yield p.param, p.start, p.stop, {"master": p.data, "exp_avg": m, "exp_avg_sq": v}

    def named_weights(self):
        """`(name, tp-local value)` of every parameter, all-gathered over dp: a collective, every dp rank of the
        stage calls it (checkpoints do not: each rank writes its own range, `checkpoint.stage_state`)."""
        for p in self.locals:
            yield p.name, p.param.full_tensor()

    @torch.no_grad()
    def load_weights(self, values) -> None:
        """Set every parameter's shard from `values[name]` (shaped like the tp-local tensor)."""
        for p in self.locals:
            p.data.copy_(values[p.name].reshape(-1)[p.start:p.stop])

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameter shards (also the masters) and moments."""
        params = sum(p.data.numel() * p.data.element_size() for p in self.locals)
        moments = sum(t.numel() * t.element_size() for t in (*self.exp_avg, *self.exp_avg_sq))
        return {"params": params, "optimizer": moments}
