"""Bytes per parameter of a stage's training state: the one table the optimizer allocates by and the planner prices.

Megatron-LM's mixed-precision layout. A stage computing in bf16 or fp16 keeps its parameters in that dtype
(2 bytes), accumulates gradients over micro-batches in an fp32 buffer (4 bytes, Megatron's `main_grad`), and its
optimizer keeps an fp32 master copy of the weights (4) and the Adam moments (4 + 4). An fp32 stage's parameters
are the master copy: 4 + 4 + 8. ZeRO 1 and 2 divide the master and the moments over the stage's dp; the
gradient buffer stays whole on every dp rank (it accumulates every micro-batch's gradient before the dp
reduce-scatter, as Megatron's distributed optimizer keeps it), so ZeRO 2 holds what ZeRO 1 holds.

What the dp reduction sends is that fp32 buffer, whatever the stage computes in (`GRAD_REDUCE_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter of each piece of one stage's training state (before any ZeRO division)."""

    weights: int
    """The model's parameters, in the stage's compute precision."""
    grads: int
    """The fp32 gradient buffer micro-batch gradients accumulate into."""
    master: int
    """The fp32 master copy of the weights; 0 when the weights are fp32 (they are the master)."""
    moments: int
    """Adam's first and second moments, fp32."""

    @property
    def optimizer(self) -> int:
        """Optimizer state: master copy and moments."""
        return self.master + self.moments


_STATE_BYTES = {"bf16": StateBytes(weights=2, grads=4, master=4, moments=8),
                "fp16": StateBytes(weights=2, grads=4, master=4, moments=8),
                "fp32": StateBytes(weights=4, grads=4, master=0, moments=8)}


GRAD_REDUCE_BYTES = 4
"""Bytes per gradient element that a stage's gradient reductions send, in every precision: the fp32 gradient
buffer all-reduced (ZeRO 0) or reduce-scattered (ZeRO 1/2) over dp and all-reduced over cp
(`models.data_parallel`), ZeRO-3's fp32 reduce-scatter (FSDP2 `reduce_dtype`), the host fp32 buffer of an
offloaded optimizer. The time model prices the traffic at this size."""


def state_bytes(precision: str) -> StateBytes:
    """The training state per parameter of a stage computing in `precision` (bf16 | fp16 | fp32)."""
    return _STATE_BYTES[precision]


def optimizer_shards(zero: int, dp: int) -> int:
    """Over how many ranks a stage's master copy and moments are divided (ZeRO >= 1: the stage's dp)."""
    return dp if zero >= 1 else 1
