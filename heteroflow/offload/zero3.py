"""`Zero3OffloadAdamW`: ZeRO-3 with optimizer state and/or parameters offloaded (ZeRO-Infinity), one stage rank.

What runs, per rank of a ZeRO-3 stage whose `offload` moves optimizer state or parameters off the device:
- FSDP2 (`models.zero3.shard_stage_zero3`) splits every unit's tp-local parameters over the stage's cp x dp
  replicas, here in the stage's precision; it gathers them block by block ahead of use (the next block
  prefetched) and frees them after, and reduce-scatters the gradients in fp32, summed over cp x dp.
  With `params: cpu|ssd` its `CPUOffloadPolicy` keeps the shards in host memory: each all-gather copies the
  unit's shards to the device, each reduced gradient shard comes back to the host.
- `params: ssd` (`_ShardSwap`): between steps the host shards live in swap files (`TieredStore`, DeepSpeed's
  async_io). A unit's shards are read back just before its first forward of the step (with the next unit's,
  which FSDP2 prefetches then, and the one after that already being read), and all are written out and freed
  after the step. Written here because FSDP2 has no disk tier: its all-gather reads the shard tensors in
  memory, so the swap moves their storage under it.
- The optimizer: `StreamedAdamW` over the shards, one group per FSDP2 unit: the fp32 master weights and Adam
  moments in the optimizer tier (device, cpu or ssd, streamed chunk by chunk) and an fp32 gradient
  accumulator on the host. Each gradient shard leaves the device as soon as FSDP2 has reduced it (FSDP2 calls
  the sharded parameter's post-accumulate-grad hooks after every reduce-scatter), so no gradient shard stays
  on the device. After the update the master is written into the shards, cast to the stage's precision.
  Not torch's optimizers on FSDP2's DTensors, for `Zero3AdamW`'s reasons (tp-local checkpoint ranges and
  norms) and because they have no ssd tier.

The gradient arithmetic (tp sum of partial gradients, counted-once norm shares, the tied embedding's sum
across stages, decay on matrices only) is `Zero3AdamW`'s; only where gradients and state live differs.
Checkpoints see the fp32 master and moments of each rank's range, as under `Zero3AdamW`, in the
layout-independent format, so a run resumes under any other plan.
"""

from __future__ import annotations

import functools
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from heteroflow.devices import Device
from heteroflow.models.zero3 import Zero3AdamW, _Local
from heteroflow.offload.budget import DeviceBudget
from heteroflow.offload.optimizer import StreamedAdamW
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.store import TieredStore
from heteroflow.offload.swap import SwapDir


def fsdp_params(unit: nn.Module) -> list:
    """The FSDP2 parameter records a unit owns itself (not its sub-units'); empty for a unit without any."""
    group = unit._get_fsdp_state()._fsdp_param_group  # private: FSDP2 names no public owner of a parameter
    return list(group.fsdp_params) if group is not None else []


