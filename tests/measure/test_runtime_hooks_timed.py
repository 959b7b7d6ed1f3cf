"""The profile times heteroflow's blocks as a training stage runs them: the gradients of every timed backward go
through the runtime optimizer's hooks into its fp32 buffer (whose fixed host cost is then in the measured block
overhead, and whose bytes `stagemap.compute.grad_accumulate_s` prices)."""

from __future__ import annotations

import torch

from heteroflow.config.model import ModelSpec
from heteroflow.measure.thread import _block_seconds
from heteroflow.models.llama import Block


def test_the_profile_times_blocks_with_the_runtime_s_gradient_hooks():
    spec = ModelSpec(num_layers=1, hidden_size=16, ffn_hidden_size=16, num_attention_heads=2, num_kv_heads=1,
                     vocab_size=16, seq_length=4)
    blocks = torch.nn.Sequential(Block(spec), Block(spec))
    forward_s, backward_s = _block_seconds(torch, blocks, (1, 4, 16), budget_s=0.05)
    assert forward_s > 0 and backward_s >= 0  # (a difference of two timings: 0 at worst, on a busy machine)
    # The gradients went into the runtime optimizer's fp32 buffer, none was left on a parameter.
    buffer = blocks.gradient_buffer
    assert buffer.main_grad.dtype == torch.float32 and buffer.main_grad.abs().sum() > 0
    assert all(p.grad is None for p in blocks.parameters())
    # Timing the same blocks again (as the elementwise probe does) hooks them no second time.
    _block_seconds(torch, blocks, (1, 4, 16), budget_s=0.05)
    assert blocks.gradient_buffer is buffer and all(p.grad is None for p in blocks.parameters())
