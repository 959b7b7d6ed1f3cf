"""One AdamW under every optimizer: `adamw_step` is torch's AdamW, and both stage optimizers are a `StageOptimizer`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from heteroflow.config import PRESETS
from heteroflow.devices.facade import Device
from heteroflow.models import DataParallelAdamW, build_stage_model, init_weights
from heteroflow.offload.optimizer import ADAM_ENV
from heteroflow.offload.policy import OffloadPolicy
from heteroflow.offload.stage_optimizer import OffloadedAdamW
from heteroflow.optim import StageOptimizer, adamw_kernel, adamw_step

SPEC = replace(PRESETS["micro-llama"], num_layers=2)
HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model():
    model = build_stage_model(SPEC, first_layer=0, last_layer=2, is_first=True, is_last=True)
    init_weights(model, seed=4)
    return model


def _torch_adamw(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=lr, **HP)


def test_the_kernel_is_chosen_by_device():
    assert adamw_kernel(torch.device("cpu")) == (False, False)  # torch.optim.AdamW's own choice on the CPU
    assert adamw_kernel(torch.device("cuda", 0)) == (False, True)
    assert adamw_kernel(torch.device("xpu")) == (True, False)


def test_data_parallel_adamw_is_torch_adamw_bit_for_bit_on_the_cpu():
    model, ref = _model(), _model()
    opt = DataParallelAdamW(model, dp_group=None, **HP)
    torch_opt = _torch_adamw(ref, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.reduce_grads()
        opt.step(lr=3e-3)
        opt.zero_grad()  # the gradient buffer accumulates until zeroed
        torch_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("kernel", [(True, False), (False, True)], ids=["foreach", "fused"])
def test_foreach_and_fused_kernels_run_the_same_update(kernel):
    g = torch.Generator().manual_seed(1)
    shapes = [(8, 4), (4,), (3, 5)]
    state = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]  # params, grads
    runs = {}
    for name, chosen in (("plain", (False, False)), ("other", kernel)):
        params = [p.clone() for p in state[0]]
        exp_avgs, exp_avg_sqs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
        for step in (1, 2):
            adamw_step(params, state[1], exp_avgs, exp_avg_sqs, decays=[True, False, True], step=step, lr=1e-2,
                       kernel=chosen, **HP)
        runs[name] = params
    for a, b in zip(runs["plain"], runs["other"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_both_stage_optimizers_are_stage_optimizers(tmp_path, monkeypatch):
    monkeypatch.setenv(ADAM_ENV, "torch")  # no DeepSpeed op build for a check of the interface
    assert isinstance(DataParallelAdamW(_model(), dp_group=None, **HP), StageOptimizer)
    policy = OffloadPolicy(optimizer="cpu", swap_root=str(tmp_path))
    offloaded = OffloadedAdamW(_model(), policy=policy, device=Device.cpu(), dp_group=None, tp_group=None, **HP)
    try:
        assert isinstance(offloaded, StageOptimizer)
    finally:
        offloaded.close()
