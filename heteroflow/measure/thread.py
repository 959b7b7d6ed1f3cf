"""One host CPU thread running heteroflow's code: the `cpu_thread` section of a profile (imports torch lazily).

An emulated rank (`train --emulate`) is a CPU process with a thread or two, so the cost model needs what one
thread does, measured in thread CPU time (`time.thread_time`): a loaded, shared machine still measures what
a core does (wall-clock rates with several threads collapse there, since a thread waiting for a core stalls
every OpenMP barrier). Measured:
- GEMM curves (n x n x n) and causal attention rates by head width, per precision;
- the elementwise rate of heteroflow's decoder block with its projections and attention core replaced by
  identities (large input minus tiny input, so the fixed cost cancels), over the bytes the cost model counts;
- the block's fixed cost (forward and backward on 4 tokens of width 16);
- the real block at one mid-size shape (`REFERENCE_BLOCK`): kernels run slower inside a block than alone,
  and the cost model scales the curves to match it (`stagemap.emulation.in_block_slowdown`).
Every block runs as the runtime runs it: its forward under the runtime's saved-activation meter
(`runtime.memory.SavedActivationMeter`, which counts every tensor autograd saves, at a Python call each), its
parameters in a `DataParallelAdamW`, whose hooks add each backward's gradients into the fp32 gradient
buffer (a Python call per parameter, and bytes the cost model prices: `compute.grad_accumulate_s`); so the
fixed cost and the reference block include what those hooks cost per block.
Each figure is the median of five rounds that each measure everything once (one with --quick).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

from heteroflow.config.model import ModelSpec
from heteroflow.devices import Device
from heteroflow.measure.timing import PROFILE_DTYPES, square_gemm_tflops, time_calls
from heteroflow.stagemap.compute import elementwise_elements
from heteroflow.stagemap.profile import ATTENTION_PROBE_SEQ, ThreadProfile


REFERENCE_BLOCK = {"hidden_size": 192, "ffn_hidden_size": 512, "num_attention_heads": 6, "num_kv_heads": 2,
                   "seq_length": 128, "micro_batch_size": 3}
"""A mid-size emulation shape (GQA, head width 32, 384 tokens) at which the real block is timed."""
_PROBE_HIDDEN, _PROBE_HEADS = 128, 8
"""Shape of the elementwise probe (multi-head, ffn = hidden: identities fit where the projections were)."""


def _no_sync() -> None:
    """CPU kernels are done when they return."""


def measure_cpu_thread(*, quick: bool = False) -> ThreadProfile:
    """One CPU thread running heteroflow's code, timed in thread CPU time (see the module docstring).

    Every figure is the median of rounds that each measure everything once: the machine's speed drifts
    over seconds (other tenants, memory reclaim), and a backward figure is the difference of two timings,
    so one disturbed period would otherwise set a figure, or set the reference block apart from the curves
    it is compared with.
    """
    import torch
    sizes = (16, 64, 256) if quick else (16, 32, 64, 128, 256, 512, 1024)
    head_dims = (16, 64) if quick else (16, 32, 64, 128)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the calling thread then runs every kernel, forward and backward
    try:
        rounds = [_one_round(torch, sizes, head_dims, budget_s=0.02 if quick else 0.05)
                  for _ in range(1 if quick else 5)]
    finally:
        torch.set_num_threads(previous)

    def median(*key) -> float:
        return statistics.median(r[key] for r in rounds)

    return ThreadProfile(
        gemm_tflops={prec: tuple((n, median("gemm", prec, n)) for n in sizes) for prec in PROFILE_DTYPES},
        attention_tflops={prec: tuple((d, median("attention", prec, d), median("attention backward", prec, d))
                                      for d in head_dims) for prec in PROFILE_DTYPES},
        elementwise_gb_per_s=median("elementwise"),
        block_forward_overhead_s=median("overhead"), block_backward_overhead_s=median("overhead backward"),
        reference_block_shape=dict(REFERENCE_BLOCK),
        reference_block_s={prec: (median("reference", prec), median("reference backward", prec))
                           for prec in PROFILE_DTYPES})


def _one_round(torch, sizes: tuple[int, ...], head_dims: tuple[int, ...], *, budget_s: float) -> dict[tuple, float]:
    """Every figure once, keyed by (what, precision, size), (what, precision) or (what,)."""
    cpu = Device.cpu()
    out: dict[tuple, float] = {}
    for prec, name in PROFILE_DTYPES.items():
        dtype = getattr(torch, name)
        for n in sizes:
            out["gemm", prec, n] = square_gemm_tflops(torch, cpu, n, dtype, budget_s, clock=time.thread_time)
        for d in head_dims:
            out["attention", prec, d], out["attention backward", prec, d] = _attention_tflops(torch, d, dtype,
                                                                                              budget_s)
        out["reference", prec], out["reference backward", prec] = _reference_block_s(torch, dtype, budget_s)
    out[("overhead",)], out[("overhead backward",)] = _block_overhead_s(torch, budget_s)
    out[("elementwise",)] = _block_elementwise_gb_per_s(torch, budget_s)
    return out


def _attention_tflops(torch, head_dim: int, dtype, budget_s: float) -> tuple[float, float]:
    """(forward, backward) rates of causal SDPA on one thread, both as the forward's FLOPs per second."""
    import torch.nn.functional as F
    heads, seq = 8, ATTENTION_PROBE_SEQ
    q, k, v = (torch.randn(1, heads, seq, head_dim).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.ones(1, heads, seq, head_dim, dtype=dtype)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        torch.autograd.grad(forward(), (q, k, v), grad)

    forward_s = time_calls(forward, budget_s, _no_sync, time.thread_time)
    backward_s = max(time_calls(both, budget_s, _no_sync, time.thread_time) - forward_s, 1e-9)
    flops = 2.0 * seq * seq * head_dim * heads
    return flops / forward_s / 1e12, flops / backward_s / 1e12


def as_the_runtime_runs(torch, blocks):
    """Set `blocks` up as a training stage holds them: their parameters in the runtime's `DataParallelAdamW`
    (one rank), whose hooks add every backward's gradients into its fp32 buffer. Returns a context factory:
    the saved-tensor hooks of the runtime's activation meter, which every training forward runs under."""
    from heteroflow.models.data_parallel import DataParallelAdamW
    from heteroflow.runtime.memory import SavedActivationMeter
    if not hasattr(blocks, "gradient_buffer"):  # once: a second one would hook every parameter again
        blocks.gradient_buffer = DataParallelAdamW(blocks, dp_group=None)  # kept alive with the blocks
    meter = SavedActivationMeter(torch.device("cpu"))
    meter.exclude_parameters(blocks)
    return lambda: meter.context(contextlib.nullcontext())


def _block_seconds(torch, blocks, shape: tuple[int, ...], budget_s: float, autocast=None) -> tuple[float, float]:
    """(forward, backward) thread seconds of one of `blocks` (a sequence) on an input of `shape`, its forward
    under the runtime's meter hooks and under `torch.autocast(cpu, autocast)` when given, as the runtime runs
    bf16 and fp16."""
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.ones(*shape)
    saving = as_the_runtime_runs(torch, blocks)

    cast = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None else contextlib.nullcontext

    def forward():
        with saving(), cast():
            return blocks(x)

    def both():  # parameter gradients too, added into the fp32 buffer as the runtime's are
        forward().backward(grad)

    forward_s = time_calls(forward, budget_s, _no_sync, time.thread_time)
    both_s = time_calls(both, budget_s, _no_sync, time.thread_time)
    return forward_s / len(blocks), max(both_s - forward_s, 0.0) / len(blocks)


def _block_overhead_s(torch, budget_s: float) -> tuple[float, float]:
    """Forward and backward seconds of heteroflow's decoder block (GQA, SwiGLU, RoPE) on 4 tokens of width 16:
    what every block costs whatever its size."""
    from heteroflow.models.llama import Block
    spec = ModelSpec(num_layers=1, hidden_size=16, ffn_hidden_size=16, num_attention_heads=2, num_kv_heads=1,
                     vocab_size=16, seq_length=4)
    blocks = torch.nn.Sequential(*(Block(spec) for _ in range(4)))
    return _block_seconds(torch, blocks, (1, 4, 16), budget_s)


REFERENCE_IN_FLIGHT = 4
"""Micro-batches whose activations the reference measurement holds at once, as a pipeline stage does."""


def _reference_block_s(torch, dtype, budget_s: float, clock=time.thread_time) -> tuple[float, float]:
    """(forward, backward) seconds of heteroflow's real block at the `REFERENCE_BLOCK` shape, run as a
    pipeline stage runs it: the forwards of `REFERENCE_IN_FLIGHT` micro-batches keep their activations until
    the backwards (fresh memory for each, unlike a loop over one input, which reuses the same buffers).
    Timed by `clock` (thread CPU time unless told)."""
    from heteroflow.models.llama import Block
    shape = dict(REFERENCE_BLOCK)
    batch = shape.pop("micro_batch_size")
    spec = ModelSpec(num_layers=1, vocab_size=16, **shape)
    blocks = torch.nn.Sequential(*(Block(spec) for _ in range(2)))
    grad = torch.ones(batch, spec.seq_length, spec.hidden_size)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    saving = as_the_runtime_runs(torch, blocks)
    forward_s = backward_s = 0.0
    calls = 0
    while calls < 2 or forward_s + backward_s < 2 * budget_s:
        inputs = [torch.randn(*grad.shape, requires_grad=True) for _ in range(REFERENCE_IN_FLIGHT)]
        start = clock()
        with saving(), autocast:
            outputs = [blocks(x) for x in inputs]
        middle = clock()
        for y in outputs:
            y.backward(grad)
        end = clock()
        if calls > 0:  # the first round is a warm-up
            forward_s, backward_s = forward_s + middle - start, backward_s + end - middle
        calls += 1
    per_block = (calls - 1) * REFERENCE_IN_FLIGHT * len(blocks)
    return forward_s / per_block, backward_s / per_block


def _block_elementwise_gb_per_s(torch, budget_s: float) -> float:
    """The elementwise rate of heteroflow's block: the block with its projections and attention core
    replaced by identities, at 512 tokens minus at 4 tokens (which removes the fixed cost), over the bytes
    `compute.elementwise_elements` counts for that difference (the backward counted as twice the forward)."""
    from heteroflow.models.llama import Block
    spec = ModelSpec(num_layers=1, hidden_size=_PROBE_HIDDEN, ffn_hidden_size=_PROBE_HIDDEN,
                     num_attention_heads=_PROBE_HEADS, num_kv_heads=_PROBE_HEADS, vocab_size=16, seq_length=128)
    blocks = torch.nn.Sequential(*(_elementwise_only(Block(spec), torch) for _ in range(4)))
    small = sum(_block_seconds(torch, blocks, (1, 4, _PROBE_HIDDEN), budget_s))
    large = sum(_block_seconds(torch, blocks, (4, 128, _PROBE_HIDDEN), budget_s))
    elements, _ = elementwise_elements(spec, tp=1, sp=False)
    elements += 2 * _PROBE_HIDDEN  # the identity core's contiguous copy of q, which SDPA would not make
    num_bytes = 3 * elements * (4 * 128 - 4) * 4
    return num_bytes / max(large - small, 1e-9) / 1e9


def _elementwise_only(block, torch):
    """`block` with every projection an identity and an attention core that returns its queries."""
    class QueriesOnly(torch.nn.Module):
        def forward(self, q, k, v):
            return q.contiguous()

    for module in (block.attn, block.mlp):
        for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            if getattr(module, name, None) is not None:
                setattr(module, name, torch.nn.Identity())
    block.attn.core = QueriesOnly()
    return block


def measure_thread_speedup(threads: int, *, rounds: int = 5, budget_s: float = 0.1) -> float:
    """How much faster this process runs the fp32 reference block (forward and backward) with `threads` torch
    threads than with one, in wall time: the best of `rounds` rounds of each, alternated (other jobs on a shared
    host only ever slow a round down, and stall several threads far more than one). Between 1 and `threads`:
    on a host to itself, torch leaves a thread idle rather than run slower with it."""
    import torch
    previous = torch.get_num_threads()
    best = {1: math.inf, threads: math.inf}
    try:
        for _ in range(rounds):
            for n in best:
                torch.set_num_threads(n)
                best[n] = min(best[n], sum(_reference_block_s(torch, torch.float32, budget_s, time.perf_counter)))
    finally:
        torch.set_num_threads(previous)
    return min(float(threads), max(1.0, best[1] / best[threads]))
