"""AdamW for a stage whose routed experts have a layout of their own (ep > 1 or etp != tp).

Expert parameters (`ParamShard.expert`) are replicated over the stage's expert-dp group, not over its tp, cp and
dp ranks: each expert-dp rank processed other tokens for the same expert slices, so their gradients are summed
(and, with ZeRO 1/2, sharded) over expert-dp. Everything else keeps the stage's rules. Two `DataParallelAdamW`
share the model, one per kind of parameter, and this class runs them as one `StageOptimizer`.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from heteroflow.models.data_parallel import DataParallelAdamW
from heteroflow.models.shard import shard_of


def is_expert(param: nn.Parameter) -> bool:
    """Whether `param` belongs to the expert layout (`ParamShard.expert`)."""
    return shard_of(param).expert


class ExpertDataParallelAdamW:
    """Non-expert parameters over `dp_group` (their cp sum is the runtime's, before `reduce_grads`), expert
    parameters over `expert_dp_group` (tp partial sums over `tp_group`, the experts' slices over `etp_group`).
    `cp_rank`: cp ranks hold the same non-expert gradients, counted in the norm on cp rank 0 only."""

    def __init__(self, model: nn.Module, *, dp_group: ProcessGroup | None, tp_group: ProcessGroup | None,
                 expert_dp_group: ProcessGroup | None, etp_group: ProcessGroup | None, cp_rank: int, zero: int = 0,
                 **adam):
        self.model, self.zero, self.cp_rank = model, zero, cp_rank
        self.dense = DataParallelAdamW(model, dp_group=dp_group, tp_group=tp_group, zero=zero,
                                       only=lambda p: not is_expert(p), **adam)
        self.experts = DataParallelAdamW(model, dp_group=expert_dp_group, tp_group=etp_group, zero=zero,
                                         only=is_expert, **adam)
        self._parts = (self.dense, self.experts)

    @property
    def steps(self) -> int:
        return self.dense.steps

    @steps.setter
    def steps(self, value: int) -> None:
        for part in self._parts:
            part.steps = value

    def reduce_grads(self) -> None:
        for part in self._parts:
            part.reduce_grads()

    def grad_sq_norm_share(self) -> torch.Tensor:
        dense = self.dense.grad_sq_norm_share()
        if self.cp_rank != 0:
            dense = dense * 0  # keeps an inf or nan of this rank visible to all
        return dense + self.experts.grad_sq_norm_share()

    def step(self, *, lr: float, grad_scale: float = 1.0) -> None:
        for part in self._parts:
            part.step(lr=lr, grad_scale=grad_scale)

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        return (self.experts if is_expert(param) else self.dense).grad_of(param)

    def dense_grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The gradient of a non-expert parameter (summed over cp by the runtime); None for an expert's."""
        return None if is_expert(param) else self.dense.grad_of(param)

    def memory_bytes(self) -> dict[str, int]:
        dense, experts = self.dense.memory_bytes(), self.experts.memory_bytes()
        return {key: dense[key] + experts[key] for key in dense}

    def zero_grad(self) -> None:
        for part in self._parts:
            part.zero_grad()

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.model.named_parameters()

    def load_weights(self, values) -> None:
        for part in self._parts:
            part.load_weights(values)

    def state_views(self, *, writable: bool = False):
        for part in self._parts:
            yield from part.state_views(writable=writable)
