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


ADAM_NOISE_FRACTION = 1e-3
"""Of a tensor's elements, the share (at least one) that may differ by more than the tolerance after AdamW steps: an
element whose gradient is at float-noise level moves by up to lr a step whatever the noise's size, so two runs
whose kernels round differently (fused attention, a chunked loss, another tp split) disagree there."""


def assert_weights_close(got: torch.Tensor, want: torch.Tensor, *, tol: float, name: str,
                         noise_atol: float = 1e-3) -> None:
    """`got` equals `want` within `tol` (relative and absolute) but for at most `ADAM_NOISE_FRACTION` of the
    elements, which must still be within `noise_atol` (a fraction of the learning rate a step)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}"
    diff = (got.float() - want.float()).abs()
    outside = int((diff > tol + tol * want.float().abs()).sum())
    allowed = max(1, int(ADAM_NOISE_FRACTION * want.numel()))
    assert outside <= allowed, f"{name}: {outside} of {want.numel()} elements differ by more than {tol:g}"
    worst = float(diff.max()) if diff.numel() else 0.0
    assert worst <= noise_atol, f"{name}: an element differs by {worst:.3g} (> {noise_atol:g})"


def check_against_reference(results, ref_losses, ref_weights: dict[str, torch.Tensor], *, loss_rel: float = 1e-5,
                            weight_tol: float = 1e-4) -> None:
    """Assert that a run's losses (rank 0's) are the one-device reference's within `loss_rel` relative and fall,
    and that its assembled weights are the reference's (a head tied to the embedding across stages equals it)."""
    losses = results[0].losses
    assert len(losses) == len(ref_losses) and losses[-1] < losses[0], losses
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= loss_rel * abs(want), f"step {step}: loss {got} vs reference {want}"
    weights = assemble_weights(results)
    if "head.weight" in weights and "head.weight" not in ref_weights:
        torch.testing.assert_close(weights.pop("head.weight"), weights["embed.weight"], rtol=0, atol=0)
    assert weights.keys() == ref_weights.keys()
    for name, want in ref_weights.items():
        assert_weights_close(weights[name], want, tol=weight_tol, name=name)
