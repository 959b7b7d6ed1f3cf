"""Timing loops shared by the machine and thread measurements (torch is passed in, never imported here)."""

from __future__ import annotations

import time

PROFILE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Precisions the profile measures, and their torch dtype names."""


def time_calls(fn, budget_s: float, sync, clock=time.perf_counter) -> float:
    """Seconds (of `clock`) per call of `fn`, repeated for about `budget_s` after a warm-up."""
    fn()
    sync()
    calls, start = 0, clock()
    while True:
        fn()
        calls += 1
        if calls % 2 == 0:
            sync()
            elapsed = clock() - start
            if elapsed >= budget_s:
                return elapsed / calls


def sync_for(torch, device):
    """A function that waits for `device`'s queued kernels (nothing to wait for on CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def square_gemm_tflops(torch, device, n: int, dtype, budget_s: float, clock=time.perf_counter) -> float:
    """TFLOP/s of an n x n x n matmul (timed with `clock`)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = time_calls(lambda: torch.mm(a, b), budget_s, sync_for(torch, device), clock)
    return 2.0 * n ** 3 / seconds / 1e12
