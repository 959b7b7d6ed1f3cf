"""Run one optimizer step's micro-batches through this rank's stage, in its schedule's order.

Sends are asynchronous, with at most two in flight per direction (the boundary's buffer limit), waited
for in the order they were started. A receive blocks when an action needs its data; it was posted as early as the
link's order allows, so the transfer overlaps the compute in between: over gloo as soon as the previous receive
of its direction arrived; over NCCL and HCCL as soon as it is the link's next message in the stage's order (the
step's first activation, the activations of consecutive forwards, the gradients of consecutive backwards: posted
once the one before arrived), else in one batch with the send before it. A send whose link the next action receives from goes out in one batch with that receive
(`StageBoundary.together`, Megatron's `send_forward_recv_backward` / `send_backward_recv_forward`): NCCL and
HCCL run a communicator's operations in posting order and a send waits for its receive, so stage k's
activation send posted alone could wait on stage k+1, whose gradient send waits on the receive stage k has
not posted yet. Both sides of a link post its messages in the same order, in the same batches. Every rank of a stage runs the same actions in the same order, so the collectives inside
the stage line up.

The step never waits for the device: the micro-batches' tokens and labels go to the device without blocking
(`non_blocking`), and the last stage sums its token losses on the device; the caller reads that sum once per
step, with the other step figures (`runtime/worker.py`).

With a `PartTimer`, the step is timed by part: `forward` and `backward` around each action's compute (less
the tp collectives timed inside, `collective`), `wait` around every receive and around sends that wait for
buffer room or complete at the end: the time the stage is held up by its neighbours.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from heteroflow.backends import StageBoundary
from heteroflow.devices.timing import PartTimer
from heteroflow.layout.schedule import FORWARD, stage_actions
from heteroflow.offload.activations import activation_context as tier_context
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


class _Recvs:
    """The `count` receives of one direction, taken in the order the schedule needs them.

    With `ahead`, each is posted as soon as the previous one arrived (one outstanding at a time, so
    consecutive receives cannot be confused), else only when it is needed.
    """

    def __init__(self, post, count: int, *, ahead: bool):
        self._post, self._left, self._ahead = post, count, ahead
        self._next = self._start() if ahead else None

    def _start(self):
        if not self._left:
            return None
        self._left -= 1
        return self._post()

    def post_next(self) -> None:
        """Post the next receive now unless it is posted already (to go out in one batch with a send)."""
        if self._next is None:
            self._next = self._start()

    def take(self) -> torch.Tensor:
        """Wait for the next receive and return its tensor."""
        handle = self._next or self._start()
        assert handle is not None, "more receives taken than the schedule has"
        tensor = handle.wait()
        self._next = self._start() if self._ahead else None
        return tensor


def activation_context(rt: StageRuntime) -> contextlib.AbstractContextManager:
    """Wrap the stage's forward: its saved activations go to the plan's `offload.activations` tier."""
    return tier_context(rt.stage.layout.offload.activations, rt.device)


def receives_ahead(boundary: StageBoundary) -> bool:
    """Whether receives across `boundary` may be posted before they are needed.

    gloo runs every posted send and receive on its own. NCCL and HCCL run a rank's point-to-point
    operations with a peer in posting order on one stream: a receive posted early would hold back the
    sends posted after it, which the peer may be waiting for before it sends what that receive expects.
    """
    return boundary.link.backend == "gloo"


FORWARD_PART, BACKWARD_PART, WAIT_PART = "forward", "backward", "wait"
"""The `PartTimer` parts a pipeline step is timed as (with `models.tp_ops.COLLECTIVE` inside the first two)."""


def run_pipeline_step(rt: StageRuntime, micro_batches: list[MicroBatch], *, global_tokens: int,
                      loss_scale: float = 1.0, timer: PartTimer | None = None) -> torch.Tensor:
    """Forward and backward every micro-batch; gradients accumulate in the model (already scaled by
    `loss_scale` / `global_tokens`, so they sum to `loss_scale` times the global-batch mean gradient).
    Returns this rank's summed token loss (fp32, unscaled, zero except on the last stage) on the stage's device,
    not read: reading it waits for the device. `timer` times the parts (see the module docstring)."""
    part: Callable[[str], contextlib.AbstractContextManager] = (
        timer.part if timer is not None else lambda name: contextlib.nullcontext())
    num_stages = len(rt.plan.stages)
    actions = stage_actions(rt.plan.schedule, num_stages, rt.info.stage, len(micro_batches))
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    forward_sends, backward_sends = _Sends(), _Sends()
    num_forwards = sum(action.kind == FORWARD for action in actions)
    activations = None if rt.is_first else _Recvs(rt.prev.recv_activation, num_forwards,
                                                   ahead=receives_ahead(rt.prev))
    grads = None if rt.is_last else _Recvs(rt.next.recv_grad, len(actions) - num_forwards,
                                            ahead=receives_ahead(rt.next))
    if activations is not None and actions and actions[0].kind == FORWARD:
        activations.post_next()  # the link's first message of the step (the last one's sends have completed)
    device = rt.device.torch_device
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    autocast = (torch.autocast(rt.device.torch_device.type, dtype=rt.autocast_dtype)
                if rt.autocast_dtype is not None else contextlib.nullcontext())
    for i, action in enumerate(actions):
        m = action.micro_batch
        then = actions[i + 1].kind if i + 1 < len(actions) else None
        if action.kind == FORWARD:
            if rt.is_first:
                x = micro_batches[m].tokens.to(device, non_blocking=True)
            else:
                with part(WAIT_PART):
                    received = activations.take()
                    if then == FORWARD:  # no send on this link before the next forward's activation: post it now
                        activations.post_next()
                # The previous stage sent in its precision; this stage computes (and sends back) in its own.
                x = received.to(rt.activation_dtype).requires_grad_()
            inputs[m] = x
            # The rank's meter counts what the tier leaves on the device (the step record's `memory`).
            with part(FORWARD_PART), autocast, rt.meter.context(activation_context(rt)):
                if rt.is_last:
                    out = rt.model(x, labels=micro_batches[m].labels.to(device, non_blocking=True))
                    loss_sum += out.detach().float()  # on the device: no host sync per micro-batch
                    out = out.float() * loss_scale / global_tokens
                else:
                    out = rt.model(x)
            outputs[m] = out
            if not rt.is_last:
                sent = out.detach().to(rt.activation_dtype)
                with part(WAIT_PART), rt.next.together():
                    forward_sends.start(rt.next.send_activation, sent)
                    if then is not None and then != FORWARD:  # the backward next needs this link's gradient
                        grads.post_next()
        else:
            out = outputs.pop(m)
            if rt.is_last:
                with part(BACKWARD_PART):
                    out.backward()
            else:
                with part(WAIT_PART):
                    grad = grads.take()
                    if then is not None and then != FORWARD:  # nor before the next backward's gradient
                        grads.post_next()
                with part(BACKWARD_PART):
                    out.backward(grad.to(out.dtype))
            x = inputs.pop(m)
            if not rt.is_first:
                sent = x.grad.to(rt.activation_dtype)
                with part(WAIT_PART), rt.prev.together():
                    backward_sends.start(rt.prev.send_grad, sent)
                    if then == FORWARD:  # the forward next needs this link's activation
                        activations.post_next()
    with part(WAIT_PART):
        forward_sends.drain()
        backward_sends.drain()
    assert not inputs and not outputs, "every micro-batch must finish its backward"
    return loss_sum
