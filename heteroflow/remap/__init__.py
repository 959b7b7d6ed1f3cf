"""Remap: move a tensor between two layouts (stage boundaries, checkpoint resharding).

`layout` and `plan` are pure Python (no torch); `local` applies a plan in one process; `executor` runs
it across processes over torch.distributed point-to-point.
"""

from heteroflow.remap.layout import (Axis, Box, TensorLayout, LayoutError, box_contains, box_intersection, box_shape,
                                     box_slices, box_volume)
from heteroflow.remap.plan import FanOut, Piece, PreReduce, SourceReplicas, TransferPlan, plan_transfer

__all__ = [
    "Axis", "Box", "FanOut", "TensorLayout", "LayoutError", "Piece", "PreReduce", "SourceReplicas", "TransferPlan",
    "box_contains", "box_intersection", "box_shape", "box_slices", "box_volume", "plan_transfer",
]
