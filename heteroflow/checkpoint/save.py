"""Writing one checkpoint from every rank at once: temporary directory, fsync, one atomic rename.

    rank 0: mkdir step-N.tmp-ID/                                   barrier
    every rank: rank-R.safetensors + its index part (fsynced)     barrier
    rank 0: index.json, metadata.json, then the marker; fsync; rename to step-N/; prune   barrier

Each rank checksums its own file (`files.file_digest`, still in the page cache) into its index part; the
index carries them, and the marker, written last, the checksums of the index and the metadata.

`barrier` is any callable that waits for every rank (a `dist.barrier` on the world group, or nothing
in a single process). The checkpoint directory must be one filesystem that every rank sees.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

from heteroflow.checkpoint.files import (CHECKSUM, FORMAT, FORMAT_VERSION, INDEX, MARKER, METADATA, file_digest,
                                         fsync_dir, fsync_file, marker_checksum, prune, publish, rank_file_name,
                                         step_dir_name, write_json)
from heteroflow.checkpoint.pieces import Piece, merge_index_parts, write_index_part, write_rank_file


def save_checkpoint(root: str | os.PathLike, step: int, pieces: list[Piece], metadata: dict, *, rank: int = 0,
                    world_size: int = 1, barrier: Callable[[], None] = lambda: None, scratch_id: str = "0",
                    keep: int | None = None) -> Path:
    """Write this rank's `pieces` into checkpoint `step` (the next step to run) under `root`.

    Every rank calls it at the same point with the same `step` and `scratch_id`; rank 0's `metadata`
    is stored. Returns the final directory once it is complete on disk, after keeping only the `keep`
    newest checkpoints (all of them when None).
    """
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp-{scratch_id}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    checkpoint_id = f"{final.name}.{scratch_id}"  # the same on every rank: tells this save's files from others'
    file_name = rank_file_name(rank)
    entries = write_rank_file(tmp, file_name, pieces, checkpoint_id=checkpoint_id)
    fsync_file(tmp / file_name)
    fsync_file(write_index_part(tmp, rank, file_name, file_digest(tmp / file_name), entries))
    barrier()
    if rank == 0:
        index = merge_index_parts(tmp, world_size)
        write_json(tmp / INDEX, {**index, "step": step, "checkpoint_id": checkpoint_id})
        write_json(tmp / METADATA, {**metadata, "format": FORMAT, "version": FORMAT_VERSION, "step": step,
                                    "world_size": world_size, "checkpoint_id": checkpoint_id,
                                    "files": [rank_file_name(r) for r in range(world_size)]})
        marker = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "checkpoint_id": checkpoint_id,
                  "saved_unix_s": round(time.time(), 3), "checksum": CHECKSUM,
                  "files": {name: file_digest(tmp / name) for name in (INDEX, METADATA)}}
        # The marker goes last: a directory holding it has every other file in place. It covers the index
        # (which covers the rank files) and the metadata, and itself.
        write_json(tmp / MARKER, {**marker, "marker_crc32": marker_checksum(marker)})
        fsync_dir(tmp)
        publish(tmp, final, scratch_id)
        if keep is not None:
            prune(root, keep, scratch_id)
    barrier()
    return final
