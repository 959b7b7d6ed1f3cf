"""Before and after a run with SSD offload tiers: room on the swap disk, and directories left by killed ranks.

Each rank makes its own scratch directory under one swap root (`train.offload_dir`, else
`$HETEROFLOW_SWAP_DIR`, else the system temp directory) and removes it when it exits, fails or gets
SIGTERM (`heteroflow.offload.swap.SwapDir`; the root: `heteroflow.runtime.offload_setup.swap_root`).
Here, `heteroflow train` checks before launch that the disk holds every local rank's swap files, and
sweeps after the ranks have exited what a SIGKILL left behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from heteroflow.config import JobConfig, PlanSpec
from heteroflow.errors import UserError
from heteroflow.layout.shards import replicates_kv_heads
from heteroflow.models.llama import build_stage_model
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.swap import DEFAULT_HEADROOM_BYTES, check_not_checkpoint, sweep_stale
from heteroflow.runtime.offload_setup import checkpoint_dirs, swap_root


def swap_bytes(job: JobConfig, plan: PlanSpec, *, node: str | None = None) -> int:
    """Swap file bytes the ranks of `plan` write together (an upper bound, alignment included): every
    rank's, or those of the ranks on node `node`."""
    total = 0
    for k, (stage, (first, last)) in enumerate(zip(plan.stages, plan.layer_ranges())):
        off = stage.layout.offload
        if "ssd" not in (off.optimizer, off.params):
            continue
        with torch.device("meta"):
            model = build_stage_model(job.model, first_layer=first, last_layer=last, is_first=k == 0,
                                      is_last=k == len(plan.stages) - 1)
        chunk = OffloadPolicy.__dataclass_fields__["chunk_numel"].default
        numel = _rank_numel(job, model.named_parameters(), stage.layout.tp)
        per_rank = 0
        lay = stage.layout
        shards = lay.replicas if lay.zero >= 3 else lay.dp if lay.zero else 1  # ZeRO-Offload: 1/dp per rank
        held = -(-numel // shards)
        if off.optimizer == "ssd":  # fp32 master + 2 moments per chunk, each chunk file aligned
            per_rank += 12 * held + 8192 * (held // chunk + last - first + 2)
        if off.params == "ssd" and lay.zero >= 3:  # ZeRO-Infinity: this rank's shard of every unit, aligned
            per_rank += 4 * held + 8192 * (last - first + 3)
        elif off.params == "ssd":  # each block's parameters (this rank's tp shards), aligned
            block_numel = _rank_numel(job, model.layers.named_parameters(), lay.tp)
            per_rank += block_numel * next(model.layers.parameters()).element_size() + 8192 * (last - first)
        ranks = sum(1 for ref in stage.device_refs if node is None or ref.node == node)
        total += per_rank * ranks
    return total


def _rank_numel(job: JobConfig, named_params, tp: int) -> int:
    """Elements one tp rank holds of `named_params` (an upper bound): matrices split over tp (plus one row or
    column for an uneven vocabulary); vectors, and k/v projections when tp exceeds the kv heads, whole."""
    replicated_kv = replicates_kv_heads(job.model, tp)
    numel = 0
    for name, p in named_params:
        whole = tp == 1 or p.dim() < 2 or (replicated_kv and name.endswith(("wk.weight", "wv.weight")))
        numel += p.numel() if whole else -(-p.numel() // tp) + max(p.shape)
    return numel


def check_swap_space(job: JobConfig, plan: PlanSpec, *, node: str | None = None) -> str | None:
    """Before launch: the swap root is outside any checkpoint and its disk has room for the swap files of
    the ranks on this machine (all of the plan's, or node `node`'s); returns the root (None when none of
    them uses the SSD tier)."""
    needed = swap_bytes(job, plan, node=node)
    if not needed:
        return None
    root = Path(swap_root(job))
    check_not_checkpoint(root.resolve(), checkpoint_dirs(job))
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise UserError(f"offload swap directory {root}: {existing} is not a directory; set train.offload_dir "
                        "to a directory on a local disk")
    free = shutil.disk_usage(existing).free
    if needed + DEFAULT_HEADROOM_BYTES > free:
        where = "train.offload_dir" if job.train.offload_dir else "$HETEROFLOW_SWAP_DIR (or the system temp directory)"
        raise UserError(f"not enough free disk space for offload swap files in {root}: the plan's ssd tiers need "
                        f"{needed / 2**30:.2f} GiB ({needed} bytes) plus {DEFAULT_HEADROOM_BYTES / 2**30:.2f} GiB "
                        f"headroom, but only {free / 2**30:.2f} GiB ({free} bytes) is free there; free space, point "
                        f"{where} to a larger disk, or keep those stages' state on cpu")
    return str(root)


def sweep_swap(root: str | None) -> None:
    """After the ranks have exited: remove swap directories left by ranks that were killed (SIGKILL)."""
    if root is not None and os.path.isdir(root):
        sweep_stale(Path(root))
