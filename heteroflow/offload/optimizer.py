"""`StreamedAdamW`: AdamW whose fp32 master weights and moments live on device, cpu or ssd.

Parameters are registered in *groups* (one per Transformer block, plus embeddings and head). Each
group's parameters, flattened in order, are cut into chunks of `chunk_numel` elements; one store
chunk holds `[master | exp_avg | exp_avg_sq]` of one piece (fp32). `step()` streams them:

    read chunk k+1 (SSD -> pinned CPU)  |  update chunk k on the CPU  |  write chunk k-1 (CPU -> SSD)

and after each update sends the new parameter values (cast to the model dtype) to the device
tensors or to the parameter tier. Gradients (fp32 or low precision) are accumulated on the host in
fp32, per group, by `add_grads`; clipping works on those (`clip_grad_norm_`).

The update is DeepSpeedCPUAdam's vectorized op when it builds (`adamw_mode=True`, bias correction on:
the same decoupled-weight-decay AdamW as torch's, rounded slightly differently: its bias corrections are
fp32 and it multiplies by 1/sqrt(1 - beta2^t) where torch divides), or else torch's own AdamW kernel
applied per parameter through `heteroflow.optim.adamw_step` (the update `DataParallelAdamW` runs), which
is bit-identical to `torch.optim.AdamW` on the CPU. `which` says which runs.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from heteroflow.errors import UserError
from heteroflow.offload.aio import log_once
from heteroflow.offload.ops import load_deepspeed_op
from heteroflow.offload.store import TieredStore
from heteroflow.optim.adamw import adamw_step

ADAM_ENV = "HETEROFLOW_CPU_ADAM"
"""`auto` (default: DeepSpeedCPUAdam when it builds, else torch), `torch` (bit-identical to torch.optim.AdamW),
`deepspeed` (fail if the op cannot load). The device tier always uses torch's kernel."""
DEFAULT_CHUNK_NUMEL = 1 << 22  # 4 Mi elements: 48 MiB of fp32 state per chunk
_opt_ids = itertools.count(1000)  # DeepSpeed keys its C++ optimizer objects by a process-wide id


@dataclass(frozen=True, slots=True)
class _Piece:
    """Elements `[start, start + numel)` of one group's flat parameters: one store chunk."""

    group: str
    index: int
    start: int
    numel: int

    @property
    def name(self) -> str:
        return f"adam/{self.group}/{self.index}"


_ds_adam: tuple[Any, str] | None = None


def deepspeed_cpu_adam_module() -> tuple[Any, str]:
    """DeepSpeed's cpu_adam op loaded (JIT-built the first time), or None and why it is unavailable."""
    global _ds_adam
    if _ds_adam is None:
        _ds_adam = load_deepspeed_op("CPUAdamBuilder")
    return _ds_adam


