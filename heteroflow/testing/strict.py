"""Vendor-faithful CPU stand-ins for NCCL and HCCL: run the real (not `--emulate`) code path on CPU processes.

gloo forgives what the vendor backends do not. A strict stand-in wraps a gloo group with the rules of NCCL and HCCL
that gloo lacks, so a test on CPU fails where a run on the cards would fail or hang:

- **One queue per communicator, run in posting order.** Every operation posted on a group waits for the ones posted
  before it on that group (a rank's point-to-point and collectives alike), as a communicator's stream does.
  `dist.batch_isend_irecv` on a strict group is one queued operation whose sends and receives run together (NCCL's
  `ncclGroupStart/End`): torch's Python process groups get no coalescing, so this module routes that call.
- **A send completes only when its receive is posted** (gloo's sends already rendezvous; the queue makes the
  sends and receives posted after a waiting send wait too).
- **Host tensors refused on vendor groups, device tensors on gloo groups** of an accelerator rank (gloo takes no NPU
  tensors). On CPU both live in host memory, so `HostTags`, a torch function mode, tags as *host* what real code
  makes host: tensors created without a device (`torch.tensor(list)`), `.cpu()` copies, pinned buffers
  (`pin_memory=True`, `Device.pinned_empty`), and what is computed from host tensors only. Everything else counts
  as the stage's device memory; `.to(device)` of a host tensor makes a device copy. Limits: a tensor made with an
  explicit `device="cpu"` (or moved by `.to("cpu")`) counts as device memory, since on CPU the stage's device is
  `cpu` too: code that means host memory says `.cpu()` or pins it. The world group (made before this module runs)
  stays plain gloo.
- **A deadlock fails within `timeout_s`**, naming every member rank of the group and the operation it waits in: each
  rank publishes in the group's store what its queue is running.

`install(vendor)` registers the stand-in backends in this process only (a rank of another vendor never has them;
`build_process_groups` passes non-members a backend they have) and returns the names `build_process_groups` should
use. The training worker asks `standins_requested(vendor)`: with `HETEROFLOW_STRICT_BACKENDS=1` in its environment
(tests only; `--emulate` is what users run on CPU) it trains on these backends with CPU stand-in devices.
"""

from __future__ import annotations

import datetime
import inspect
import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ENVIRONMENT = "HETEROFLOW_STRICT_BACKENDS"
"""Set to 1 in a training worker's environment: run the real path on CPU with the strict stand-ins."""
TIMEOUT_ENVIRONMENT = "HETEROFLOW_STRICT_TIMEOUT_S"
"""Seconds an operation on a strict group may wait before it fails as a deadlock (default `DEFAULT_TIMEOUT_S`)."""
DEFAULT_TIMEOUT_S = 60.0
STANDINS = {"nccl": "strict_nccl", "hccl": "strict_hccl", "gloo": "strict_gloo"}
"""The name each backend's stand-in is registered under (torch reserves `nccl`; `hccl` is torch_npu's)."""

_HOST = "_heteroflow_host"
_ABORT_AFTER_S = 3.0
"""After a deadlock is reported, the process ends this many seconds later unless it failed by itself."""


