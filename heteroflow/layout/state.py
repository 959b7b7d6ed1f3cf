"""Bytes per parameter of a stage's training state: the one table the optimizer allocates by and the planner prices.

Megatron-LM's mixed-precision layout. A stage computing in bf16 or fp16 keeps its parameters in that dtype
(2 bytes), accumulates gradients over micro-batches in an fp32 buffer (4 bytes, Megatron's `main_grad`), and its
optimizer keeps an fp32 master copy of the weights (4) and the Adam moments (4 + 4). An fp32 stage's parameters
are the master copy: 4 + 4 + 8. ZeRO 1 and 2 divide the master and the moments over the stage's dp; the
gradient buffer stays whole on every dp rank (it accumulates every micro-batch's gradient before the dp
reduce-scatter, as Megatron's distributed optimizer keeps it), so ZeRO 2 holds what ZeRO 1 holds.

What the dp reduction sends is that fp32 buffer, whatever the stage computes in (`GRAD_REDUCE_BYTES`).

ZeRO-3 (FSDP2 per block, `models.zero3`) divides everything over the stage's cp x dp replicas. With its state on
the device the fp32 parameter shard is the master weight (`ZERO3_SHARD_BYTES`); with optimizer state or
parameters offloaded (ZeRO-Infinity, `offload.zero3`) the shard is kept in the stage's precision in the
parameter tier and the optimizer tier holds an fp32 master, the moments and an fp32 gradient accumulator
(`zero3_state_bytes`).
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
    """Over how many ranks a stage's master copy and moments are divided (ZeRO >= 1: `dp`, the stage's dp, or its
    cp x dp replicas under ZeRO-3)."""
    return dp if zero >= 1 else 1


ZERO3_SHARD_BYTES = StateBytes(weights=4, grads=4, master=0, moments=8)
"""ZeRO-3 with its state on the device, per parameter split over cp x dp: the fp32 shard (which is the master
weight), its fp32 gradient shard and the fp32 Adam moments."""


def zero3_state_bytes(precision: str, *, offloaded: bool) -> StateBytes:
    """Bytes per parameter, each split over cp x dp, of a ZeRO-3 stage computing in `precision`. `offloaded`
    (optimizer state or parameters leave the device): the shard in `precision` (`weights`, in the parameter
    tier) and, in the optimizer tier, the fp32 gradient accumulator, master copy and moments."""
    if not offloaded:
        return ZERO3_SHARD_BYTES
    return StateBytes(weights=state_bytes(precision).weights, grads=4, master=4, moments=8)
