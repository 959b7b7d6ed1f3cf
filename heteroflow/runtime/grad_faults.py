"""A test hook: `HETEROFLOW_INJECT_GRAD=inf@RANK:STEP` (or `nan@RANK:STEP`; several joined by commas) writes
an inf (nan) into one gradient element of plan rank RANK after the backward of step STEP, before any
reduction, as an fp16 overflow would. The loss-scaling tests use it to check that every rank skips that step."""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

ENV_INJECT_GRAD = "HETEROFLOW_INJECT_GRAD"
_VALUES = {"inf": float("inf"), "nan": float("nan")}


def parse_grad_faults(text: str) -> dict[tuple[int, int], float]:
    """`inf@3:2,nan@0:5` -> {(3, 2): inf, (0, 5): nan}."""
    faults = {}
    try:
        for item in text.split(","):
            kind, _, at = item.strip().partition("@")
            rank, _, step = at.partition(":")
            faults[int(rank), int(step)] = _VALUES[kind]
    except (KeyError, ValueError):
        raise ValueError(f"{ENV_INJECT_GRAD}={text!r}: expected inf@RANK:STEP or nan@RANK:STEP, several joined "
                         "by commas") from None
    return faults


@torch.no_grad()
def inject_grad_fault(model: torch.nn.Module, rank: int, step: int,
                      grad_of: Callable[[torch.nn.Parameter], torch.Tensor]) -> None:
    """Poison the first gradient this rank holds (`grad_of(param)`: where the optimizer accumulated it), when the
    environment names this rank and step."""
    text = os.environ.get(ENV_INJECT_GRAD)
    if not text:
        return
    value = parse_grad_faults(text).get((rank, step))
    if value is None:
        return
    for name, param in model.named_parameters():
        grad = grad_of(param) if param.numel() else None
        if grad is not None and grad.numel():
            grad.view(-1)[0] = value
            print(f"heteroflow: injected {value} into {name}'s gradient on rank {rank} at step {step}",
                  file=sys.stderr, flush=True)
            return
