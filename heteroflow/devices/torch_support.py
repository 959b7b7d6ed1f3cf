"""The torch builds heteroflow runs on, and the features that need a newer one than the oldest.

Vendors ship their own torch builds (Hygon DTK: 2.4.1, 2.5.1, 2.7.1, 2.10; torch_npu: 2.12-2.14; CUDA
machines whatever pip gave them), and one job may mix them, one build per node. heteroflow supports every
torch from `TORCH_FLOOR` on; a feature that needs a newer torch is detected where it is used (by the API
itself, not by the version number: vendor builds backport) and refused by name on a build that lacks it,
with the version that has it. `tools/check_torch_range.sh` trains on the floor build and on a job mixing it
with the newest.
"""

from __future__ import annotations

from types import ModuleType

from heteroflow.errors import UserError

TORCH_FLOOR = "2.4"
"""The oldest torch heteroflow supports (pyproject.toml says the same; Hygon DTK's oldest build is 2.4.1)."""

ZERO3_TORCH = "2.8"
"""The first torch whose FSDP2 has every call ZeRO-3 (`models.zero3`) makes."""

_ZERO3_CALLS = ("fully_shard", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
                "FSDPModule.set_modules_to_forward_prefetch", "FSDPModule.set_gradient_divide_factor",
                "FSDPModule.set_force_sum_reduction_for_comms")
"""FSDP2's public names ZeRO-3 uses: public in `torch.distributed.fsdp` from 2.6, the last two from 2.8 (the sum
over dp of gradients the runtime already scaled: FSDP2 before 2.8 always averaged)."""


PARAMS_OFFLOAD_TORCH = "2.8"
"""The first torch that tells which saved-tensor hooks are active (`offload.params` keeps its hooks beside them)."""


def check_params_offload() -> None:
    """A `UserError` unless this torch has what parameter offload (`offload.params: cpu|ssd`) calls."""
    import torch

    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        raise UserError(f"parameter offload (offload: {{params: cpu|ssd}}) needs torch >= {PARAMS_OFFLOAD_TORCH} (this "
                        f"process has torch {torch.__version__}, which cannot tell which saved-tensor hooks are "
                        "active); run this stage's ranks on a newer torch, or keep its parameters on the device")


def fsdp2_for_zero3() -> ModuleType:
    """`torch.distributed.fsdp` when it has everything ZeRO-3 calls; a `UserError` naming what is missing and
    the torch that has it otherwise."""
    import torch

    try:
        from torch.distributed import fsdp
    except ImportError:  # a torch built without distributed support
        fsdp = None
    missing = [name for name in _ZERO3_CALLS if fsdp is None or not _has(fsdp, name)]
    if missing:
        raise UserError(f"ZeRO-3 (zero: 3) needs torch >= {ZERO3_TORCH} (this process has torch "
                        f"{torch.__version__}, whose torch.distributed.fsdp lacks {', '.join(missing)}); run this "
                        "stage's ranks on a newer torch, or give the stage zero 0, 1 or 2")
    return fsdp


def _has(module: ModuleType, dotted: str) -> bool:
    owner: object = module
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    return True