# ---------------------------------------------------------------------------------------------------- host tags
def is_host(t: torch.Tensor) -> bool:
    """Whether `t` (or the tensor it views) is tagged as host memory."""
    base = t._base
    return bool(getattr(t, _HOST, False) or (base is not None and getattr(base, _HOST, False)))


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Tag `t` as host memory; returns it."""
    setattr(t, _HOST, True)
    return t


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.as_tensor, torch.arange,
              torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
              torch.eye, torch.from_numpy}
_LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
         torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
         torch.Tensor.new_tensor}
_TO_DEVICE = {torch.Tensor.to}
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory}


class HostTags(TorchFunctionMode):
    """Tags host tensors as real code on an accelerator would make them (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if func in _FACTORIES:
            if kwargs.get("device") is None or kwargs.get("pin_memory"):
                mark_host(out)
        elif func in _LIKE:
            if (kwargs.get("device") is None and is_host(args[0])) or kwargs.get("pin_memory"):
                mark_host(out)
        elif func in _TO_HOST:
            if out is args[0] and not is_host(out):  # on CPU `.cpu()` returns the tensor itself: copy, as a card does
                out = out.clone()
            mark_host(out)
        elif func in _TO_DEVICE:
            if _device_argument(args[1:], kwargs) is not None:
                if is_host(args[0]):  # a host tensor moved to the stage's device: a device copy
                    out = out.clone() if out is args[0] or out._base is not None else out
            elif is_host(args[0]):
                mark_host(out)  # a dtype cast stays where it was
        elif out._base is None and not getattr(out, _HOST, False):
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if inputs and all(is_host(t) for t in inputs):
                mark_host(out)
        return out


def _device_argument(args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return a
    return None


# ------------------------------------------------------------------------------------------------ strict groups
class StrictError(RuntimeError):
    """An operation a vendor backend would refuse, or a deadlock."""


@dataclass(slots=True)
class _Item:
    """One queued operation: `start()` issues the gloo work(s), the future completes when they did."""

    number: int
    what: str
    start: Callable[[], list]
    future: torch.futures.Future


def _describe(t: torch.Tensor) -> str:
    n = t.numel() * t.element_size()
    size = f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} B"
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} ({size})"


