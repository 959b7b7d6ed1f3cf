"""Run one optimizer step's micro-batches through this rank's stage, in its schedule's order.

Receives block when an action needs their data; sends are asynchronous, with at most two in flight per
direction (the boundary's buffer limit), waited for in the order they were started. Every rank of a
stage runs the same actions in the same order, so the collectives inside the stage line up.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import torch

from heteroflow.runtime.offload_step import activation_context
from heteroflow.runtime.schedule import FORWARD, stage_actions
from heteroflow.runtime.stage import StageRuntime

_MAX_SENDS_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """This rank's share of one micro-batch: token ids and next-token labels, [batch_share, seq]."""

    tokens: torch.Tensor
    labels: torch.Tensor


class _Sends:
    """Outstanding sends of one direction, completed oldest first."""

    def __init__(self) -> None:
        self.pending: deque = deque()

    def start(self, send, tensor: torch.Tensor) -> None:
        """Start `send(tensor)` once fewer than the boundary's limit are in flight."""
        if len(self.pending) == _MAX_SENDS_IN_FLIGHT:
            self.pending.popleft().wait()
        self.pending.append(send(tensor))

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().wait()


def run_pipeline_step(rt: StageRuntime, micro_batches: list[MicroBatch], *, global_tokens: int) -> torch.Tensor:
    """Forward and backward every micro-batch; gradients accumulate in the model (already scaled by
    1 / `global_tokens`, so they sum to the global-batch mean gradient). Returns this rank's summed
    token loss (fp32, zero except on the last stage)."""
    num_stages = len(rt.plan.stages)
    actions = stage_actions(rt.plan.schedule, num_stages, rt.info.stage, len(micro_batches))
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    forward_sends, backward_sends = _Sends(), _Sends()
    loss_sum = torch.zeros((), dtype=torch.float32)
    autocast = (torch.autocast(rt.device.torch_device.type, dtype=rt.autocast_dtype)
                if rt.autocast_dtype is not None else contextlib.nullcontext())
    for action in actions:
        m = action.micro_batch
        if action.kind == FORWARD:
            if rt.is_first:
                x = micro_batches[m].tokens.to(rt.device.torch_device)
            else:
                x = rt.prev.recv_activation().wait().requires_grad_()
            inputs[m] = x
            with autocast, activation_context(rt):
                if rt.is_last:
                    out = rt.model(x, labels=micro_batches[m].labels.to(rt.device.torch_device))
                    loss_sum += out.detach().float().cpu()
                    out = out.float() / global_tokens
                else:
                    out = rt.model(x)
            outputs[m] = out
            if not rt.is_last:
                forward_sends.start(rt.next.send_activation, out.detach().to(rt.activation_dtype))
        else:
            out = outputs.pop(m)
            if rt.is_last:
                out.backward()
            else:
                grad = rt.next.recv_grad().wait()
                out.backward(grad.to(out.dtype))
            x = inputs.pop(m)
            if not rt.is_first:
                backward_sends.start(rt.prev.send_grad, x.grad.to(rt.activation_dtype))
    forward_sends.drain()
    backward_sends.drain()
    assert not inputs and not outputs, "every micro-batch must finish its backward"
    return loss_sum
