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
"""

from heteroflow.offload.activations import ActivationOffload, activation_context
from heteroflow.offload.aio import IOEngine, IORequest, open_engine
from heteroflow.offload.budget import DeviceBudget, DeviceBudgetExceeded
from heteroflow.offload.optimizer import StreamedAdamW
from heteroflow.offload.params import OffloadedParams
from heteroflow.offload.policy import OffloadPolicy, OffloadTraffic, device_budget_bytes, offload_traffic
from heteroflow.offload.stage import StageOffload
from heteroflow.offload.store import ChunkLayout, TieredStore
from heteroflow.offload.swap import SwapDir

__all__ = [
    "ActivationOffload", "ChunkLayout", "DeviceBudget", "DeviceBudgetExceeded", "IOEngine", "IORequest",
    "OffloadPolicy", "OffloadTraffic", "OffloadedParams", "StageOffload", "StreamedAdamW", "SwapDir",
    "TieredStore", "activation_context", "device_budget_bytes", "offload_traffic", "open_engine",
]
