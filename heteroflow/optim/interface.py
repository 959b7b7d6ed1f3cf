"""`StageOptimizer`: the calls the training loop and the checkpoints make on one rank's optimizer.

Per optimizer step, after every micro-batch's backward (see `heteroflow.models.data_parallel`):

    opt.reduce_grads()                     # partial grads summed over tp, then over dp
    share = opt.grad_sq_norm_share()       # all-reduced over the world: the global squared norm
    opt.step(lr=lr_t, grad_scale=clip / loss_scale)   # left out when a gradient is not finite (step skipped)
    opt.zero_grad()

Checkpoints (`heteroflow.checkpoint.stage_state`) read and write `named_weights`, `load_weights`,
`state_views`, `steps` and `zero`.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol, runtime_checkable

import torch

StateView = tuple[torch.Tensor, int, int, Mapping[str, torch.Tensor]]
"""`(param, start, stop, {"master": t, "exp_avg": t, "exp_avg_sq": t})`: the fp32 state a rank keeps for the
elements `[start, stop)` of the flattened local parameter, each `t` 1-D."""


@runtime_checkable
class StageOptimizer(Protocol):
    """AdamW with fp32 master weights over one rank's share of a stage, gradients summed over the stage's
    tp and dp groups (`DataParallelAdamW`, `OffloadedAdamW`, `models.zero3.Zero3AdamW`)."""

    zero: int
    """The ZeRO stage: 0 when every dp rank keeps all of the state (then dp rank 0 writes it to checkpoints)."""
    steps: int
    """Optimizer steps taken (restored from checkpoints)."""

    def reduce_grads(self) -> None:
        """Sum partial gradients over tp, then the gradients over dp, into the optimizer's fp32 buffers."""

    def grad_sq_norm_share(self) -> torch.Tensor:
        """This rank's part of the global squared gradient norm (each value counted once over the world)."""

    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step (gradients times `grad_scale`: the clip coefficient over the loss scale); the model
        gets the new values."""

    def grad_of(self, param: torch.Tensor) -> torch.Tensor:
        """The writable fp32 tensor holding the gradient accumulated for `param` this step (tied-embedding sync)."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of training state this rank holds on the device: `params`, `grads`, `optimizer` (each the
        most held at once since the optimizer was built)."""

    def zero_grad(self) -> None:
        """Drop the model's gradients and any accumulated from them: the next backward starts from zero (also
        after a skipped step, when `step` was not called)."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """`(name, current value)` of every parameter of the model, wherever it lives."""

    def load_weights(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set every parameter to `values[name]` (shaped like the local shard)."""

    def state_views(self, *, writable: bool = False) -> Iterable[StateView]:
        """The fp32 state this rank keeps, per parameter; with `writable`, what is written into the views is
        stored back (loading a checkpoint)."""
