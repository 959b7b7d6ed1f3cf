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
matrices only (`heteroflow.optim.adamw_step` under both). In fp32 with `HETEROFLOW_CPU_ADAM=torch` a plan
trains bit for bit as without offload; with DeepSpeedCPUAdam within 1e-6 relative.

Checkpoints (`heteroflow.checkpoint.stage_state`) see the same data as with `DataParallelAdamW`: the
parameter values (offloaded blocks read back from their tier) and the fp32 master weights and moments,
chunk by chunk from the optimizer tier, in the layout-independent format; loading writes them back into
the tiers. So a run can resume with or without offload, under any plan.

Not run (refused with a `UserError` naming the stage, before launch by `check_offload_plan` and again when
the optimizer is built): ZeRO (`zero > 0`) together with an offloaded optimizer or offloaded parameters
(the offloaded state is not sharded over dp; it has left the device anyway).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from heteroflow.config import PlanSpec, StageSpec
from heteroflow.devices import Device
from heteroflow.errors import UserError
from heteroflow.layout.shards import counted_once
from heteroflow.models.data_parallel import all_reduce_partial_grads
from heteroflow.models.llama import StageModel
from heteroflow.models.shard import set_shard, shard_of
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.stage import StageOffload
from heteroflow.optim import StateView

_HOST_REDUCE_CHUNK_NUMEL = 1 << 24
"""fp32 elements per device round trip when a host gradient is summed over a dp group without CPU support."""


def offloads_state(stage: StageSpec) -> bool:
    """Whether the stage's optimizer state or parameters leave the device (then `OffloadedAdamW` runs it)."""
    return stage.layout.offload.optimizer != "device" or stage.layout.offload.params != "device"


def check_offload_plan(plan: PlanSpec) -> None:
    """Refuse, with the stage named, offload settings the runtime does not run."""
    for k, stage in enumerate(plan.stages):
        check_offload_stage(k, stage)


def check_offload_stage(k: int, stage: StageSpec) -> None:
    """Refuse what `check_offload_plan` refuses, for plan stage `k`."""
    tiers = ", ".join(f"{key}: {tier}" for key, tier in stage.layout.offload.to_dict().items())
    if offloads_state(stage) and stage.layout.zero:
        raise UserError(f"plan.stages[{k}]: zero {stage.layout.zero} together with offload {{{tiers}}} is not run: "
                        "offloaded optimizer state and parameters are not sharded over dp; use zero: 0 on this "
                        "stage (its state leaves the device anyway) or keep optimizer and params on the device")


class OffloadedAdamW:
    """AdamW of one rank of a stage with offloaded optimizer state and/or parameters (a
    `heteroflow.optim.StageOptimizer`); see the module docstring.

    Build it on a model whose values are initialized (or loaded). With `params` offloaded, build the model
    on the CPU: the blocks go to their tier from there and only the embedding, final norm and head are
    moved to the device.
    """

    zero = 0
    """Offloaded state is not sharded over dp (`check_offload_stage`): every dp rank keeps all of it."""

    def __init__(self, model: StageModel, *, policy: OffloadPolicy, device: Device, dp_group: dist.ProcessGroup | None,
                 tp_group: dist.ProcessGroup | None, betas: tuple[float, float], eps: float, weight_decay: float,
                 checkpoint_dirs: list[str] = (), swap_label: str = "") -> None:
        self.model, self.policy, self.device = model, policy, device
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        blocks = list(model.layers.values())
        in_block = {id(p): (i, j) for i, b in enumerate(blocks) for j, p in enumerate(b.parameters())}
        rest = [p for _, p in model.named_parameters() if id(p) not in in_block]
        for p in model.parameters():
            set_shard(p, shard_of(p))  # offloaded blocks become placeholders: keep their shapes on record
        # Norm shares in named_parameters order and with DataParallelAdamW's rule, so the global norm is
        # summed in the same order as without offload.
        head_copy = set(model.tied_parameter_names()) if model.is_last else set()
        self._counted: list[tuple[str, int]] = []
        rest_index = {id(p): j for j, p in enumerate(rest)}
        self._where = {id(p): (f"block{i}", j) for i, b in enumerate(blocks) for j, p in enumerate(b.parameters())}
        self._where.update({id(p): ("rest", j) for j, p in enumerate(rest)})
        for name, p in model.named_parameters():
            # dp replicas: every dp rank holds the same summed gradient, counted on dp rank 0 (no ZeRO here)
            if not counted_once(split_over_tp=shard_of(p).dim is not None, tp_rank=tp_rank, dp_rank=self.dp_rank,
                                tied_head_copy=name in head_copy):
                continue
            self._counted.append((f"block{in_block[id(p)][0]}", in_block[id(p)][1]) if id(p) in in_block
                                 else ("rest", rest_index[id(p)]))
        self.offload = StageOffload(policy, device=device, blocks=blocks, other_params={"rest": rest} if rest else {},
                                    betas=betas, eps=eps, weight_decay=weight_decay, checkpoint_dirs=checkpoint_dirs,
                                    decays=lambda p: p.dim() >= 2, swap_label=swap_label)
        if policy.params != "device":
            for p in rest:  # built on the host with the blocks (now in their tier); this part lives on the device
                p.data = p.data.to(device.torch_device)

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
        if self.dp > 1:
            for flat in self.offload.optimizer.flat_grads().values():
                self._all_reduce(flat, self.dp_group)

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
        for group, index in self._counted:
            if group not in views:
                views[group] = self.offload.optimizer.grad_views(group)
            total += views[group][index].reshape(-1).pow(2).sum()
        return total

    @torch.no_grad()
    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step (gradients times `grad_scale`, the clip coefficient); parameters updated in their tier."""
        if grad_scale != 1.0:
            self.offload.scale_grads(grad_scale)
        self.offload.step(lr)

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
        return {"policy": self.policy.to_dict(), "limit_bytes": budget.limit_bytes, "peak_bytes": budget.peak_bytes,
                "peak_by_kind": dict(budget.peak_by_kind), "resident_bytes": budget.resident_bytes,
                "which": self.offload.which,
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
