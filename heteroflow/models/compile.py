"""`train.compile: true`: each decoder block of a stage compiled with `torch.compile` (torchtitan's per-block
compile), so every block of a stage shares one compiled graph and the pipeline, the embedding, the head and the
loss stay eager.

Compiling is lazy (the first forward compiles), so a device without a working compiler (no C++ compiler for the
CPU's inductor backend, no Triton for the GPU's) would fail inside the first step, deep in a traceback.
`compiler_problem` compiles and runs a tiny function on the device first, so the run stops at start with a
`train.compile: ...` error that says what is missing.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from heteroflow.errors import UserError


@cache
def compiler_problem(device_type: str) -> str | None:
    """Why `torch.compile` cannot compile for `device_type` here (None when it can): a tiny function is compiled and
    run on that device, and its output checked."""
    if not hasattr(torch, "compile"):
        return f"this torch ({torch.__version__}) has no torch.compile"
    try:
        x = torch.arange(8.0, device=device_type)
        out = torch.compile(lambda t: torch.sin(t) * 2 + 1, dynamic=False)(x)
        if not torch.allclose(out.cpu(), torch.sin(x.cpu()) * 2 + 1):
            return "the compiled test function computed a wrong result"
    except Exception as error:  # noqa: BLE001 - any failure of the compiler stack is the user's environment
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"{type(error).__name__}: {first_line[:300]}"
    return None


def compile_blocks(model: nn.Module, *, device_type: str, path: str = "train.compile") -> int:
    """Compile each block of `model.layers` in place (`nn.Module.compile`); returns how many. Raises `UserError`
    (`path: message`) where the device's compiler does not work."""
    problem = compiler_problem(device_type)
    if problem is not None:
        hint = ("install a C++ compiler (g++ or clang) for inductor's CPU code" if device_type == "cpu"
                else f"install the compiler torch.compile uses for {device_type} (Triton for CUDA and ROCm)")
        raise UserError(f"{path}: torch.compile cannot compile for the {device_type} device here ({problem}); "
                        f"{hint}, or set {path}: false")
    blocks = list(model.layers.values())
    for block in blocks:
        block.compile()
    return len(blocks)