class StreamedAdamW:
    """AdamW over named parameter groups with state in `store` (tier `tier`); see the module docstring.

    `params`: group name -> the model's tensors of that group, in a fixed order; their initial values
    seed the fp32 master weights. Updated values go to the parameter-store chunk of the same name when
    `param_store` has one (parameters offloaded by `OffloadedParams`), else to those tensors in place.
    `decays(tensor)` says which parameters weight decay applies to (None: all, like one torch param group);
    the runtime passes "matrices only", as Megatron-LM and its reference do.
    `owned` (ZeRO 1/2 over dp): group name -> the range `[a, b)` of the group's flat parameters whose state this
    rank keeps and updates (absent: all of it); gradients are still accumulated for the whole group.
    """

    def __init__(self, params: Mapping[str, Sequence[torch.Tensor]], *, store: TieredStore, tier: str,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL, param_store: TieredStore | None = None,
                 impl: str | None = None, decays: Callable[[torch.Tensor], bool] | None = None,
                 owned: Mapping[str, tuple[int, int]] | None = None) -> None:
        assert tier in ("device", "cpu", "ssd"), tier
        assert chunk_numel % 4096 == 0, "chunks must stay I/O-aligned in the parameter tier"
        self.store, self.tier, self.param_store = store, tier, param_store
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.step_count = 0
        self.groups = {g: list(ts) for g, ts in params.items()}
        self._shapes = {g: [t.shape for t in ts] for g, ts in self.groups.items()}
        self._offsets = {g: _offsets(ts) for g, ts in self.groups.items()}
        # Per parameter, decided once from the initial tensors (offloaded ones later become placeholders).
        self._decays = {g: [decays is None or bool(decays(t)) for t in ts] for g, ts in self.groups.items()}
        self._pieces: list[_Piece] = []
        host = store.device if tier != "device" else None
        self._grads: dict[str, torch.Tensor] = {}
        self._fresh: dict[str, bool] = {}  # no gradient added since the last step
        for g, tensors in self.groups.items():
            flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
            first, end = (owned or {}).get(g, (0, flat.numel()))
            for index, start in enumerate(range(first, end, chunk_numel)):
                piece = _Piece(g, index, start, min(chunk_numel, end - start))
                master = flat[start:start + piece.numel]
                zeros = torch.zeros(piece.numel, dtype=torch.float32)
                store.add(piece.name, [master, zeros, zeros], tier, dtype=torch.float32, kind="optimizer")
                self._pieces.append(piece)
            where = store.device.torch_device if host is None else "cpu"
            self._grads[g] = (store.device.pinned_empty((flat.numel(),), torch.float32) if host is not None
                              else torch.empty(flat.numel(), dtype=torch.float32, device=where))
            if host is None:
                store.budget.charge(flat.numel() * 4, "grads")
            self._fresh[g] = True
        self.which, self._ds, self._opt_id = self._choose_impl(impl)

    def _choose_impl(self, impl: str | None) -> tuple[str, Any, int | None]:
        impl = impl or os.environ.get(ADAM_ENV, "auto")
        if impl not in ("auto", "deepspeed", "torch"):
            raise UserError(f"{ADAM_ENV}={impl!r}: expected torch, deepspeed or auto")
        if impl != "torch" and self.tier != "device":
            module, reason = deepspeed_cpu_adam_module()
            if module is not None:
                opt_id = next(_opt_ids)
                module.create_adam(opt_id, 0.0, self.betas[0], self.betas[1], self.eps, self.weight_decay, True, False)
                log_once("offload optimizer: DeepSpeedCPUAdam (adamw_mode=True)")
                return "deepspeed-cpu-adam", module, opt_id
            if impl == "deepspeed":
                raise UserError(f"{ADAM_ENV}=deepspeed but the op cannot be used: {reason}")
            log_once(f"offload optimizer: torch AdamW math ({reason})")
        else:
            log_once("offload optimizer: torch AdamW math")
        return "torch-adamw", None, None

    # ---- gradients -----------------------------------------------------------------------------

    def add_grads(self, group: str, grads: Sequence[torch.Tensor | None]) -> None:
        """Accumulate one backward's gradients of `group` (same order as its params; None: zero).

        Unlike torch.optim.AdamW, which skips a parameter whose `.grad` is None, a missing gradient
        counts as zero here (moments decay, weight decay applies): state lives per chunk, not per tensor.
        """
        flat = self._grads[group]
        for (start, end), grad in zip(self._offsets[group], grads, strict=True):
            dst = flat[start:end]
            if grad is None:
                if self._fresh[group]:
                    dst.zero_()
            elif self._fresh[group]:
                dst.copy_(grad.detach().reshape(-1))  # casts to fp32
            else:
                dst.add_(grad.detach().reshape(-1).to(dst.device, torch.float32))
        self._fresh[group] = False

    def add_grad(self, group: str, index: int, grad: torch.Tensor) -> None:
        """Accumulate one backward's gradient of parameter `index` of `group` (a hook calls it as soon as the
        gradient is ready, so the device never holds the stage's gradients at once)."""
        flat = self._grads[group]
        if self._fresh[group]:
            flat.zero_()
            self._fresh[group] = False
        start, end = self._offsets[group][index]
        flat[start:end].add_(grad.detach().reshape(-1).to(flat.device, torch.float32))

    def flat_grads(self) -> dict[str, torch.Tensor]:
        """Every group's accumulated fp32 gradient buffer (zeros where no gradient arrived), by group, for
        in-place work before `step` such as summing over data-parallel replicas."""
        for group, fresh in self._fresh.items():
            if fresh:
                self._grads[group].zero_()
                self._fresh[group] = False
        return dict(self._grads)

    def drop_grads(self) -> None:
        """Forget the accumulated gradients without stepping (a step skipped for an inf or nan): the next
        backward starts from zero."""
        for group in self._fresh:
            self._fresh[group] = True

    def grad_views(self, group: str) -> list[torch.Tensor]:
        """The accumulated fp32 gradients of `group`, shaped like its params."""
        flat = self._grads[group]
        return [flat[s:e].view(shape) for (s, e), shape in zip(self._offsets[group], self._shapes[group])]

    def grad_norms(self) -> list[torch.Tensor]:
        """The L2 norm of every parameter's gradient, in registration order (as torch's clipping computes)."""
        return list(torch._foreach_norm([g for group in self.groups for g in self.grad_views(group)], 2.0))

    def scale_grads(self, coef: torch.Tensor | float) -> None:
        """Multiply every gradient by `coef` (gradient clipping)."""
        torch._foreach_mul_([g for group in self.groups for g in self.grad_views(group)], coef)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` on the accumulated gradients; returns the total norm.

        Equal bit for bit to clipping the same parameters' grads in the same order; across pipeline
        stages, combine `grad_norms()` of every stage and call `scale_grads` instead.
        """
        total = torch.linalg.vector_norm(torch.stack(self.grad_norms()), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.scale_grads(coef)
        return total

    # ---- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW step with learning rate `lr` over every group, streaming the state chunk by chunk."""
        self.step_count += 1
        for group, fresh in self._fresh.items():
            if fresh:  # no gradient arrived for this group: step with zeros, never with stale memory
                self._grads[group].zero_()
        pieces = self._pieces
        if pieces:
            self.store.prefetch(pieces[0].name, to="host")
        for k, piece in enumerate(pieces):
            if k + 1 < len(pieces):
                self.store.prefetch(pieces[k + 1].name, to="host")  # read the next chunk while this one updates
            state = self.store.get(piece.name) if self.tier == "device" else self.store.host(piece.name)
            master, exp_avg, exp_avg_sq = state.view(3, piece.numel).unbind(0)
            self._update(piece, master, exp_avg, exp_avg_sq, lr)
            self.store.write_back(piece.name)  # asynchronous on SSD; the next read does not wait for it
            self._emit(piece, master)
            if self.tier != "device":
                self.store.release(piece.name)
        for group in self.groups:
            self._fresh[group] = True

    def _update(self, piece: _Piece, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                lr: float) -> None:
        grads = self._grads[piece.group]
        segments = []
        # One update per parameter, as torch.optim.AdamW does.
        for (start, end), decay in zip(self._offsets[piece.group], self._decays[piece.group]):
            lo, hi = max(start, piece.start), min(end, piece.start + piece.numel)
            if lo < hi:
                segments.append((lo - piece.start, hi - piece.start, lo, decay))
        views = [(master[a:b], grads[g:g + b - a], exp_avg[a:b], exp_avg_sq[a:b], d) for a, b, g, d in segments]
        if self._ds is not None:
            for p, g, m, v, decay in views:
                self._ds.adam_update(self._opt_id, self.step_count, lr, self.betas[0], self.betas[1], self.eps,
                                     self.weight_decay if decay else 0.0, True, p, g, m, v)
            return
        adamw_step([v[0] for v in views], [v[1] for v in views], [v[2] for v in views], [v[3] for v in views],
                   decays=[v[4] for v in views], step=self.step_count, lr=lr, betas=self.betas, eps=self.eps,
                   weight_decay=self.weight_decay)

    def _emit(self, piece: _Piece, master: torch.Tensor) -> None:
        """Send the piece's updated values to the model's tensors or to the parameter tier."""
        if self.param_store is not None and piece.group in self.param_store:
            dtype = self.param_store.layout(piece.group).dtype
            self.param_store.write_slice(piece.group, piece.start, master.to(dtype))
            return
        for tensor, (start, end) in zip(self.groups[piece.group], self._offsets[piece.group]):
            lo, hi = max(start, piece.start), min(end, piece.start + piece.numel)
            if lo < hi:
                tensor.data.view(-1)[lo - start:hi - start].copy_(master[lo - piece.start:hi - piece.start])

    # ---- state ---------------------------------------------------------------------------------

    def state_of(self, group: str) -> dict[str, list[torch.Tensor]]:
        """Host copies of `group`'s fp32 master weights and moments, shaped like its params (a group whose state
        this rank keeps whole)."""
        parts: dict[str, list[torch.Tensor]] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
        pieces = [p for p in self._pieces if p.group == group]
        assert sum(p.numel for p in pieces) == self._offsets[group][-1][1], f"{group}: only part of it is kept here"
        for piece in pieces:
            state = self.store.get(piece.name) if self.tier == "device" else self.store.host(piece.name)
            for key, values in zip(parts, state.view(3, piece.numel).unbind(0)):
                parts[key].append(values.to("cpu", copy=True))
            if self.tier != "device":
                self.store.release(piece.name)
        out = {}
        for key, pieces in parts.items():
            flat = torch.cat(pieces)
            out[key] = [flat[s:e].view(shape) for (s, e), shape in zip(self._offsets[group], self._shapes[group])]
        return out

    def state_views(self, *, writable: bool = False) -> Iterator[tuple[torch.Tensor, int, int, dict]]:
        """For checkpoints, chunk by chunk: per parameter, `(param, start, stop, {"master": t, "exp_avg": t,
        "exp_avg_sq": t})`, `[start, stop)` a range of the flattened parameter (as `DataParallelAdamW.state_views`).

        Without `writable` each `t` is a copy, kept valid after the chunk is released (saving); with it, a view
        of the borrowed chunk, stored back in its tier when the caller asks for the next one (loading).
        """
        for k, piece in enumerate(self._pieces):
            if self.tier != "device" and k + 1 < len(self._pieces):
                self.store.prefetch(self._pieces[k + 1].name, to="host")
            state = self.store.get(piece.name) if self.tier == "device" else self.store.host(piece.name)
            try:
                parts = state.view(3, piece.numel)
                parts = parts if writable else parts.clone()
                kinds = dict(zip(("master", "exp_avg", "exp_avg_sq"), parts.unbind(0)))
                for tensor, (start, end) in zip(self.groups[piece.group], self._offsets[piece.group]):
                    lo, hi = max(start, piece.start), min(end, piece.start + piece.numel)
                    if lo < hi:
                        a, b = lo - piece.start, hi - piece.start
                        yield tensor, lo - start, hi - start, {kind: t[a:b] for kind, t in kinds.items()}
                if writable:
                    self.store.write_back(piece.name)
            finally:
                if self.tier != "device":
                    self.store.release(piece.name)

    def close(self) -> None:
        """Free the DeepSpeed optimizer object and device gradient buffers (the store is the caller's)."""
        if self._ds is not None and self._opt_id is not None:
            self._ds.destroy_adam(self._opt_id)
            self._ds = self._opt_id = None
        if self.tier == "device":
            for flat in self._grads.values():
                self.store.budget.release(flat.numel() * 4, "grads")
        self._grads.clear()


def _offsets(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    out, start = [], 0
    for t in tensors:
        out.append((start, start + t.numel()))
        start += t.numel()
    return out
