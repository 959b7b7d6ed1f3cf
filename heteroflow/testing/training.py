"""Emulated training runs for tests and benchmarks: every rank of a plan as a local process, state gathered."""

from __future__ import annotations

import torch

from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing.multiproc import run_ranks


def train_rank(rank: int, world_size: int, args: WorkerArgs):
    """One rank of `run_ranks`: the worker, as `heteroflow train` runs it (the rank comes from the process group)."""
    return run_worker(args)


def run_training(args: WorkerArgs, *, timeout_s: float = 300, env: dict[str, str] | None = None) -> list:
    """Every rank of `args.plan` as a local process; the workers' results, by rank."""
    return run_ranks(train_rank, args.plan.num_devices, args, timeout_s=timeout_s, env=env)


def assemble_weights(results) -> dict[str, torch.Tensor]:
    """The full logical parameters from every rank's shards (workers run with `return_state=True`)."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, (local, shard) in result.state.items():
            shard.take(full.setdefault(name, torch.zeros(shard.full_shape))).copy_(local)
    return full
