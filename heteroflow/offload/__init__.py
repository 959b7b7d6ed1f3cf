"""Offload: device / CPU / SSD tiers so memory-poor cards can take part in training.

Per stage, the plan's `offload:` says where each rank keeps
- optimizer state (fp32 master weights, Adam moments): device | cpu | ssd  -> `StreamedAdamW`
- parameters between uses: device | cpu | ssd, fetched block by block   -> `OffloadedParams`
- saved (checkpointed) activations: device | cpu                       -> `activation_context`

`StageOffload` builds all of it from an `OffloadPolicy` (plain data from the plan, with the per-rank
device budget); `TieredStore` is the chunk store underneath, `SwapDir` the scratch directory for the
SSD tier, `DeviceBudget` the exact bookkeeping of resident device bytes. SSD I/O runs through
DeepSpeed's async_io op when it builds, else a thread pool with O_DIRECT (`IOEngine.which`); the CPU
Adam step through DeepSpeedCPUAdam when it builds, else torch's AdamW kernel (`StreamedAdamW.which`).
`OffloadedAdamW` is the optimizer (a `heteroflow.optim.StageOptimizer`) of a stage rank that offloads
optimizer state or parameters, built on `StageOffload`. For the planner: `offload_traffic` (bytes per
step by link) priced with `measure_offload` (this host's disk, copy and CPU-Adam rates, for
`heteroflow profile`).
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy exports: the planner imports `heteroflow.offload.policy` on machines without torch.
_EXPORTS = {
    "ActivationOffload": "activations", "activation_context": "activations",
    "IOEngine": "aio", "IORequest": "aio", "open_engine": "aio",
    "DeviceBudget": "budget", "DeviceBudgetExceeded": "budget",
    "OffloadBandwidths": "measure", "measure_offload": "measure",
    "StreamedAdamW": "optimizer", "OffloadedParams": "params", "OffloadedAdamW": "stage_optimizer",
    "OffloadPolicy": "policy", "OffloadTraffic": "policy", "device_budget_bytes": "policy",
    "offload_traffic": "policy", "StageOffload": "stage", "ChunkLayout": "store", "TieredStore": "store",
    "SwapDir": "swap",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'heteroflow.offload' has no attribute {name!r}")
    return getattr(importlib.import_module(f"heteroflow.offload.{_EXPORTS[name]}"), name)


__all__ = [
    "ActivationOffload", "ChunkLayout", "DeviceBudget", "DeviceBudgetExceeded", "IOEngine", "IORequest",
    "OffloadBandwidths", "OffloadPolicy", "OffloadTraffic", "OffloadedAdamW", "OffloadedParams", "StageOffload",
    "StreamedAdamW", "SwapDir", "TieredStore", "activation_context", "device_budget_bytes", "measure_offload",
    "offload_traffic", "open_engine",
]