class StrictGroup(dist.ProcessGroup):
    """A gloo group with a vendor backend's rules (module docstring). `refuse`: `host` (a vendor group) or
    `device` (gloo on an accelerator rank); `ordered`: run operations one at a time in posting order."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, *, backend: str,
                 refuse: str, ordered: bool):
        super().__init__(rank, size)
        self._rank, self._size, self.backend, self.refuse, self.ordered = rank, size, backend, refuse, ordered
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.global_rank = dist.get_rank()
        self.timeout_s = float(os.environ.get(TIMEOUT_ENVIRONMENT, DEFAULT_TIMEOUT_S))
        self._store = dist.PrefixStore("strict/", store)
        self._posted = 0
        self._name = ""
        self._failed: str | None = None
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._publish("idle (nothing posted yet)")
        if ordered:
            threading.Thread(target=self._run, name=f"strict-{backend}", daemon=True).start()

    # --- what torch calls -------------------------------------------------------------------------------------
    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self.backend

    @property
    def group_name(self) -> str:
        """The name torch registered this group under (it sets none on a Python process group)."""
        return dist.distributed_c10d._world.pg_names.get(self) or self._name

    def shutdown(self) -> None:
        self._name = self.group_name  # destroy_process_group forgets it before it asks
        self.inner.shutdown()

    def send(self, tensors, dst, tag=0):
        return self._post(f"send {_describe(tensors[0])} to group rank {dst} tag {tag}", tensors,
                          lambda: [self.inner.send(tensors, dst, tag)])

    def recv(self, tensors, src, tag=0):
        return self._post(f"recv {_describe(tensors[0])} from group rank {src} tag {tag}", tensors,
                          lambda: [self.inner.recv(tensors, src, tag)])

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._post(f"all_reduce {_describe(tensors[0])}", tensors, lambda: [self.inner.allreduce(tensors, opts)])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._post(f"all_reduce_coalesced of {len(tensors)}", tensors,
                          lambda: [self.inner.allreduce_coalesced(tensors, opts)])

    def allgather(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._post(f"all_gather {_describe(inputs[0])}", [*inputs, *tree_leaves(outputs)],
                          lambda: [self.inner.allgather(outputs, inputs, opts)])

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._post(f"all_gather_into_tensor {_describe(input)}", [output, input],
                          lambda: [self.inner._allgather_base(output, input, opts)])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._post(f"reduce_scatter_tensor {_describe(input)}", [output, input],
                          lambda: [self.inner._reduce_scatter_base(output, input, opts)])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._post(f"reduce_scatter {_describe(outputs[0])}", [*outputs, *tree_leaves(inputs)],
                          lambda: [self.inner.reduce_scatter(outputs, inputs, opts)])

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._post(f"all_to_all_single {_describe(input)}", [output, input],
                          lambda: [self.inner.alltoall_base(output, input, output_splits, input_splits, opts)])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._post(f"all_to_all of {len(inputs)}", [*outputs, *inputs],
                          lambda: [self.inner.alltoall(outputs, inputs, opts)])

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._post(f"broadcast {_describe(tensors[0])} from group rank {opts.rootRank}", tensors,
                          lambda: [self.inner.broadcast(tensors, opts)])

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._post(f"reduce {_describe(tensors[0])} to group rank {opts.rootRank}", tensors,
                          lambda: [self.inner.reduce(tensors, opts)])

    def gather(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        return self._post(f"gather {_describe(inputs[0])}", [*inputs, *tree_leaves(outputs)],
                          lambda: [self.inner.gather(outputs, inputs, opts)])

    def scatter(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._post(f"scatter {_describe(outputs[0])}", [*outputs, *tree_leaves(inputs)],
                          lambda: [self.inner.scatter(outputs, inputs, opts)])

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._post("barrier", [], lambda: [self.inner.barrier(opts)])

    # --- batched point-to-point (NCCL's group call) -----------------------------------------------------------
    def post_batch(self, ops: list) -> list:
        """`batch_isend_irecv` on this group: one queued operation whose sends and receives run together."""
        def peer(op) -> int:
            return dist.get_group_rank(op.group, op.peer)

        parts = [f"{'send' if op.op is dist.isend else 'recv'} {_describe(op.tensor)} "
                 f"{'to' if op.op is dist.isend else 'from'} group rank {peer(op)} tag {op.tag}" for op in ops]
        start = lambda: [self.inner.send([op.tensor], peer(op), op.tag) if op.op is dist.isend  # noqa: E731
                         else self.inner.recv([op.tensor], peer(op), op.tag) for op in ops]
        return [self._post("batch_isend_irecv [" + "; ".join(parts) + "]", [op.tensor for op in ops], start)]

    # --- the rules --------------------------------------------------------------------------------------------
    def _post(self, what: str, tensors: Iterable[torch.Tensor], start: Callable[[], list]):
        if self._failed is not None:
            raise StrictError(self._failed)
        self._check(what, tensors)
        self._posted += 1
        item = _Item(self._posted, what, start, torch.futures.Future())
        if not self.ordered:  # gloo's own rules: every operation runs on its own
            works = start()
            assert len(works) == 1
            return works[0]
        self._queue.put(item)
        return _Work(item.future)

    def _check(self, what: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            host = is_host(t)
            if self.refuse == "host" and host:
                raise StrictError(f"{self.backend.removeprefix('strict_')} takes device tensors only: {what} on "
                                  f"rank {self.global_rank} passes a host tensor (created without a device, a .cpu() "
                                  "copy or a pinned buffer); put it on the stage's device")
            if self.refuse == "device" and not host:
                raise StrictError(f"gloo on an accelerator rank takes host tensors only (it refuses NPU tensors): "
                                  f"{what} on rank {self.global_rank} passes a device tensor; stage it through "
                                  "host memory (.cpu() or a pinned buffer) or use the vendor's group")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if self._failed is not None:  # a broken communicator fails everything after (NCCL aborts it)
                item.future.set_exception(StrictError(self._failed))
                continue
            self._execute(item)

    def _execute(self, item: _Item) -> None:
        label = f"#{item.number} {item.what}"
        self._publish(f"waits in {label}")
        try:
            works = item.start()
            for w in works:
                w.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as error:  # noqa: BLE001 (handed to the waiting caller)
            self._failed = self._deadlock_report(label, error)
            item.future.set_exception(StrictError(self._failed))
            # Like NCCL's watchdog: report, give the caller a moment to raise it, then end the process, which
            # may be blocked elsewhere (on another group) and would otherwise hang until a harness times out.
            print(f"heteroflow.testing.strict: {self._failed}", file=sys.stderr, flush=True)
            threading.Timer(_ABORT_AFTER_S, os._exit, args=(1,)).start()
            return
        self._publish(f"idle after #{item.number} {item.what}")
        item.future.set_result(None)

    def _publish(self, state: str) -> None:
        self._store.set(f"state/{self._rank}", f"global rank {self.global_rank}: {state}")

    def _deadlock_report(self, label: str, error: Exception) -> str:
        states = []
        for r in range(self._size):
            key = f"state/{r}"
            states.append(self._store.get(key).decode() if self._store.check([key]) else f"group rank {r}: unknown")
        return (f"strict {self.backend.removeprefix('strict_')} group: {label} on global rank {self.global_rank} "
                f"made no progress in {self.timeout_s:g} s (a deadlock, or a peer that never posts the match). "
                f"Each member rank waits in: " + "; ".join(states) + f". gloo said: {str(error).splitlines()[0]}")


class _Work(dist.Work):
    """A queued operation's handle: `wait()` raises what the operation failed with (a deadlock report)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future

    def wait(self, timeout=None) -> bool:
        self.future.wait()  # raises the operation's error
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        return self.future.done()

    def get_future(self) -> torch.futures.Future:
        return self.future


