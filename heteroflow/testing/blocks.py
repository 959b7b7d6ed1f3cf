"""A small residual MLP block stack for the offload tests and benchmarks (no Transformer needed)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual MLP block (8h^2 + 7h parameters), the FLOP- and byte-heavy half of a Transformer
    layer; enough to exercise every offload hook and several parameter shapes."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def make_blocks(num_blocks: int, hidden: int, seed: int = 0) -> nn.ModuleList:
    """`num_blocks` blocks with seeded weights."""
    torch.manual_seed(seed)
    return nn.ModuleList(Block(hidden) for _ in range(num_blocks))


def block_bytes(block: nn.Module) -> int:
    """Parameter bytes of one block."""
    return sum(p.numel() * p.element_size() for p in block.parameters())
