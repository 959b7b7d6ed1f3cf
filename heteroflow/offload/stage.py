"""`StageOffload`: what one rank of a pipeline stage builds from its `OffloadPolicy`; the runtime's one entry point.

    offload = StageOffload(policy, device=device, blocks=stage_blocks, other_params={"head": [...]},
                           weight_decay=train.weight_decay, checkpoint_dirs=[ckpt_dir])
    for step in range(steps):
        for micro_batch in ...:
            with offload.activation_context():
                loss = stage_forward(micro_batch)          # hooks fetch / release block parameters
            loss.backward()                                # block gradients leave as they are produced
        offload.collect_grads()                            # any gradient the hooks did not take
        norms = offload.grad_norms(); ...all-reduce...; offload.scale_grads(coef)   # or clip_grad_norm_
        offload.step(lr)                                   # streamed AdamW; parameters updated in place / in their tier
    offload.close()                                        # also on failure: use it as a context manager

`decays(param)` picks the parameters weight decay applies to (default: all). `swap_label` names the rank in
its swap directory's name (the runtime passes its stage, dp, cp and tp indices). `owned` (ZeRO 1/2): the part
of each group whose optimizer state this rank keeps (`StreamedAdamW`).

Groups: block i is `block{i}` (parameters in `block.parameters()` order), then each `other_params`
group in the order given. Use the same order for a reference optimizer to compare bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from heteroflow.devices import Device
from heteroflow.offload.activations import activation_context
from heteroflow.offload.budget import DeviceBudget
from heteroflow.offload.optimizer import StreamedAdamW
from heteroflow.offload.params import OffloadedParams
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.store import TieredStore
from heteroflow.offload.swap import SwapDir


class StageOffload:
    """Stores, streamed optimizer, parameter hooks and activation tier of one rank, per `policy`."""

    def __init__(self, policy: OffloadPolicy, *, device: Device, blocks: Sequence[nn.Module],
                 other_params: Mapping[str, Sequence[nn.Parameter]] | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 checkpoint_dirs: Iterable[str] = (), adam_impl: str | None = None,
                 budget: DeviceBudget | None = None, decays: Callable[[torch.Tensor], bool] | None = None,
                 swap_label: str = "", owned: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.policy, self.device = policy, device
        self.budget = budget if budget is not None else DeviceBudget(policy.device_budget_bytes)
        self.blocks = list(blocks)
        self.other_params = {k: list(v) for k, v in (other_params or {}).items()}
        self.block_names = [f"block{i}" for i in range(len(self.blocks))]
        assert not set(self.block_names) & set(self.other_params), "other_params may not be named block<i>"
        groups: dict[str, list[nn.Parameter]] = {n: list(b.parameters()) for n, b in zip(self.block_names, blocks)}
        groups.update(self.other_params)
        # Parameters that stay on the device: all of them, or those outside the blocks.
        self._resident = dict(groups) if policy.params == "device" else dict(self.other_params)
        self.swap: SwapDir | None = None
        self.param_store = self.opt_store = None
        self.params: OffloadedParams | None = None
        self._charged = 0
        self._grad_hooks: list = []
        try:
            if policy.uses_ssd:
                assert policy.swap_root is not None
                self.swap = SwapDir(policy.swap_root, checkpoint_dirs=checkpoint_dirs, label=swap_label)
                self.swap.check_free(self._swap_bytes(groups, owned or {}))  # before anything is written
            # Separate staging pools: parameter fetches and optimizer chunks differ in size and rhythm.
            self.param_store = TieredStore(device=device, budget=self.budget, swap=self.swap,
                                           max_in_flight=policy.max_in_flight)
            self.opt_store = TieredStore(device=device, budget=self.budget, swap=self.swap,
                                         max_in_flight=policy.max_in_flight)
            resident_bytes = sum(p.numel() * p.element_size() for ps in self._resident.values() for p in ps)
            self.budget.charge(resident_bytes, "params")
            self._charged = resident_bytes
            self.optimizer = StreamedAdamW(groups, store=self.opt_store, tier=policy.optimizer, betas=betas, eps=eps,
                                           weight_decay=weight_decay, chunk_numel=policy.chunk_numel,
                                           param_store=self.param_store, impl=adam_impl, decays=decays,
                                           owned=owned)
            # A resident parameter's gradient leaves for the optimizer tier (fp32) as soon as autograd has it:
            # the device holds one parameter's `.grad` at a time, never the stage's.
            self._grad_hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, group, j))
                                for group, ps in self._resident.items() for j, p in enumerate(ps)]
            if policy.params != "device":
                self.params = OffloadedParams(blocks, store=self.param_store, tier=policy.params,
                                              names=self.block_names,
                                              grad_sink=self.optimizer.add_grads)
        except BaseException:
            self.close()
            raise

    def _swap_bytes(self, groups: Mapping[str, Sequence[nn.Parameter]], owned: Mapping[str, tuple[int, int]]) -> int:
        """Upper bound of the swap files this policy writes (optimizer state: the `owned` part of each group)."""
        total = 0
        for name, ps in groups.items():
            numel = sum(p.numel() for p in ps)
            if self.policy.optimizer == "ssd":
                held = owned[name][1] - owned[name][0] if name in owned else numel
                total += 12 * held + 3 * 8192 * (held // self.policy.chunk_numel + 1)
            if self.policy.params == "ssd" and name in self.block_names:
                total += sum(p.numel() * p.element_size() for p in ps) + 8192
        return total

    @property
    def which(self) -> dict[str, str]:
        """Which I/O and Adam paths run (for logs)."""
        out = {"adam": self.optimizer.which}
        for store in (self.param_store, self.opt_store):
            if store is not None and store._engine is not None:
                out["io"] = store._engine.which
        return out

    def activation_context(self) -> contextlib.AbstractContextManager:
        """Wrap each micro-batch's forward: saved activations go to the policy's activation tier."""
        return activation_context(self.policy.activations, self.device)

    def _grad_ready(self, group: str, index: int, param: nn.Parameter) -> None:
        """Autograd accumulated a backward's gradient of a resident parameter: add it to the optimizer tier."""
        nbytes = param.grad.numel() * param.grad.element_size()
        self.budget.charge(nbytes, "grads")
        try:
            with torch.no_grad():
                self.optimizer.add_grad(group, index, param.grad)
            param.grad = None
        finally:
            self.budget.release(nbytes, "grads")

    def collect_grads(self) -> None:
        """Hand any `.grad` left on a device-resident parameter (produced outside the hooks) to the optimizer."""
        for group, ps in self._resident.items():
            for j, p in enumerate(ps):
                if p.grad is not None:
                    self._grad_ready(group, j, p)

    def grad_norms(self) -> list[torch.Tensor]:
        """Per-parameter gradient norms (call after `collect_grads`)."""
        return self.optimizer.grad_norms()

    def scale_grads(self, coef: torch.Tensor | float) -> None:
        """Scale every gradient (global clipping across stages)."""
        self.optimizer.scale_grads(coef)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients like `torch.nn.utils.clip_grad_norm_` (call after `collect_grads`)."""
        return self.optimizer.clip_grad_norm_(max_norm)

    def step(self, lr: float) -> None:
        """One AdamW step; parameters are updated on the device or in their tier."""
        # Parameter writes may still be in flight: the store orders a later read of a chunk after them.
        self.optimizer.step(lr)

    def close(self) -> None:
        """Remove hooks, free device memory, delete swap files and the swap directory."""
        try:
            for handle in self._grad_hooks:
                handle.remove()
            self._grad_hooks = []
            if self.params is not None:
                self.params.close()
            if getattr(self, "optimizer", None) is not None:
                self.optimizer.close()
            for store in (self.param_store, self.opt_store):
                if store is not None:
                    store.close()
            if self._charged:
                self.budget.release(self._charged, "params")
                self._charged = 0
        finally:
            if self.swap is not None:
                self.swap.remove()

    def __enter__(self) -> StageOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
