"""The layout core: torch-free values and rules that the planner and the runtime share.

- `parallel`: `ParallelLayout` (a stage's tp / cp / dp / sp / ZeRO / recompute / offload / ep / etp) and its validity
  rules;
- `shards`: what one rank of a layout holds (heads, kv heads, parameters, local experts) and which copy of a value
  counts once;
- `routing`: what mixture-of-experts routing moves per rank (dispatched tokens, routed pairs, all-to-all bytes) and
  the load allowance they are priced at;
- `schedule`: the pipeline schedules as per-stage action lists;
- `state`: the bytes per parameter of a stage's training state (optimizer and planner alike).
"""

from heteroflow.layout.parallel import (ACTIVATION_TIERS, PRECISIONS, RECOMPUTE, STATE_TIERS, ZERO_STAGES, LayoutProblem,
                                        ModelShape, OffloadSpec, ParallelLayout, tp_problems, tp_valid)
from heteroflow.layout.schedule import SCHEDULES, Action, in_flight, max_in_flight, stage_actions
from heteroflow.layout.shards import (counted_once, embedding_params_per_rank, head_params_per_rank, heads_per_rank,
                                      kv_heads_per_rank, layer_params_per_rank, replicates_kv_heads)
from heteroflow.layout.state import GRAD_REDUCE_BYTES, StateBytes, optimizer_shards, state_bytes

__all__ = [
    "ACTIVATION_TIERS", "GRAD_REDUCE_BYTES", "PRECISIONS", "RECOMPUTE", "SCHEDULES", "STATE_TIERS", "ZERO_STAGES",
    "Action", "LayoutProblem",
    "ModelShape", "OffloadSpec", "ParallelLayout", "StateBytes", "counted_once", "embedding_params_per_rank",
    "head_params_per_rank", "heads_per_rank", "in_flight", "kv_heads_per_rank", "layer_params_per_rank",
    "max_in_flight", "optimizer_shards", "replicates_kv_heads", "stage_actions", "state_bytes", "tp_problems", "tp_valid",
]
