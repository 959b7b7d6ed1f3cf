"""`OffloadedAdamW`: the optimizer of a stage whose plan offloads optimizer state or parameters.

Per stage (`StageSpec.offload`):
- `optimizer: cpu|ssd` or `params: cpu|ssd`: the stage's ranks use `OffloadedAdamW` instead of
  `DataParallelAdamW`. Both are a `heteroflow.optim.StageOptimizer` (`reduce_grads`, `grad_sq_norm_share`,
  `step`, `zero_grad`, the checkpoint calls), so the worker's loop, the tied-embedding sync and the global
  clipping stay as they are: `StageOffload` underneath keeps the fp32 master weights and Adam moments in
  the optimizer tier and, with `params` off the device, fetches each Transformer block's parameters ahead
  of use and releases them after (embedding, final norm and head stay on the device: they are used at the
  two ends only). With tp > 1 every tp rank does this for its own shards: the blocks are tp-sharded before
  they go to the tier, so a rank stores, fetches and updates only its local slices;
- `activations: cpu`: the saved activations of the stage's forward (with `recompute: full`, exactly the
  checkpointed block inputs) live in host memory (the runtime's pipeline wraps the forward in
  `heteroflow.offload.activations.activation_context`); alone, it keeps `DataParallelAdamW` (and ZeRO).

Gradient arithmetic is the same as `DataParallelAdamW`'s: micro-batch gradients accumulated in fp32 (here
on the host, block by block as the backward produces them), partial gradients summed over tp (those of
offloaded blocks in their host buffers, after the last micro-batch), then summed over the stage's dp group,
counted once in the global norm (tp-replicated values on tp rank 0,
dp replicas on dp rank 0, the head copy of a tied embedding on the first stage), AdamW with decay on
matrices only (`heteroflow.optim.adamw_step` under both).

ZeRO 1 and 2 (ZeRO-Offload): the stage's flat parameter buffer is cut over dp as `DataParallelAdamW` cuts it
(`layout.shards.zero_flat_range`); the host gradients are reduce-scattered over dp, each dp rank keeps and
updates the fp32 master weights and moments of its `[lo, hi)` only, in its tier (1/dp of the state per rank),
sends its updated values to the device and all-gathers the rest from the other dp ranks there, in the
parameters' dtype. ZeRO 1 and 2 run alike (as on the device): every rank accumulates the whole gradient.

In fp32 with `HETEROFLOW_CPU_ADAM=torch` a plan trains bit for bit as without offload (with the same ZeRO
stage); with DeepSpeedCPUAdam within 1e-6 relative.

Checkpoints (`heteroflow.checkpoint.stage_state`) see the same data as with `DataParallelAdamW`: the
parameter values (offloaded blocks read back from their tier) and the fp32 master weights and moments,
chunk by chunk from the optimizer tier, in the layout-independent format; loading writes them back into
the tiers. So a run can resume with or without offload, under any plan.

ZeRO 1/2 with offloaded parameters is not a layout (`ParallelLayout.validate`: parameters are sharded and
offloaded together under ZeRO-3); ZeRO-3 with offloaded state runs as `heteroflow.offload.zero3`.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from heteroflow.config import StageSpec
from heteroflow.devices import Device
from heteroflow.layout.shards import counted_once, zero_flat_range
from heteroflow.models.data_parallel import all_reduce_partial_grads
from heteroflow.models.llama import StageModel
from heteroflow.models.shard import set_shard, shard_of
from heteroflow.models.tp_ops import _ALL_GATHER, _REDUCE_SCATTER
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.stage import StageOffload
from heteroflow.optim import StateView

_HOST_REDUCE_CHUNK_NUMEL = 1 << 24
"""fp32 elements per device round trip when a host gradient is summed over a dp group without CPU support."""


def offloads_state(stage: StageSpec) -> bool:
    """Whether the stage's optimizer state or parameters leave the device (then `OffloadedAdamW` runs it, or
    `offload.zero3.Zero3OffloadAdamW` under ZeRO-3)."""
    return stage.layout.offload.moves_state


class OffloadedAdamW:
    """AdamW of one rank of a stage with offloaded optimizer state and/or parameters (a
    `heteroflow.optim.StageOptimizer`); see the module docstring.

    Build it on a model whose values are initialized (or loaded). With `params` offloaded, build the model
    on the CPU: the blocks go to their tier from there and only the embedding, final norm and head are
    moved to the device.
    """

    def __init__(self, model: StageModel, *, policy: OffloadPolicy, device: Device, dp_group: dist.ProcessGroup | None,
                 tp_group: dist.ProcessGroup | None, betas: tuple[float, float], eps: float, weight_decay: float,
                 checkpoint_dirs: list[str] = (), swap_label: str = "", zero: int = 0) -> None:
        assert zero in (0, 1, 2) and not (zero and policy.params != "device"), "ParallelLayout.validate refuses it"
        self.model, self.policy, self.device = model, policy, device
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.zero = zero
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        blocks = list(model.layers.values())
        in_block = {id(p): (i, j) for i, b in enumerate(blocks) for j, p in enumerate(b.parameters())}
        rest = [p for _, p in model.named_parameters() if id(p) not in in_block]
        rest_index = {id(p): j for j, p in enumerate(rest)}
        for p in model.parameters():
            set_shard(p, shard_of(p))  # offloaded blocks become placeholders: keep their shapes on record
        # DataParallelAdamW's flat buffer: parameters in named_parameters order, cut over dp under ZeRO.
        self._places: list[tuple[nn.Parameter, str, int, int]] = []
        """Per parameter in named_parameters order: (param, group, index in the group, offset in the flat buffer)."""
        offset = 0
        for _, p in model.named_parameters():
            group, index = (f"block{in_block[id(p)][0]}", in_block[id(p)][1]) if id(p) in in_block \
                else ("rest", rest_index[id(p)])
            self._places.append((p, group, index, offset))
            offset += p.numel()
        self.lo, self.hi, self.padded = zero_flat_range(offset, dp=self.dp, dp_rank=self.dp_rank, zero=zero)
        # Norm shares in named_parameters order and with DataParallelAdamW's rule (the owned part of each
        # parameter, each value counted once), so the global norm is summed in the same order as without offload.
        head_copy = set(model.tied_parameter_names()) if model.is_last else set()
        self._counted: list[tuple[str, int, int, int]] = []
        for (name, _), (p, group, index, start) in zip(model.named_parameters(), self._places):
            part = self._owned(p, start)
            if part is not None and counted_once(split_over_tp=shard_of(p).dim is not None, tp_rank=tp_rank,
                                                 dp_rank=self.dp_rank, split_over_dp=bool(zero),
                                                 tied_head_copy=name in head_copy):
                self._counted.append((group, index, *part))
        self._where = {id(p): (group, index) for p, group, index, _ in self._places}
        self.offload = StageOffload(policy, device=device, blocks=blocks, other_params={"rest": rest} if rest else {},
                                    betas=betas, eps=eps, weight_decay=weight_decay, checkpoint_dirs=checkpoint_dirs,
                                    decays=lambda p: p.dim() >= 2, swap_label=swap_label,
                                    owned=self._owned_group_ranges())
        if policy.params != "device":
            for p in rest:  # built on the host with the blocks (now in their tier); this part lives on the device
                p.data = p.data.to(device.torch_device)

    def _owned(self, p: nn.Parameter, start: int) -> tuple[int, int] | None:
        """The part `[a, b)` of the flattened `p` (at `start` in the flat buffer) inside this rank's `[lo, hi)`."""
        a, b = max(start, self.lo), min(start + p.numel(), self.hi)
        return (a - start, b - start) if a < b else None

    def _owned_group_ranges(self) -> dict[str, tuple[int, int]]:
        """Per optimizer group, the range of its flat parameters this rank keeps state for. One range each:
        a group's parameters keep their flat-buffer order, so what `[lo, hi)` cuts from them is contiguous."""
        ranges: dict[str, tuple[int, int]] = {}
        local: dict[str, int] = {}
        for p, group, _, start in self._places:
            at = local.get(group, 0)
            local[group] = at + p.numel()
            part = self._owned(p, start)
            if part is None:
                continue
            a, b = at + part[0], at + part[1]
            if group in ranges:
                assert ranges[group][1] == a, f"{group}: the owned part is not contiguous"
                a = ranges[group][0]
            ranges[group] = (a, b)
        return {group: ranges.get(group, (0, 0)) for group in local}

    # ---- the StageOptimizer interface ----------------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored from checkpoints)."""
        return self.offload.optimizer.step_count

    @steps.setter
    def steps(self, value: int) -> None:
        self.offload.optimizer.step_count = value

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum partial grads over tp, take the device gradients into the optimizer tier, sum over dp."""
        self.offload.collect_grads()
        all_reduce_partial_grads(self.model, self.tp_group, grad_of=self.grad_of)
        if self.dp > 1 and self.zero:
            self._reduce_scatter_grads()
        elif self.dp > 1:
            for flat in self.offload.optimizer.flat_grads().values():
                self._all_reduce(flat, self.dp_group)

    def _reduce_scatter_grads(self) -> None:
        """Sum the host gradients over dp into this rank's `[lo, hi)` (in the group buffers' owned parts; the
        rest of them is left unsummed and unused)."""
        optimizer = self.offload.optimizer
        optimizer.flat_grads()  # a group without gradients this step reads as zeros
        views = {group: optimizer.grad_views(group) for group in optimizer.groups}
        flat = torch.zeros(self.padded, dtype=torch.float32)
        for p, group, index, start in self._places:
            flat[start:start + p.numel()].copy_(views[group][index].reshape(-1))
        shard = self._reduce_scatter(flat)
        for p, group, index, start in self._places:
            part = self._owned(p, start)
            if part is not None:
                a, b = part
                views[group][index].view(-1)[a:b].copy_(shard[start + a - self.lo:start + b - self.lo])

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over dp of rows `[lo, hi)` of the host buffer `flat`, through the device when the backend
        needs it (in pieces of each dp rank's rows at once)."""
        shard = torch.empty(self.hi - self.lo, dtype=torch.float32)
        if dist.get_backend(self.dp_group) == "gloo":
            _REDUCE_SCATTER(shard, flat, group=self.dp_group)
            return shard
        rows, budget = flat.view(self.dp, -1), self.offload.budget
        for c in range(0, shard.numel(), _HOST_REDUCE_CHUNK_NUMEL // self.dp):
            part = rows[:, c:c + _HOST_REDUCE_CHUNK_NUMEL // self.dp]
            nbytes = 2 * part.numel() * part.element_size()
            budget.charge(nbytes, "grads")
            try:
                on_device = part.to(self.device.torch_device).reshape(-1)
                summed = torch.empty(part.shape[1], dtype=torch.float32, device=on_device.device)
                _REDUCE_SCATTER(summed, on_device, group=self.dp_group)
                shard[c:c + part.shape[1]].copy_(summed)
                del on_device, summed
            finally:
                budget.release(nbytes, "grads")
        return shard

    def _gather_updated(self) -> None:
        """All-gather over dp the updated weights (each rank's `[lo, hi)`, already in its device tensors) in
        the parameters' dtype, and write them into every parameter."""
        params = [p for p, *_ in self._places]
        dtype, where = params[0].dtype, params[0].device
        assert all(p.dtype == dtype for p in params), "one dtype per stage"
        shard = torch.zeros(self.hi - self.lo, dtype=dtype, device=where)
        for p, _, _, start in self._places:
            part = self._owned(p, start)
            if part is not None:
                shard[start + part[0] - self.lo:start + part[1] - self.lo].copy_(p.data.view(-1)[part[0]:part[1]])
        full = torch.empty(self.padded, dtype=dtype, device=where)
        _ALL_GATHER(full, shard, group=self.dp_group)
        for p, _, _, start in self._places:
            p.data.copy_(full[start:start + p.numel()].view_as(p))

    def _all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """Sum `flat` over `group`; host buffers go through the device when the backend needs it."""
        if flat.device.type != "cpu" or dist.get_backend(group) == "gloo":
            dist.all_reduce(flat, group=group)
            return
        budget = self.offload.budget
        for part in flat.split(_HOST_REDUCE_CHUNK_NUMEL):
            nbytes = part.numel() * part.element_size()
            budget.charge(nbytes, "grads")
            try:
                on_device = part.to(self.device.torch_device)
                dist.all_reduce(on_device, group=group)
                part.copy_(on_device)
                del on_device
            finally:
                budget.release(nbytes, "grads")

    @torch.no_grad()
    def grad_sq_norm_share(self) -> torch.Tensor:
        """This rank's part of the global squared gradient norm (each value counted once over the world)."""
        total = torch.zeros((), dtype=torch.float32)
        views = {}
        for group, index, a, b in self._counted:
            if group not in views:
                views[group] = self.offload.optimizer.grad_views(group)
            total += views[group][index].reshape(-1)[a:b].pow(2).sum()
        return total

    @torch.no_grad()
    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step (gradients times `grad_scale`, the clip coefficient); parameters updated in their tier."""
        if grad_scale != 1.0:
            self.offload.scale_grads(grad_scale)
        self.offload.step(lr)
        if self.zero and self.dp > 1:
            self._gather_updated()

    def grad_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient accumulated for `param` in the optimizer tier (a writable view)."""
        self.offload.collect_grads()
        group, index = self._where[id(param)]
        self.offload.optimizer.flat_grads()  # zeros for a group no gradient has reached yet
        return self.offload.optimizer.grad_views(group)[index]

    def memory_bytes(self) -> dict[str, int]:
        """The most device bytes the offload bookkeeping (`DeviceBudget`) has held of parameters, gradients and
        optimizer state: resident parameters and fetched blocks, gradients on their way out, device-tier state."""
        peaks = self.offload.budget.peak_by_kind
        return {"params": peaks.get("params", 0), "grads": peaks.get("grads", 0),
                "optimizer": sum(v for k, v in peaks.items() if k not in ("params", "grads"))}

    def zero_grad(self) -> None:
        """Drop any gradient left on the model and what the offload path took of them (all consumed after
        a step; a skipped step must not carry them into the next one)."""
        for p in self.model.parameters():
            p.grad = None
        self.offload.optimizer.drop_grads()

    # ---- checkpoints (heteroflow.checkpoint.stage_state) ---------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, current value)` of every parameter, offloaded blocks read back from their tier (host copies)."""
        params = self.offload.params
        gathered: dict[int, torch.Tensor] = {}
        if params is not None:
            for i, block_params in enumerate(params.params):
                for p, value in zip(block_params, params.gather(i)):
                    gathered[id(p)] = value
        for name, p in self.model.named_parameters():
            yield name, gathered.get(id(p), p)

    @torch.no_grad()
    def load_weights(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set every parameter to `values[name]`: device-resident ones in place, offloaded blocks in their tier."""
        params = self.offload.params
        offloaded = {id(p) for block in params.params for p in block} if params is not None else set()
        names = {}
        for name, p in self.model.named_parameters():
            names[id(p)] = name
            if id(p) not in offloaded:
                p.copy_(values[name])
        if params is not None:
            store = self.offload.param_store
            for chunk, block in zip(params.names, params.params):
                flat = torch.cat([values[names[id(p)]].reshape(-1) for p in block])
                store.write_slice(chunk, 0, flat.to(store.layout(chunk).dtype))

    def state_views(self, *, writable: bool = False) -> Iterator[StateView]:
        """The fp32 master weights and moments, per parameter and chunk (`StreamedAdamW.state_views`)."""
        return self.offload.optimizer.state_views(writable=writable)

    # ---- offload specifics ---------------------------------------------------------------------

    def report(self) -> dict:
        """Budget and paths, for logs and tests."""
        budget, swap = self.offload.budget, self.offload.swap
        store = self.offload.opt_store
        return {"policy": self.policy.to_dict(), "limit_bytes": budget.limit_bytes, "peak_bytes": budget.peak_bytes,
                "peak_by_kind": dict(budget.peak_by_kind), "resident_bytes": budget.resident_bytes,
                "which": self.offload.which, "zero": self.zero,
                "optimizer_tier_bytes": sum(store.layout(name).nbytes for name in store.names()),
                "swap_dir": str(swap.path) if swap is not None else None}

    def describe(self) -> str:
        """One line for the log: tiers, which Adam and SSD paths run, the device budget, the swap directory."""
        which, budget, swap = self.offload.which, self.offload.budget, self.offload.swap
        tiers = ", ".join(f"{k}: {v}" for k, v in (("optimizer", self.policy.optimizer), ("params", self.policy.params),
                                                    ("activations", self.policy.activations)))
        limit = f"{budget.limit_bytes / 2**20:.1f} MiB" if budget.limit_bytes is not None else "unlimited"
        return (f"offload {{{tiers}}}: adam {which['adam']}, ssd io {which.get('io', 'unused')}, device budget "
                f"{limit}, swap {swap.path if swap is not None else 'none'}")

    def close(self) -> None:
        """Free the stores and delete the swap files (idempotent)."""
        self.offload.close()
