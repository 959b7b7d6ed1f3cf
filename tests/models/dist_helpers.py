"""A minimal multi-process runner for gloo tests (to be replaced by heteroflow/testing/multiproc.py).

`run_ranks(fn, world_size, *args)` starts one spawned process per rank, joins them into a gloo group
through a FileStore in a fresh temporary directory (no TCP port to pick, so no port races; gloo's own
connections use ephemeral ports), calls `fn(rank, world_size, *args)`, and fails fast: as soon as one
rank fails or the timeout passes, the others are killed and every rank's output is shown.
`fn` must be importable by the child (a module-level function of a test module; pytest's default
"prepend" import mode puts the test directory on sys.path, which spawn passes on to children).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path


def _entry(fn, rank: int, world_size: int, store_file: str, log_file: str, args: tuple) -> None:
    log = open(log_file, "w", buffering=1)
    os.dup2(log.fileno(), 1)  # also capture C++-level warnings from gloo and torch
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share two cores: oversubscribed intra-op threads only slow them down
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        fn(rank, world_size, *args)
        dist.barrier()  # no rank leaves while a peer may still be connecting to a group they share
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        log.flush()
        os._exit(1)
    log.flush()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise with all output on any failure."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hf-ranks-") as tmp:
        logs = [str(Path(tmp, f"rank{r}.log")) for r in range(world_size)]
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(Path(tmp, "store")), logs[r], args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failure = None
        while failure is None and any(p.exitcode is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad:
                failure = f"rank {bad[0]} exited with {procs[bad[0]].exitcode}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s"
            else:
                time.sleep(0.05)
        if failure is None and any(p.exitcode != 0 for p in procs):
            failure = "exit codes " + str([p.exitcode for p in procs])
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        if failure is not None:
            output = "\n".join(f"----- rank {r} -----\n{Path(log).read_text() if Path(log).exists() else ''}"
                               for r, log in enumerate(logs))
            raise AssertionError(f"{fn.__name__} on {world_size} ranks: {failure}\n{output}")
