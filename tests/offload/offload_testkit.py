"""Shared pieces of the offload tests: the engine fixtures, a small block stack, the swap directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from heteroflow.offload.aio import ENGINE_ENV, deepspeed_aio_module
from heteroflow.offload.optimizer import ADAM_ENV, deepspeed_cpu_adam_module
from heteroflow.offload.swap import SwapDir

REPO = Path(__file__).resolve().parents[2]


def use_aio(kind: str, monkeypatch) -> str:
    """Make stores open engine `kind`; the DeepSpeed one is skipped, with the reason, if its op cannot load."""
    if kind == "deepspeed":
        module, reason = deepspeed_aio_module()
        if module is None:
            pytest.skip(reason)
    monkeypatch.setenv(ENGINE_ENV, kind)
    return kind


def use_adam(kind: str, monkeypatch) -> str:
    """Make StreamedAdamW use `kind`; DeepSpeed's is skipped, with the reason, if its op cannot build."""
    if kind == "deepspeed":
        module, reason = deepspeed_cpu_adam_module()
        if module is None:
            pytest.skip(reason)
    monkeypatch.setenv(ADAM_ENV, kind)
    return kind


@pytest.fixture(params=["threads", "deepspeed"])
def aio_kind(request, monkeypatch):
    """Run the test with each SSD engine."""
    return use_aio(request.param, monkeypatch)


@pytest.fixture
def swap(tmp_path):
    """A swap directory under the test's tmp_path (a real disk here: O_DIRECT works)."""
    with SwapDir(tmp_path / "swap", headroom_bytes=0) as swap_dir:
        yield swap_dir


class Block(nn.Module):
    """A pre-norm residual MLP block: enough to exercise every hook and many parameter shapes."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_blocks(num_blocks: int, hidden: int, seed: int = 0) -> nn.ModuleList:
    """`num_blocks` blocks with seeded weights."""
    torch.manual_seed(seed)
    return nn.ModuleList(Block(hidden) for _ in range(num_blocks))


def block_bytes(block: nn.Module) -> int:
    """Parameter bytes of one block."""
    return sum(p.numel() * p.element_size() for p in block.parameters())
