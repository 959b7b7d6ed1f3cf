"""What a stage's optimizer is to the runtime and the checkpoints, and the AdamW arithmetic every optimizer runs.

Its own package, below `models/` and `offload/`: both optimizers (`models.data_parallel.DataParallelAdamW`,
`offload.stage_optimizer.OffloadedAdamW`) implement the interface and call the arithmetic, and `runtime/`
and `checkpoint/` type against the interface without importing either implementation.
"""

from heteroflow.optim.adamw import adamw_kernel, adamw_step
from heteroflow.optim.interface import StageOptimizer, StateView

__all__ = ["StageOptimizer", "StateView", "adamw_kernel", "adamw_step"]
