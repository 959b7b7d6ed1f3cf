"""`StageBoundary`: one rank's sends and receives across the boundary between stage k and k+1.

Forward, stage k's output activation (held as stage k's layout) becomes stage k+1's input (held as
stage k+1's layout). Backward, the gradient of that input goes the other way.

Gradient semantics (`grad_replicas`):
- `identical` (default): every tp replica of stage k+1 holds the same full input gradient. That is
  what Megatron's `copy_to_tensor_model_parallel_region` and DTensor's Replicate input both produce:
  the stage's own TP all-reduce runs in its backward. One replica sends each element (stripes shared
  across replicas) and stage k fans it out, so each of its tp ranks gets the full output gradient,
  which is what the backward of its final all-reduce expects.
- `partial`: each replica holds a partial sum (a model that skips that all-reduce); the sum is formed
  inside stage k+1 on its own backend (reduce onto each piece's sender) before crossing.
Under sequence parallelism there are no replicas and both modes move the same bytes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from heteroflow.backends.groups import ProcessGroups
from heteroflow.remap.executor import MAX_PIECES, RemapExecutor, RemapHandle
from heteroflow.remap.plan import SourceReplicas, TransferPlan, plan_transfer

FORWARD_TAGS, BACKWARD_TAGS = 0, MAX_PIECES


class StageBoundary:
    """Activations forward and gradients backward between `src_stage` and `src_stage + 1`, for
    micro-batch activations of logical `shape` `[batch, seq, hidden]`, on this rank. Activations cross in
    `dtype`, gradients in `grad_dtype` (default `dtype`): stages of different precisions each send their own."""

    def __init__(self, groups: ProcessGroups, src_stage: int, *, shape: Sequence[int], dtype: torch.dtype,
                 grad_dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 grad_replicas: SourceReplicas = "identical"):
        rank_map, rank = groups.rank_map, groups.rank
        self.link = groups.link(src_stage)
        self.src_stage = src_stage
        src = rank_map.activation_layout(src_stage, shape)
        dst = rank_map.activation_layout(src_stage + 1, shape)
        self.forward_plan: TransferPlan = plan_transfer(src, dst)
        self.backward_plan: TransferPlan = plan_transfer(dst, src, source_replicas=grad_replicas)
        on_src = rank in src.ranks
        self._forward = RemapExecutor(self.forward_plan, rank=rank, transport=self.link.transport, dtype=dtype,
                                      device=device, fanout_group=None if on_src else groups.fanout,
                                      tag_base=FORWARD_TAGS)
        self._backward = RemapExecutor(self.backward_plan, rank=rank, transport=self.link.transport,
                                       dtype=grad_dtype if grad_dtype is not None else dtype,
                                       device=device, fanout_group=groups.fanout if on_src else None,
                                       reduce_group=None if on_src else groups.fanout, tag_base=BACKWARD_TAGS)
        self.is_sender = on_src
        """True on stage k's ranks (send activations, receive gradients), False on stage k+1's."""

    def send_activation(self, activation: torch.Tensor) -> RemapHandle:
        """Stage k: start sending this rank's share of the output activation."""
        self._expect(True, "send_activation")
        return self._forward.start(activation)

    def recv_activation(self, *, out: torch.Tensor | None = None) -> RemapHandle:
        """Stage k+1: post the receive of this rank's input share; `wait()` returns it."""
        self._expect(False, "recv_activation")
        return self._forward.start(out=out)

    def send_grad(self, grad: torch.Tensor) -> RemapHandle:
        """Stage k+1: start sending this rank's share of the input gradient."""
        self._expect(False, "send_grad")
        return self._backward.start(grad)

    def recv_grad(self, *, out: torch.Tensor | None = None) -> RemapHandle:
        """Stage k: post the receive of this rank's output-gradient share; `wait()` returns it."""
        self._expect(True, "recv_grad")
        return self._backward.start(out=out)

    def together(self):
        """`with boundary.together():` the sends and receives started inside go out as one batch (one NCCL group
        call on a direct link; nothing changes on a gloo bridge)."""
        return self.link.transport.together()

    def _expect(self, sender: bool, what: str) -> None:
        if sender != self.is_sender:
            side = f"stage {self.src_stage}" if sender else f"stage {self.src_stage + 1}"
            raise RuntimeError(f"{what} runs on {side}'s ranks; this rank is on the other side of boundary "
                               f"{self.src_stage}->{self.src_stage + 1}")
