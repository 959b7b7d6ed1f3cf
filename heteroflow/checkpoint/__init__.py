"""Layout-independent checkpoints: every tensor stored as pieces of its logical shape, loadable by any plan.

`files` (directory layout, atomic publication, pruning, safe paths; no torch), `pieces` (safetensors +
JSON index, reading any box), `stage_state` (a stage's model and optimizer state as pieces), `save`
(the multi-rank write protocol), `meta` (metadata and RNG). The runtime's use is in
`heteroflow/runtime/checkpoint.py`, the check before launch in `heteroflow/launcher/prepare.py`.
"""

from heteroflow.checkpoint.files import MARKER, complete_checkpoints, latest_checkpoint, step_dir_name
from heteroflow.checkpoint.verify import (CheckpointDamaged, NoIntactCheckpoint, checkpoint_to_resume, newest_intact,
                                          verify_checkpoint)

__all__ = ["MARKER", "CheckpointDamaged", "NoIntactCheckpoint", "checkpoint_to_resume", "complete_checkpoints",
           "latest_checkpoint", "newest_intact", "step_dir_name", "verify_checkpoint"]
