"""Timing loops shared by the machine and thread measurements (torch is passed in, never imported here).

The device measured is a `heteroflow.devices.Device`: its tensors go on `device.torch_device` and waiting for
its queued kernels is `device.synchronize`, so a CUDA, ROCm or Ascend machine times its own accelerator.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from heteroflow.devices import Device

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


def square_gemm_tflops(torch, device: Device, n: int, dtype, budget_s: float, clock=time.perf_counter) -> float:
    """TFLOP/s of an n x n x n matmul on `device` (timed with `clock`)."""
    a = torch.randn(n, n, device=device.torch_device).to(dtype)
    b = torch.randn(n, n, device=device.torch_device).to(dtype)
    seconds = time_calls(lambda: torch.mm(a, b), budget_s, device.synchronize, clock)
    return 2.0 * n ** 3 / seconds / 1e12
