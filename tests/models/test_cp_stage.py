"""Context parallel stages vs the unsharded stage (loss, logits, input and weight gradients), and the
blockwise attention kernels vs PyTorch's SDPA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from heteroflow.config import PRESETS
from heteroflow.layout import ParallelLayout
from heteroflow.models import all_reduce_partial_grads, build_stage_model, init_weights, materialize, \
    parallelize_stage, shard_of
from heteroflow.models.context_parallel import all_reduce_cp_grads, local_positions, split_sequence
from heteroflow.models.cp_attention import Kernel, attend, attend_backward, choose_kernel
from heteroflow.testing.multiproc import run_ranks

BASE = replace(PRESETS["micro-llama"], num_layers=2)  # 4 heads, 2 kv heads, hidden 64, seq 32, vocab 256
SEED = 5


@pytest.mark.parametrize("math_kernel", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_match_sdpa_forward_and_backward(math_kernel, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref.backward(dout)
    with torch.no_grad():
        out, lse = attend(q, k, v, causal=causal, math_kernel=math_kernel)
        grads = attend_backward(dout, q, k, v, out, lse, causal=causal, math_kernel=math_kernel)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)


def _gqa_block(device: str, dtype: torch.dtype, causal: bool, q_len: int = 8):
    """A grouped-query block (4 query heads over 2 kv heads) with keys longer than queries when not causal;
    SDPA on K/V repeated to the query heads is the reference."""
    g = torch.Generator().manual_seed(0)
    k_len = q_len if causal else 3 * q_len
    q = torch.randn(2, 4, q_len, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, k_len, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, q_len, 16, generator=g, dtype=torch.float64)
    q, k, v, dout = (t.to(device, dtype).requires_grad_(t is not dout) for t in (q, k, v, dout))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal)
    ref.backward(dout)
    return q, k, v, dout, ref


@pytest.mark.parametrize("kernel", [Kernel.CPU, Kernel.MATH])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_blocks_match_sdpa_on_repeated_kv(kernel, causal):
    """The fused CPU kernel takes kv heads as they are; gradients come back at the kv heads (fp32 and bf16)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v, dout, ref = _gqa_block("cpu", dtype, causal)
        with torch.no_grad():
            out, lse = attend(q, k, v, causal=causal, kernel=kernel)
            grads = attend_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        for got, want in zip(grads, (q.grad, k.grad, v.grad)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_flash_blocks_match_the_math_reference(causal):
    q, k, v, dout, ref = _gqa_block("cuda", torch.bfloat16, causal, q_len=128)
    if choose_kernel(q) is not Kernel.CUDA:
        pytest.skip("this device has no flash kernel")
    with torch.no_grad():
        fused = attend(q, k, v, causal=causal, kernel=Kernel.CUDA)
        math_ = attend(q, k, v, causal=causal, kernel=Kernel.MATH)
        torch.testing.assert_close(fused[0], math_[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fused[1], math_[1], rtol=1e-3, atol=1e-3)
        for got, want in zip(attend_backward(dout, q, k, v, *fused, causal=causal, kernel=Kernel.CUDA),
                             attend_backward(dout, q, k, v, *math_, causal=causal, kernel=Kernel.MATH)):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_split_sequence_and_positions_follow_the_load_balanced_chunks():
    x = torch.arange(16).view(1, 16)
    assert split_sequence(x, cp=2, cp_rank=0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_sequence(x, cp=2, cp_rank=1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert local_positions(8, cp=2, cp_rank=1).tolist() == list(range(4, 12))
    with pytest.raises(ValueError, match="does not split into 2 \\* cp = 6 chunks"):
        split_sequence(torch.zeros(1, 8), cp=3, cp_rank=0)


def _build(spec, *, layout=None, tp_group=None, cp_group=None):
    with torch.device("meta" if layout is not None else "cpu"):
        model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    if layout is not None:
        parallelize_stage(model, layout=layout, tp_group=tp_group, cp_group=cp_group)
        materialize(model, "cpu")
    init_weights(model, seed=SEED)
    return model


def _compare(rank: int, world_size: int, spec, layout: ParallelLayout, math_kernel: bool) -> None:
    """Ranks are cp-major with tp inside (the plan's order); every rank checks its share of the reference."""
    tp, cp = layout.tp, layout.cp
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    cp_rank, tp_rank = divmod(rank, tp)
    ref = _build(spec)
    model = _build(spec, layout=layout, tp_group=tp_groups[cp_rank], cp_group=cp_groups[tp_rank])
    if math_kernel:
        from heteroflow.models import cp_attention
        for block in model.layers.values():
            block.attn.core.forward = lambda q, k, v, g=block.attn.core.group: \
                cp_attention.context_parallel_attention(q, k, v, g, math_kernel=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length + 1), generator=g)
    x, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    loss_ref = ref(x, labels)
    loss_ref.backward()
    local = lambda t: split_sequence(t, cp=cp, cp_rank=cp_rank)
    loss = model(local(x), local(labels))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_groups[tp_rank])  # each cp rank's loss is that of its tokens
    torch.testing.assert_close(total, loss_ref.detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(local(x)), local(ref(x)), rtol=1e-5, atol=1e-5)
    all_reduce_cp_grads(model, cp_groups[tp_rank])
    all_reduce_partial_grads(model, tp_groups[cp_rank])
    reference = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        expected = shard_of(p).take(reference[name].grad)
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-5 * max(1.0, expected.abs().max().item()),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("layout, spec, math_kernel", [
    (ParallelLayout(cp=2), BASE, False),
    (ParallelLayout(cp=2), replace(BASE, position_embedding="learned", qk_norm=True), True),
    (ParallelLayout(cp=2, tp=2), BASE, False),
    (ParallelLayout(cp=2, tp=2, sp=True, recompute="selective"), BASE, False),
], ids=["cp2", "cp2-learned-positions-math", "cp2-tp2", "cp2-tp2-sp-selective"])
def test_context_parallel_stage_matches_the_unsharded_stage(layout, spec, math_kernel):
    run_ranks(_compare, layout.num_devices, spec, layout, math_kernel, timeout_s=180)


def _cp_long_sequence(rank: int, world_size: int, seq: int) -> list[tuple[str, int, dict]]:
    """Per precision: the runtime meter's peak of saved activations over one forward and backward of a cp 2 stage
    (micro-llama widths, 2 blocks, one sequence of `seq` tokens) and the planner's figures for that stage."""
    import contextlib

    from heteroflow.runtime.memory import SavedActivationMeter
    from heteroflow.stagemap.memory import stage_memory_bytes

    spec = replace(BASE, seq_length=seq)
    layout = ParallelLayout(cp=2)
    tokens = torch.randint(0, spec.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    x, labels = (split_sequence(t, cp=2, cp_rank=rank) for t in (tokens[:, :-1], tokens[:, 1:]))
    out = []
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = _build(spec, layout=layout, cp_group=dist.group.WORLD).to(dtype)
        meter = SavedActivationMeter(torch.device("cpu"))
        meter.exclude_parameters(model)
        with meter.context(contextlib.nullcontext()):
            loss = model(x, labels)
        loss.backward()
        planned = stage_memory_bytes(spec, layout, precision=precision, micro_batch_size=1, schedule="1f1b",
                                     num_stages=1, stage=0, num_micro_batches=1, layers=spec.num_layers)
        out.append((precision, meter.peak_bytes, planned))
    return out


@pytest.mark.slow
def test_cp2_at_8192_tokens_saves_what_the_planner_prices():
    """Activation memory per rank is O(s / cp), as the planner's flash-attention figure: the fused kernels keep
    each rank's own q, k, v, output and log-sum-exp, never a score matrix or the other rank's K/V. The planner's
    figure (blocks' activations, rope tables, logits and their gradient; `stagemap.memory`) is within 10% of the
    runtime meter's peak (`runtime.memory.SavedActivationMeter`, what the memory-truth tests read), both with and
    without the backward's re-gathered K/V transient that the meter, counting saved tensors, cannot see."""
    from heteroflow.stagemap.costs import context_parallel_working_bytes
    from heteroflow.stagemap.memory import dtype_bytes

    seq = 8192
    for rank_rows in run_ranks(_cp_long_sequence, 2, seq, timeout_s=600):
        for precision, measured, planned in rank_rows:
            total = planned["activations"] + planned["transient"]
            unseen = context_parallel_working_bytes(replace(BASE, seq_length=seq), tokens=seq / 2, tp=1, cp=2,
                                                    dtype_bytes=dtype_bytes(precision))
            where = f"{precision}: measured {measured}, planned {total:.0f}, unseen {unseen:.0f}"
            assert measured == pytest.approx(total, rel=0.10), where
            assert measured == pytest.approx(total - unseen, rel=0.10), where
