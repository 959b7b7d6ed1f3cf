"""Each rank's measured memory, next to the planner's figure for the same rank: the `memory` key of a step record.

Measured, per rank and step (bytes):
- `params`, `grads`, `optimizer`: the training state the stage's optimizer holds on the device
  (`StageOptimizer.memory_bytes`: its flat buffers, or the offload bookkeeping's peak per kind);
- `activations`: the most bytes of saved activations held on the device at once during the step: every
  tensor autograd saves for backward under the stage's forward, unique storages counted once, parameters
  excepted, minus what the activation tier moved to the host (`SavedActivationMeter`);
- `peak`: the device allocator's peak over the step where the vendor has one; on the CPU (emulation) the sum
  of the four above, the bytes counted exactly (the process's RSS mixes every tier and rank).
Planned: the planner's components for the same stage (`stagemap.memory.stage_memory_bytes`) without the fixed
reserve, and their sum as `peak`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from heteroflow.config import JobConfig, PlanSpec
from heteroflow.devices.facade import Device
from heteroflow.stagemap.memory import stage_memory_bytes

MEASURED_KEYS = ("params", "grads", "optimizer", "activations", "peak")
"""The measured figures of one rank, in the order they travel in the per-step gather (`runtime.stage_times`)."""


class _Saved:
    """A saved activation counted by the meter; uncounts itself when autograd drops it."""

    __slots__ = ("value", "key", "meter")

    def __init__(self, value: object, key: int, meter: SavedActivationMeter) -> None:
        self.value, self.key, self.meter = value, key, meter

    def __del__(self) -> None:
        self.meter._drop(self.key)


class SavedActivationMeter:
    """Live and peak bytes of the activations autograd keeps on the device for backward (unique storages)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [saved references, bytes]

    def exclude_parameters(self, model: nn.Module) -> None:
        """Count `model`'s parameter storages as parameters, never as activations (autograd saves views of them)."""
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # ZeRO-3 (FSDP2) parameters are DTensors
            if local.numel():
                self._refs.setdefault(local.untyped_storage().data_ptr(), [1 << 60, 0])  # pinned: never reaches zero

    def reset_peak(self) -> None:
        """Start a new peak from the bytes held now."""
        self.peak_bytes = self.live_bytes

    def _drop(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    def context(self, inner: contextlib.AbstractContextManager) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks counting what stays on the device of what the activation tier's `inner` context (its
        `saved_tensors_hooks`, or a null context) packs; `inner`'s own hooks still do the packing."""
        inner_pack = getattr(inner, "pack_hook", None)
        inner_unpack = getattr(inner, "unpack_hook", None)

        def pack(tensor: torch.Tensor) -> object:
            saved = inner_pack(tensor) if inner_pack is not None else tensor
            if (not isinstance(saved, torch.Tensor) or isinstance(saved, nn.Parameter)
                    or saved.device != self.device):
                return saved  # moved to another tier, or a parameter: counted elsewhere
            storage = saved.untyped_storage()
            key = storage.data_ptr()
            entry = self._refs.get(key)
            if entry is None:
                self._refs[key] = [1, storage.nbytes()]
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            else:
                entry[0] += 1
            return _Saved(saved, key, self)

        def unpack(saved: object) -> torch.Tensor:
            value = saved.value if isinstance(saved, _Saved) else saved
            return inner_unpack(value) if inner_unpack is not None else value  # type: ignore[return-value]

        # Offloaded parameters put their parameter-view hook on top of ours (see `heteroflow.offload.params`).
        pack.chains_param_views = getattr(inner_pack, "chains_param_views", True)
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def measured_memory(optimizer, meter: SavedActivationMeter, device: Device) -> dict[str, int]:
    """This rank's figures for the step that just ended (see the module docstring)."""
    state = optimizer.memory_bytes()
    out = {"params": int(state["params"]), "grads": int(state["grads"]), "optimizer": int(state["optimizer"]),
           "activations": int(meter.peak_bytes)}
    counted = sum(out.values())
    out["peak"] = counted if device.kind == "cpu" else int(device.max_memory_allocated_bytes())
    return out


def reset_measurement(meter: SavedActivationMeter, device: Device) -> None:
    """Start the next step's peaks."""
    meter.reset_peak()
    if device.kind != "cpu":
        device.reset_peak_memory()


def planned_memory(job: JobConfig, plan: PlanSpec, stage: int) -> dict[str, int]:
    """The planner's per-device figures for plan stage `stage`, reserve left out, with their sum as `peak`."""
    spec = plan.stages[stage]
    parts = stage_memory_bytes(job.model, spec.layout, precision=spec.layout.compute_precision(job.train.precision),
                               micro_batch_size=plan.micro_batch_size, schedule=plan.schedule,
                               num_stages=len(plan.stages), stage=stage,
                               num_micro_batches=plan.num_micro_batches(job.train), layers=spec.layers)
    out = {k: int(round(v)) for k, v in parts.items()}
    out["peak"] = sum(out.values())
    return out


def memory_record(job: JobConfig, plan: PlanSpec, measured: list[dict[str, int]], stages: list[int]) -> dict:
    """The step record's `memory` value: per rank, its stage, measured and planned figures."""
    planned = {k: planned_memory(job, plan, k) for k in sorted(set(stages))}
    return {"ranks": [{"rank": rank, "stage": k, "measured": m, "planned": planned[k]}
                      for rank, (m, k) in enumerate(zip(measured, stages))]}
