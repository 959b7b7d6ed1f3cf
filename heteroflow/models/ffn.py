"""The dense FFN: the MLP of a dense layer, one expert of a MoE layer, or its shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or GELU (w2(gelu(w1 x)), tanh approximation as in GPT-2/3)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, swiglu: bool = True):
        super().__init__()
        h, f = hidden_size, ffn_hidden_size
        self.swiglu = swiglu
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        self.w3 = nn.Linear(h, f, bias=False) if self.swiglu else None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x_BSH)) * self.w3(x_BSH))
        return self.w2(F.gelu(self.w1(x_BSH), approximate="tanh"))
