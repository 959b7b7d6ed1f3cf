"""The AdamW update under every optimizer of heteroflow: torch's functional AdamW.

`DataParallelAdamW` (flat fp32 buffers on the device) and `StreamedAdamW` (state streamed from cpu or ssd)
both step through `adamw_step`, so they run the same arithmetic with the same kernel on a given device;
on the CPU they agree bit for bit with each other and with `torch.optim.AdamW`, which the single-process
reference trainer uses. (`StreamedAdamW` may instead run
DeepSpeedCPUAdam on the host, a different rounding it chooses by itself: `HETEROFLOW_CPU_ADAM`.)
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.optim.adamw import adamw as torch_adamw
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices


def adamw_kernel(device: torch.device) -> tuple[bool, bool]:
    """`(foreach, fused)` for tensors on `device`: torch's fused AdamW on CUDA (ROCm included), the foreach
    kernels where torch has them, else one update per tensor. The CPU keeps the per-tensor path: it is what
    `torch.optim.AdamW` runs there by default, so the CPU trains bit for bit like the reference."""
    if device.type == "cuda":
        return False, True
    return device.type in _get_foreach_kernels_supported_devices(), False


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], *, decays: Sequence[bool], step: int, lr: float,
               betas: tuple[float, float], eps: float, weight_decay: float,
               kernel: tuple[bool, bool] | None = None) -> None:
    """One AdamW step, in place, on fp32 tensors of one device (decoupled weight decay on those with
    `decays[i]`); `step` counts this update (1 for the first). `kernel` overrides `adamw_kernel` (tests)."""
    if not params:
        return
    foreach, fused = kernel if kernel is not None else adamw_kernel(params[0].device)
    for decay in (True, False):
        chosen = [i for i, d in enumerate(decays) if d == decay]
        if not chosen:
            continue
        # torch counts the step in these tensors (it increments them first); fused wants them on the device, the
        # others on the host (made without a device: host memory, so reading them waits for no device)
        steps = [torch.tensor(float(step - 1), device=params[i].device if fused else None) for i in chosen]
        torch_adamw([params[i] for i in chosen], [grads[i] for i in chosen], [exp_avgs[i] for i in chosen],
                    [exp_avg_sqs[i] for i in chosen], [], steps, foreach=foreach, fused=fused, capturable=False,
                    differentiable=False, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False,
                    beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=weight_decay if decay else 0.0, eps=eps,
                    maximize=False)
