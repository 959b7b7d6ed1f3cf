"""`OffloadedParams`: the parameters of a stack of blocks live in a `TieredStore`, fetched layer by layer.

Between uses a block's parameters are empty placeholders on the device; the real values are one
store chunk per block (cpu or ssd tier). Module hooks move them:

- forward:  pre-hook of block i fetches i and prefetches i+1; the post-hook releases i;
- backward: the backward pre-hook of block i fetches i and prefetches i-1; when every parameter of
  block i has its gradient accumulated, the gradients go to `grad_sink` (the optimizer tier, which
  accumulates them on the host) and the block is released; a callback at the end of the backward
  pass releases whatever is left (parameters that got no gradient).

Activation recompute (`torch.utils.checkpoint`, non-reentrant) works: a forward run inside a backward
pass prefetches towards the input and leaves the release to the gradient hooks. Swapping a
parameter's `.data` keeps the autograd variable (and its version counter), as ZeRO-3 does.

Autograd may save *views* of a parameter's data for backward (`F.linear` saves `weight.t()`), and a
view keeps the fetched copy it was taken from alive until backward: the whole stack's parameters would
stay on the device, unaccounted. So while a block's forward runs (outside recompute), a saved-tensor
hook stores such views as (block, offset, size, stride) and rebuilds them from the block's copy fetched
for backward; other saved tensors go to the hooks around it (e.g. the CPU activation tier). DeepSpeed's
ZeRO-3 solves the same problem by replacing `F.linear` with its own autograd function.

Build the blocks on the CPU (or block by block) before handing them over: a model built whole on
the device has already exceeded a budget this exists to honour.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from heteroflow.devices.torch_support import check_params_offload
from heteroflow.offload.store import TieredStore

GradSink = Callable[[str, list], None]
"""Called with a block's chunk name and its parameters' gradients (None where a parameter got none)."""


class OffloadedParams:
    """Layer-by-layer parameter fetching for `blocks`; see the module docstring. Call `close()` to undo the hooks."""

    def __init__(self, blocks: Sequence[nn.Module], *, store: TieredStore, tier: str,
                 names: Sequence[str] | None = None, grad_sink: GradSink | None = None,
                 prefetch: bool = True) -> None:
        assert tier in ("cpu", "ssd"), "params on the device need no OffloadedParams"
        check_params_offload()
        self.store, self.tier, self.grad_sink, self.prefetch_next = store, tier, grad_sink, prefetch
        self.names = list(names) if names is not None else [f"block{i}" for i in range(len(blocks))]
        assert len(self.names) == len(blocks)
        self.params: list[list[nn.Parameter]] = [list(b.parameters()) for b in blocks]
        seen: set[int] = set()
        for params in self.params:
            for p in params:
                assert id(p) not in seen, "a parameter shared between blocks cannot be offloaded per block"
                seen.add(id(p))
        self._fetched: set[int] = set()
        self._waiting: dict[int, set[int]] = {}  # block -> ids of params still owed a gradient
        self._grad_bytes: dict[int, int] = {}  # id(param) -> gradient bytes charged to the budget
        self._callback_queued = False
        self._flats: dict[int, torch.Tensor] = {}  # block -> its fetched flat copy
        self._views_pushed: list[int] = []  # blocks whose forward has the saved-view hook active
        self._handles: list = []
        device = store.device.torch_device
        for i, (block, params) in enumerate(zip(blocks, self.params)):
            store.add(self.names[i], [p.detach() for p in params], tier, kind="params")
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype, device=device)  # placeholder between uses
            self._handles += [
                block.register_forward_pre_hook(functools.partial(self._pre_forward, i)),
                # always_call: the saved-view hook must come off the stack also when the forward raises
                block.register_forward_hook(functools.partial(self._post_forward, i), always_call=True),
                block.register_full_backward_pre_hook(functools.partial(self._pre_backward, i)),
            ]
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i)))

    # ---- hooks ---------------------------------------------------------------------------------

    def _pre_forward(self, i: int, module: nn.Module, args: object) -> None:
        self.fetch(i)
        if self.prefetch_next:
            j = i - 1 if _in_backward() else i + 1  # a recompute inside backward walks towards the input
            if 0 <= j < len(self.params) and j not in self._fetched:
                self.store.prefetch(self.names[j])
        # A recompute's views are of the copy backward uses: nothing to redirect then.
        if not _in_backward() and self._push_view_hooks(i):
            self._views_pushed.append(i)

    def _post_forward(self, i: int, module: nn.Module, args: object, output: object) -> None:
        if self._views_pushed and self._views_pushed[-1] == i:
            self._views_pushed.pop()
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if not _in_backward():  # during a recompute, backward needs the block next: the grad hooks release it
            self.release(i)

    def _push_view_hooks(self, i: int) -> bool:
        """Saved views of block i's parameter data are stored by position; the rest go to the outer hooks."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        if outer_pack is not None and not getattr(outer_pack, "chains_param_views", False):
            # Another hook owns what is saved here (a checkpoint region recomputes instead of saving):
            # leave every tensor to it, as it would see them without offload.
            return False
        flat = self._flats[i]
        # Only plain values in the closures: every saved tensor holds on to them until backward.
        storage, base, dtype, device = flat.untyped_storage().data_ptr(), flat.storage_offset(), flat.dtype, flat.device

        def pack(tensor: torch.Tensor) -> object:
            if (not isinstance(tensor, nn.Parameter) and tensor.dtype == dtype and tensor.device == device
                    and tensor.untyped_storage().data_ptr() == storage):
                return _ParamView(i, tensor.storage_offset() - base, tuple(tensor.shape), tuple(tensor.stride()))
            return outer_pack(tensor) if outer_pack is not None else tensor

        def unpack(saved: object) -> torch.Tensor:
            if isinstance(saved, _ParamView):
                self.fetch(saved.block)  # the backward pre-hook has fetched it already
                current = self._flats[saved.block]
                return current.as_strided(saved.shape, saved.stride, current.storage_offset() + saved.offset)
            return outer_unpack(saved) if outer_unpack is not None else saved  # type: ignore[return-value]

        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        return True

    def _pre_backward(self, i: int, module: nn.Module, grad_output: object) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._waiting[i] = {id(p) for p in self.params[i] if p.requires_grad}
        self.fetch(i)
        if self.prefetch_next and i > 0 and (i - 1) not in self._fetched:
            self.store.prefetch(self.names[i - 1])

    def _grad_ready(self, i: int, param: nn.Parameter) -> None:
        if param.grad is not None and id(param) not in self._grad_bytes:
            nbytes = param.grad.numel() * param.grad.element_size()
            self.store.budget.charge(nbytes, "grads")
            self._grad_bytes[id(param)] = nbytes
        waiting = self._waiting.get(i)
        if waiting is not None:
            waiting.discard(id(param))
            if not waiting:
                self._finish_block(i)

    def _end_backward(self) -> None:
        self._callback_queued = False
        for i in sorted(self._waiting):
            self._finish_block(i)
        for i in sorted(self._fetched):
            self.release(i)

    # ---- fetching and releasing ----------------------------------------------------------------

    def fetch(self, i: int) -> None:
        """Put block i's parameter values on the device (no-op if they are there)."""
        if i in self._fetched:
            return
        flat = self.store.get(self.names[i])
        for p, view in zip(self.params[i], self.store.unflatten(self.names[i], flat)):
            p.data = view
        self._flats[i] = flat
        self._fetched.add(i)

    def release(self, i: int) -> None:
        """Replace block i's parameters by placeholders and free their device copy."""
        if i not in self._fetched:
            return
        for p in self.params[i]:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._flats.pop(i, None)
        self.store.release(self.names[i])
        self._fetched.discard(i)

    def _finish_block(self, i: int) -> None:
        """Hand block i's gradients to the sink (which frees them) and release the block."""
        self._waiting.pop(i, None)
        if self.grad_sink is not None:
            self.grad_sink(self.names[i], [p.grad for p in self.params[i]])
            for p in self.params[i]:
                p.grad = None
                nbytes = self._grad_bytes.pop(id(p), 0)
                if nbytes:
                    self.store.budget.release(nbytes, "grads")
        self.release(i)

    def gather(self, i: int) -> list[torch.Tensor]:
        """Host copies of block i's current parameter values (for checks and checkpoints)."""
        name = self.names[i]
        flat = self.store.get(name).to("cpu", copy=True)
        if i not in self._fetched:
            self.store.release(name)
        return self.store.unflatten(name, flat)

    def close(self) -> None:
        """Remove the hooks and release every fetched block (parameters stay placeholders)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for i in sorted(self._fetched):
            self.release(i)


@dataclass(frozen=True, slots=True)
class _ParamView:
    """A saved view of block `block`'s parameter data, by position in the block's flat chunk."""

    block: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _in_backward() -> bool:
    """Whether the caller runs inside an autograd backward pass (hooks, recompute)."""
    return torch._C._current_graph_task_id() != -1