def _creator(backend: str, refuse: str, ordered: bool):
    def create(store, rank, size, timeout):
        return StrictGroup(store, rank, size, timeout, backend=STANDINS[backend], refuse=refuse, ordered=ordered)
    return create


_original_batch_isend_irecv = dist.batch_isend_irecv


def _batch_isend_irecv(p2p_op_list: list) -> list:
    """`dist.batch_isend_irecv` that hands a strict group the whole batch (module docstring)."""
    group = p2p_op_list[0].group if p2p_op_list else None
    if isinstance(group, StrictGroup) and group.ordered:
        return group.post_batch(list(p2p_op_list))
    return _original_batch_isend_irecv(p2p_op_list)


_original_new_group = dist.new_group
_NEW_GROUP = inspect.signature(_original_new_group)


def _new_group(*args, **kwargs):
    """`dist.new_group` whose gloo groups (the default backend too) are the strict gloo stand-in: on an accelerator
    rank every gloo group refuses device tensors, also those created outside `build_process_groups`."""
    bound = _NEW_GROUP.bind_partial(*args, **kwargs)
    if bound.arguments.get("backend") in (None, "gloo"):
        bound.arguments["backend"] = STANDINS["gloo"]
    return _original_new_group(*bound.args, **bound.kwargs)


@dataclass(frozen=True, slots=True)
class Standins:
    """What `install` set up in this process."""

    vendor_backend: str
    """This rank's own backend (`nccl`, `hccl`, or `gloo` for a CPU rank)."""
    backend_names: dict[str, str]
    """For `build_process_groups(backend_names=...)`: backend -> the name registered for it here."""
    host_tags: HostTags | None


def install(vendor_backend: str) -> Standins:
    """Register this rank's strict stand-ins (its vendor's and, on an accelerator rank, gloo's) and start tagging
    host tensors. A CPU rank (`gloo`) gets nothing: its device is the host."""
    if vendor_backend == "gloo":
        return Standins(vendor_backend, {}, None)
    registered = dist.Backend.backend_list
    if STANDINS[vendor_backend] not in registered:
        dist.Backend.register_backend(STANDINS[vendor_backend], _creator(vendor_backend, "host", True), devices=["cpu"])
    if STANDINS["gloo"] not in registered:
        dist.Backend.register_backend(STANDINS["gloo"], _creator("gloo", "device", False), devices=["cpu"])
    dist.batch_isend_irecv = _batch_isend_irecv
    dist.new_group = _new_group
    mode = HostTags()
    mode.__enter__()
    return Standins(vendor_backend, {vendor_backend: STANDINS[vendor_backend]}, mode)


def standins_requested(vendor_backend: str) -> Standins | None:
    """`install(vendor_backend)` when this process's environment asks for the strict stand-ins (tests), else None."""
    return install(vendor_backend) if os.environ.get(ENVIRONMENT) == "1" else None