class _ShardSwap:
    """The units' host shards in swap files between steps (`params: ssd`); see the module docstring."""

    def __init__(self, units: list[nn.Module], *, store: TieredStore) -> None:
        self.store = store
        self.units = [[fp for fp in fsdp_params(unit)] for unit in units]
        for u, records in enumerate(self.units):
            if records:
                store.add(f"shard/{u}", [fp._sharded_param_data for fp in records], "ssd")
        self.resident = [True] * len(units)
        # Before FSDP2's own pre-forward (prepend): it all-gathers this unit and starts the next one's gather.
        self.hooks = [unit.register_forward_pre_hook(functools.partial(self._before, u), prepend=True)
                      for u, unit in enumerate(units)]

    def _before(self, u: int, module: nn.Module, args: object) -> None:
        self.load(u)
        if u + 1 < len(self.units):
            self.load(u + 1)
        if u + 2 < len(self.units) and not self.resident[u + 2] and self.units[u + 2]:
            self.store.prefetch(f"shard/{u + 2}", to="host")

    def load(self, u: int) -> None:
        """Read unit `u`'s shards back into FSDP2's storage (a no-op when they are there)."""
        if self.resident[u]:
            return
        records = self.units[u]
        host = self.store.host(f"shard/{u}")
        for fp, part in zip(records, self.store.unflatten(f"shard/{u}", host)):
            data = fp._sharded_param_data
            data.untyped_storage().resize_(data.numel() * data.element_size())
            data.copy_(part.view(-1))
        self.store.release(f"shard/{u}")
        self.resident[u] = True

    def load_all(self) -> None:
        """Every unit's shards in memory (the step and checkpoints read them all)."""
        for u in range(len(self.units)):
            self.load(u)

    def stash(self) -> None:
        """Write every resident unit's shards to its swap file and free their host memory."""
        for u, records in enumerate(self.units):
            if not self.resident[u] or not records:
                continue
            self.store.write_slice(f"shard/{u}", 0, torch.cat([fp._sharded_param_data for fp in records]))
            for fp in records:
                fp._sharded_param_data.untyped_storage().resize_(0)
            self.resident[u] = False

    def close(self) -> None:
        """Remove the hooks; the shards come back into memory (the model stays usable)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        self.load_all()


class Zero3OffloadAdamW(Zero3AdamW):
    """AdamW of one rank of a ZeRO-3 stage with offloaded state (a `StageOptimizer`); see the module docstring.

    Build it right after `shard_stage_zero3(..., shards_on_host=policy.params != "device", swapped=policy.params ==
    "ssd")` on the model in the stage's precision; `units` are the units that call returns.
    """

    def __init__(self, model: nn.Module, *, units: list[nn.Module], policy: OffloadPolicy, device: Device,
                 dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None = None,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 checkpoint_dirs: Iterable[str] = (), swap_label: str = "") -> None:
        self.policy, self.device, self.units = policy, device, units
        self.budget = DeviceBudget(policy.device_budget_bytes)
        self.swap: SwapDir | None = None
        self.stores: list[TieredStore] = []
        self.adam: StreamedAdamW | None = None
        self.shards: _ShardSwap | None = None
        self._hooks: list = []
        self._checkpoint_dirs, self._swap_label = list(checkpoint_dirs), swap_label
        super().__init__(model, dp_group=dp_group, tp_group=tp_group, betas=betas, eps=eps,
                         weight_decay=weight_decay)

    def _init_state(self) -> None:
        """Stores, the streamed optimizer over one group per unit, the gradient hooks and the shard swap."""
        try:
            views = {id(p.param): p.data for p in self.locals}  # fixed views: the optimizer writes through them
            groups: dict[str, list[torch.Tensor]] = {}
            self._where: dict[int, tuple[str, int]] = {}
            self._by_view: dict[int, _Local] = {}
            for u, unit in enumerate(self.units):
                members = [self._by_param[id(fp.sharded_param)] for fp in fsdp_params(unit)]
                if members:
                    groups[f"unit{u}"] = [views[id(p.param)] for p in members]
                    for j, p in enumerate(members):
                        self._where[id(p.param)] = (f"unit{u}", j)
                        self._by_view[id(views[id(p.param)])] = p
            if self.policy.uses_ssd:
                assert self.policy.swap_root is not None
                self.swap = SwapDir(self.policy.swap_root, checkpoint_dirs=self._checkpoint_dirs,
                                    label=self._swap_label)
                self.swap.check_free(self._swap_bytes())
            opt_store = self._store()
            decays = {id(views[id(p.param)]): p.decay for p in self.locals}
            self.adam = StreamedAdamW(groups, store=opt_store, tier=self.policy.optimizer, betas=self.betas,
                                      eps=self.eps, weight_decay=self.weight_decay, chunk_numel=self.policy.chunk_numel,
                                      decays=lambda t: decays[id(t)])
            self._hooks = [p.param.register_post_accumulate_grad_hook(self._grad_ready) for p in self.locals]
            if self.policy.params == "ssd":
                self.shards = _ShardSwap(self.units, store=self._store())
        except BaseException:
            self.close()
            raise

    def _store(self) -> TieredStore:
        store = TieredStore(device=self.device, budget=self.budget, swap=self.swap,
                            max_in_flight=self.policy.max_in_flight)
        self.stores.append(store)
        return store

    def _swap_bytes(self) -> int:
        """Upper bound of the swap files: 12 bytes of fp32 state per shard element, the shards themselves."""
        numel = sum(p.data.numel() for p in self.locals)
        total = 0
        if self.policy.optimizer == "ssd":
            total += 12 * numel + 3 * 8192 * (numel // self.policy.chunk_numel + 1 + len(self.units))
        if self.policy.params == "ssd":
            total += sum(p.data.numel() * p.data.element_size() for p in self.locals) + 8192 * len(self.units)
        return total

    # ---- gradients: on the host as FSDP2 reduces them ------------------------------------------

    def _grad_ready(self, param: nn.Parameter) -> None:
        group, index = self._where[id(param)]
        self.adam.add_grad(group, index, param.grad.to_local())
        param.grad = None  # the device keeps no gradient shard

    def _local_grad(self, p: _Local) -> torch.Tensor:
        self.adam.flat_grads()  # a group no gradient reached yet reads as zeros
        group, index = self._where[id(p.param)]
        return self.adam.grad_views(group)[index].view(-1)

    def _set_grad(self, p: _Local, values: torch.Tensor) -> None:
        self._local_grad(p).copy_(values)

    def _all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Sum a host gradient buffer over `group`, through the device when the backend cannot reduce host memory."""
        if dist.get_backend(group) == "gloo":
            dist.all_reduce(flat, group=group)
            return
        on_device = flat.to(self.device.torch_device)
        dist.all_reduce(on_device, group=group)
        flat.copy_(on_device)

    # ---- the step ------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored from checkpoints)."""
        return self.adam.step_count if self.adam is not None else 0

    @steps.setter
    def steps(self, value: int) -> None:
        self.adam.step_count = value

    @torch.no_grad()
    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step in the optimizer tier; the updated values are written into the shards."""
        assert self.grads is not None, "call reduce_grads() first"
        if self.shards is not None:
            self.shards.load_all()
        if grad_scale != 1.0:
            self.adam.scale_grads(grad_scale)
        self.adam.step(lr)
        self.grads = None

    def zero_grad(self) -> None:
        """Drop the gradients; with `params: ssd` the shards go back to their swap files until the next forward."""
        for p in self.locals:
            p.param.grad = None
        self.adam.drop_grads()
        self.grads = None
        if self.shards is not None:
            self.shards.stash()

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_views(self, *, writable: bool = False) -> Iterator:
        """`Zero3AdamW.state_views` from the optimizer tier, chunk by chunk (`StreamedAdamW.state_views`)."""
        for view, start, stop, kinds in self.adam.state_views(writable=writable):
            p = self._by_view[id(view)]
            yield p.param, p.start + start, p.start + stop, kinds

    def named_weights(self):
        """`Zero3AdamW.named_weights`, the shards read back from their swap files first."""
        if self.shards is not None:
            self.shards.load_all()
        return super().named_weights()

    @torch.no_grad()
    def load_weights(self, values) -> None:
        """Set every shard (in the stage's precision; the checkpoint's masters follow through `state_views`)."""
        if self.shards is not None:
            self.shards.load_all()
        super().load_weights(values)

    # ---- memory and reports --------------------------------------------------------------------

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameter shards (in the parameter tier) and optimizer state
        (master and moments, in the optimizer tier)."""
        params = sum(p.data.numel() * p.data.element_size() for p in self.locals)
        return {"params": params, "optimizer": self._tier_bytes()}

    def _tier_bytes(self) -> int:
        store = self.stores[0]
        return sum(store.layout(name).nbytes for name in store.names())

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes of the training state between uses: the shards with `params: device`, the optimizer
        state with `optimizer: device`; gradient shards leave as they are made (the gathered window is measured
        by the device, not here)."""
        shards = self.shard_bytes()
        return {"params": shards["params"] if self.policy.params == "device" else 0, "grads": 0,
                "optimizer": shards["optimizer"] if self.policy.optimizer == "device" else 0}

    def report(self) -> dict:
        """Tiers and bytes, for logs and tests."""
        shards = self.shard_bytes()
        return {"policy": self.policy.to_dict(), "zero": 3, "which": {"adam": self.adam.which},
                "optimizer_tier_bytes": shards["optimizer"], "param_tier_bytes": shards["params"],
                "device_bytes": self.memory_bytes(), "limit_bytes": self.budget.limit_bytes,
                "peak_bytes": self.budget.peak_bytes,
                "peak_by_kind": dict(self.budget.peak_by_kind), "resident_bytes": self.budget.resident_bytes,
                "swap_dir": str(self.swap.path) if self.swap is not None else None,
                "param_swap_bytes_read": self.shards.store.stats.bytes_read if self.shards is not None else 0}

    def describe(self) -> str:
        """One line for the log: tiers, the Adam that runs, the swap directory."""
        return (f"zero 3 offload {{optimizer: {self.policy.optimizer}, params: {self.policy.params}}}: FSDP2 shards "
                f"{'in host memory' if self.policy.params != 'device' else 'on the device'}, adam {self.adam.which}, "
                f"swap {self.swap.path if self.swap is not None else 'none'}")

    def close(self) -> None:
        """Remove the hooks, free the stores and delete the swap files (idempotent)."""
        try:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            if self.shards is not None:
                self.shards.close()
                self.shards = None
            if self.adam is not None:
                self.adam.close()
            for store in self.stores:
                store.close()
            self.stores = []
        finally:
            if self.swap is not None:
                self.swap.remove()
                self.swap = None
