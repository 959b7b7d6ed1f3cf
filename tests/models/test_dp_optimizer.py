"""DataParallelAdamW (dp sum, ZeRO-1, grad norm share) and tied-embedding sync across stages."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_ranks
from heteroflow.config import PRESETS
from heteroflow.data import SampleOrder, micro_batch_indices
from heteroflow.layout import ParallelLayout
from heteroflow.layout.state import state_bytes
from heteroflow.models import (DataParallelAdamW, build_stage_model, init_weights, parallelize_stage,
                               shard_of, sync_tied_grads)

SPEC = replace(PRESETS["micro-llama"], num_layers=2, tie_embeddings=True)
HP = dict(betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)  # a large eps keeps Adam's update smooth in the
LR, CLIP = 1e-2, 0.5                                         # gradient, so fp32 reordering stays within tolerance


def _model(first=0, last=2, seed=4):
    model = build_stage_model(SPEC, first_layer=first, last_layer=last, is_first=first == 0, is_last=last == 2)
    init_weights(model, seed=seed)
    return model


def _data(step, n=8):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, SPEC.vocab_size, (n, SPEC.seq_length + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def _reference(steps, n=8):
    """Single process, torch.optim.AdamW, global-norm clipping: the parameters after each step."""
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=LR, foreach=False, **HP)
    history = []
    for step in range(steps):
        x, y = _data(step, n)
        (model(x, y) / y.numel()).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        history.append((norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    return history


def _global_step(opt):
    opt.reduce_grads()
    share = opt.grad_sq_norm_share()
    dist.all_reduce(share)
    norm = share.sqrt().item()
    opt.step(lr=LR, grad_scale=min(1.0, CLIP / (norm + 1e-6)))
    opt.zero_grad()
    return norm


def _check_params(model, expected, where):
    for name, p in model.named_parameters():
        full = expected["embed.weight" if name == "head.weight" else name]
        torch.testing.assert_close(p, shard_of(p).take(full), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


def _tp_dp_check(rank, tp_groups, dp_groups):
    """One stage on 4 ranks, tp 2 x dp 2 (tp innermost), two micro-batches of 4 per step of 8."""
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    dp_rank = rank // 2
    history = _reference(2)
    for zero, layout in ((0, ParallelLayout(tp=2)), (1, ParallelLayout(tp=2, sp=True, recompute="full"))):
        model = parallelize_stage(_model(), layout=layout, tp_group=tp_group)
        init_weights(model, seed=4)
        opt = DataParallelAdamW(model, dp_group=dp_group, tp_group=tp_group, zero=zero, **HP)
        for step, (ref_norm, ref_params) in enumerate(history):
            x, y = _data(step)
            order = torch.arange(8).numpy()
            for m in range(2):
                idx = torch.from_numpy(micro_batch_indices(order, micro_batch_size=4, micro_batch=m, dp=2,
                                                           dp_rank=dp_rank))
                (model(x[idx], y[idx]) / y.numel()).backward()
            norm = _global_step(opt)
            # The share was summed over the world, where tp x dp = 4 ranks hold one stage.
            assert abs(norm - ref_norm) < 1e-5 * ref_norm, (zero, step, norm, ref_norm)
            _check_params(model, ref_params, f"zero={zero} step={step}")


def _tied_pipeline_check(rank, tp_last, dp_first):
    """First stage: ranks 0-1 (dp 2, layer 0); last stage: ranks 2-3 (tp 2, layer 1). Embedding tied."""
    first = rank < 2
    history = _reference(1, n=2)
    x, y = _data(0, n=2)
    if first:
        model = _model(0, 1)
        hidden = model(x[rank:rank + 1])
        for dst in (2, 3):  # the last stage is replicated over its tp ranks: both get every sample
            dist.send(hidden.detach().contiguous(), dst)
        grad = torch.empty_like(hidden)
        dist.recv(grad, 2)
        hidden.backward(grad)
        opt = DataParallelAdamW(model, dp_group=dp_first, zero=1, **HP)
        tp_rank, dp_rank = 0, rank
    else:
        model = parallelize_stage(_model(1, 2), layout=ParallelLayout(tp=2), tp_group=tp_last)
        init_weights(model, seed=4)
        parts = [torch.empty(1, SPEC.seq_length, SPEC.hidden_size) for _ in range(2)]
        for src in (0, 1):
            dist.recv(parts[src], src)
        received = torch.cat(parts).requires_grad_()
        (model(received, y) / y.numel()).backward()
        if rank == 2:  # every tp rank holds the same full input gradient; one of them sends it back
            for dst in (0, 1):
                dist.send(received.grad[dst:dst + 1].contiguous(), dst)
        opt = DataParallelAdamW(model, dp_group=None, tp_group=tp_last, zero=0, **HP)
        tp_rank, dp_rank = rank - 2, 0
    assert model.tied_parameter_names() == (("embed.weight",) if first else ("head.weight",))
    sync_tied_grads(model, group=dist.group.WORLD, tp_rank=tp_rank, dp_rank=dp_rank)
    norm = _global_step(opt)
    ref_norm, ref_params = history[0]
    assert abs(norm - ref_norm) < 1e-5 * ref_norm, (norm, ref_norm)
    _check_params(model, ref_params, "tied")


def _worker(rank, world):
    # Every rank creates every group, in one order (as the runtime will).
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
    print("one stage, tp 2 x dp 2, ZeRO 0 and ZeRO 1 + sp + full recompute", flush=True)
    _tp_dp_check(rank, [groups[0, 1], groups[2, 3]], [groups[0, 2], groups[1, 3]])
    print("tied embedding: first stage dp 2 + ZeRO 1, last stage tp 2", flush=True)
    _tied_pipeline_check(rank, groups[2, 3], groups[0, 1])


@pytest.mark.slow
def test_dp_zero_and_tied_embedding_steps_match_single_process_adamw():
    """One launch for both checks (process start-up dominates on 2 cores); the output names the check."""
    run_ranks(_worker, 4)


def test_adamw_math_matches_torch_single_process():
    model, ref = _model(), _model()
    opt = DataParallelAdamW(model, dp_group=None, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    other = [p for p in ref.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=3e-3,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.reduce_grads()
        expected_sq = sum(q.grad.pow(2).sum() for q in ref.parameters())
        torch.testing.assert_close(opt.grad_sq_norm_share(), expected_sq)
        opt.step(lr=3e-3)
        opt.zero_grad()  # the gradient buffer accumulates until zeroed, as over micro-batches
        torch_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_sample_order_feeds_the_same_samples_to_any_dp_split():
    order = SampleOrder(num_samples=50, global_batch_size=8, seed=1)
    batch = order.global_batch(3)
    for mbs, dp in ((8, 1), (4, 2), (2, 2), (4, 4)):
        seen = [i for m in range(8 // mbs) for d in range(dp)
                for i in micro_batch_indices(batch, micro_batch_size=mbs, micro_batch=m, dp=dp, dp_rank=d)]
        assert sorted(seen) == sorted(batch.tolist())


def test_state_is_what_the_planner_prices_per_parameter():
    """bf16 parameters: 2 bytes each, an fp32 gradient buffer and fp32 master + moments (`state_bytes`);
    fp32 parameters are their own master. Gradients accumulate in fp32 over backwards."""
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        model = _model().to(dtype)
        numel = sum(p.numel() for p in model.parameters())
        opt = DataParallelAdamW(model, dp_group=None, **HP)
        per = state_bytes(precision)
        assert opt.memory_bytes() == {"params": per.weights * numel, "grads": per.grads * numel,
                                      "optimizer": per.optimizer * numel}
        x, y = _data(0, n=2)
        for _ in range(2):  # two micro-batches: the buffer holds their fp32 sum, the parameters no .grad
            model(x, y).backward()
        assert all(p.grad is None for p in model.parameters())
        assert opt.main_grad.dtype == torch.float32 and float(opt.main_grad.abs().sum()) > 0
        opt.reduce_grads()
        opt.step(lr=LR)
        opt.zero_grad()
        assert float(opt.main_grad.abs().sum()) == 0
        if precision == "bf16":  # the parameters are the master rounded to bf16
            torch.testing.assert_close(opt.params.float(), opt.master.to(dtype).float(), rtol=0, atol=0)
        else:
            assert opt.master.data_ptr() == opt.params.data_ptr()

