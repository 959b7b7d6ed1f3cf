"""Apply a stage's intra-operator layout (tp, sp, cp, recompute) to a `StageModel`, in place.

Layout contract (what the pipeline and the remap code rely on), for a stage with tp group of size T:
  * without sp, activations entering and leaving the stage are replicated over tp: every tp rank
    gets the full [batch, seq, hidden] input and returns the full output, and after backward every
    tp rank holds the same full input gradient;
  * with sp, tp rank r gets and returns sequence chunk r ([batch, seq / T, hidden]) and its input
    gradient is the gradient of that chunk;
  * the first stage takes the full token ids on every tp rank; the last stage takes full labels and
    returns the summed loss of the whole micro-batch share, equal on every tp rank;
  * with cp, "full" above means this cp rank's two sequence chunks (`context_parallel.py`): token
    ids, labels and activations hold those tokens only, and the loss is that of those tokens.

What is split (Megatron-LM's scheme): wq / wk / wv / w1 / w3 by output rows (column-parallel), wo / w2
by input columns (row-parallel), embedding and head by vocabulary rows (`vocab_parallel.py`, uneven
pieces rather than padding). When tp exceeds the kv heads, wk / wv stay whole on every rank and each
rank computes only the kv head its query heads use; their gradient is then partial, like that of
norms under sp and of q/k norms: `ParamShard.partial_grad` marks them and
`data_parallel.all_reduce_partial_grads` sums them over tp once per step. Collectives sit at the
entry and exit of each attention and MLP block (one all-reduce, or all-gather + reduce-scatter with
sp, per block and direction), as forward hooks: the model code never sees them.

Why Megatron-style autograd functions on explicit process groups, not DTensor `parallelize_module`:
tried first (torch 2.13 CPU, gloo, 4 ranks = two stages, each with its own tp=2 sub-mesh from
`DeviceMesh.from_group(stage_tp_group, "cpu")`, torchtitan's Colwise / Rowwise / SequenceParallel /
PrepareModuleInput plan on tiny-llama's 8 blocks). DTensor does work on per-stage sub-meshes: outputs
and input gradients matched the unsharded blocks with and without sp. It was not chosen because:
  1. grouped-query attention with tp > num_kv_heads (which the planner allows, e.g. 8 kv heads at
     tp 16) failed: Colwise splits a kv head's rows between ranks ("shape [4, 128, -1, 16] is invalid");
     kv heads have to be replicated and sliced by a custom module either way;
  2. the vocabulary-parallel loss needs `loss_parallel()` active around the forward *and* around
     the pipeline's backward (which the runtime drives with received gradients), and a vocabulary
     that tp does not divide needs padded shards; here it is one autograd function on plain tensors;
  3. overhead: forward + backward of the 8 blocks (batch 4 x 128 tokens, hidden 128), median of 6,
     both variants alternating in the same processes (benchmarks/tp_dtensor_vs_functions.py):
     DTensor took 1.4-1.9x as long: 200 vs 278 ms and 340 vs 582 ms on 2 ranks, 421 vs 745 ms on 4
     ranks (two stages), 495 vs 964 ms with sp; at 512 tokens 780 vs 1001 ms. Per-op DTensor
     dispatch adds a roughly fixed cost per block, which matters for small CPU-emulated stages and
     fades with size (the machine was shared, load 6-10 on 2 cores: trust the ratios, not the ms);
  4. these functions need only all_reduce / all_gather_into_tensor / reduce_scatter_tensor from the
     group's backend (gloo, nccl, hccl), whereas DTensor on Ascend depends on torch_npu's
     privateuse1 DTensor support, which cannot be tested here.
Plain tensors also keep the stage boundary simple: what goes to remap/ is a local tensor with the
layout above, never a DTensor that the other stage's mesh would not know.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from heteroflow.layout import RECOMPUTE, ModelShape, ParallelLayout
from heteroflow.layout.shards import heads_per_rank, kv_heads_per_rank, local_experts, replicates_kv_heads
from heteroflow.models.context_parallel import apply_context_parallel
from heteroflow.models.ffn import FeedForward
from heteroflow.models.llama import Attention, AttentionCore, Block, StageModel
from heteroflow.models.moe import MoE
from heteroflow.models.moe_dispatch import AllToAllDispatcher, gather_rows, row_share, split_rows
from heteroflow.models.shard import ParamShard, even_split, set_shard, shard_of
from heteroflow.models.tp_ops import (all_gather_dim, all_reduce_sum, copy_to_tp, gather_seq, reduce_from_tp,
                                      reduce_scatter_seq)
from heteroflow.models.vocab_parallel import VocabParallelEmbedding, VocabParallelHead

def parallelize_stage(model: StageModel, *, layout: ParallelLayout, tp_group: ProcessGroup | None = None,
                      cp_group: ProcessGroup | None = None, ep_group: ProcessGroup | None = None,
                      token_group: ProcessGroup | None = None) -> StageModel:
    """Shard `model` over `tp_group`, split its sequence over `cp_group`, spread its experts over `ep_group`
    per `layout` and set up recompute; returns the same module. `token_group`: the ranks holding parts of one
    micro-batch (the stage under sp, else the cp x dp replicas; None when one rank holds it), over which MoE
    layers pool their load-balancing statistics.

    Works on real or meta parameters; values already present are sliced, so initializing before or
    after gives the same weights.
    """
    problems = layout.validate(model.spec)
    if problems:
        raise ValueError("; ".join(f"{p.key}: {p.message}" for p in problems))
    tp = layout.tp
    if tp > 1:
        if tp_group is None or dist.get_world_size(tp_group) != tp:
            raise ValueError(f"layout has tp {tp}, but the tp group has "
                             f"{None if tp_group is None else dist.get_world_size(tp_group)} ranks")
        _apply_tensor_parallel(model, tp_group, sp=layout.sp)
    if layout.cp > 1:
        if cp_group is None or dist.get_world_size(cp_group) != layout.cp:
            raise ValueError(f"layout has cp {layout.cp}, but the cp group has "
                             f"{None if cp_group is None else dist.get_world_size(cp_group)} ranks")
        apply_context_parallel(model, cp_group)
    if layout.ep > 1 and (ep_group is None or dist.get_world_size(ep_group) != layout.ep):
        raise ValueError(f"layout has ep {layout.ep}, but the ep group has "
                         f"{None if ep_group is None else dist.get_world_size(ep_group)} ranks")
    for block in model.layers.values():
        if isinstance(block.mlp, MoE):
            _parallelize_moe(block.mlp, layout=layout, tp_group=tp_group if tp > 1 else None, ep_group=ep_group,
                             token_group=token_group, cp_group=cp_group if layout.cp > 1 else None)
    apply_recompute(model, layout.recompute)
    return model


def _apply_tensor_parallel(model: StageModel, group: ProcessGroup, *, sp: bool) -> None:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    spec = model.spec
    for block in model.layers.values():
        _shard_attention(block.attn, spec, tp, rank)
        tp_regions: list[nn.Module] = [block.attn]
        if not isinstance(block.mlp, MoE):  # MoE layers: `_parallelize_moe`
            _shard_mlp(block.mlp, tp, rank)
            tp_regions.append(block.mlp)
        for module in tp_regions:
            module.register_forward_pre_hook(_enter_hook(group, sp))
            module.register_forward_hook(_leave_hook(group, sp))
        if sp:  # norms see only this rank's tokens
            _mark_partial(block.attn_norm, block.mlp_norm)
    if model.norm is not None and sp:
        _mark_partial(model.norm)
    if model.pos_embed is not None and sp:
        _mark_partial(model.pos_embed)
        model.pos_embed.register_forward_hook(lambda module, args, out: out.chunk(tp, dim=0)[rank])
    sizes = [even_split(spec.vocab_size, tp, r)[1] for r in range(tp)]
    vocab_start = sum(sizes[:rank])
    tied_here = model.embed is not None and model.head is not None and model.head.weight is model.embed.weight
    if model.embed is not None:
        weight = _sliced(model.embed.weight, 0, vocab_start, sizes[rank])
        model.embed = VocabParallelEmbedding(weight, vocab_start=vocab_start, group=group, sp=sp)
    if model.head is not None:
        weight = model.embed.weight if tied_here else _sliced(model.head.weight, 0, vocab_start, sizes[rank])
        model.head = VocabParallelHead(weight, vocab_start=vocab_start, shard_sizes=sizes, group=group, sp=sp)


def _shard_attention(attn: Attention, spec: ModelShape, tp: int, rank: int) -> None:
    d, num_kv_heads = attn.head_dim, spec.num_kv_heads
    q_rows = heads_per_rank(spec, tp) * d
    _shard_linear(attn.wq, 0, rank * q_rows, q_rows)
    _shard_linear(attn.wo, 1, rank * q_rows, q_rows)
    if not replicates_kv_heads(spec, tp):
        kv_rows = kv_heads_per_rank(spec, tp) * d
        _shard_linear(attn.wk, 0, rank * kv_rows, kv_rows)
        _shard_linear(attn.wv, 0, rank * kv_rows, kv_rows)
    else:  # tp > kv heads: this rank's query heads all use kv head (rank * kv_heads // tp)
        kv_head = rank * num_kv_heads // tp
        attn.wk = KVHeadSlice(attn.wk, kv_head * d, d)
        attn.wv = KVHeadSlice(attn.wv, kv_head * d, d)
    if attn.q_norm is not None:  # shared over heads, and each rank sees only its heads
        _mark_partial(attn.q_norm, attn.k_norm)


def _shard_mlp(mlp: FeedForward, tp: int, rank: int) -> None:
    rows = mlp.w1.out_features // tp
    for column_parallel in (mlp.w1, mlp.w3):
        if column_parallel is not None:
            _shard_linear(column_parallel, 0, rank * rows, rows)
    _shard_linear(mlp.w2, 1, rank * rows, rows)


def _parallelize_moe(moe: MoE, *, layout: ParallelLayout, tp_group: ProcessGroup | None,
                     ep_group: ProcessGroup | None, token_group: ProcessGroup | None,
                     cp_group: ProcessGroup | None = None) -> None:
    """Keep this ep rank's experts (global names kept), split them over etp and the shared expert over tp, and
    put the collectives around them.

    The router and the shared expert's gate stay whole and outside the tp regions. Without sp they see the
    replicated tokens, and the routing weights enter the experts' region through `copy_to_tp` (or `split_rows`),
    whose backward completes their gradient on every tp rank, so they need no `partial_grad` mark; under sp they
    see this rank's sequence chunk and their gradients are partial over tp. The load-balancing statistics are
    pooled over `token_group` (`Router.pool`), per-sequence ones over `cp_group` (`Router.sequence_pool`: the cp
    ranks hold chunks of the same sequences; the layout rules refuse the sequence loss under sp).

    The routed experts' region, by expert layout (etp is tp or 1; the layout rules refuse the rest):
      * etp = tp: experts split like the dense MLP; each rank of a tp group dispatches the same tokens to the
        same slices, so the region is entered as a dense MLP's: replicated rows (gathered rows under sp), and the
        partial outputs summed over tp after the tokens came back (reduce-scattered under sp);
      * etp = 1: whole experts; without sp each tp rank dispatches its share of the replicated rows (`split_rows`)
        and the outputs are gathered back (`gather_rows`); under sp the rows are already distinct.
    With ep > 1 the tokens reach the experts of other ranks through `AllToAllDispatcher` on `ep_group`.
    """
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    if token_group is not None:
        moe.router.pool = partial(all_reduce_sum, group=token_group)
    if cp_group is not None:
        moe.router.sequence_pool = partial(all_reduce_sum, group=cp_group)
    if layout.sp and tp > 1:
        _mark_partial(moe.router, *([moe.shared_expert_gate] if moe.shared_expert_gate is not None else []))
    held = local_experts(moe.experts.num_experts, layout.ep, ep_rank)
    for key in [key for key in moe.experts.keys() if int(key) not in held]:
        del moe.experts[key]
    for expert in moe.experts.values():
        if layout.expert_tp > 1:
            _shard_mlp(expert, tp, tp_rank)
        if layout.separate_experts:
            for param in expert.parameters():
                set_shard(param, replace(shard_of(param), expert=True))
    if layout.ep > 1:
        moe.experts.dispatcher = AllToAllDispatcher(ep_group, num_experts=moe.experts.num_experts)
    if tp_group is None:
        return
    if layout.expert_tp == tp:
        moe.experts.register_forward_pre_hook(_enter_experts_hook(tp_group, layout.sp))
        moe.experts.register_forward_hook(_leave_rows_hook(tp_group, layout.sp))
    elif not layout.sp:
        moe.experts.register_forward_pre_hook(_split_experts_rows_hook(tp_group))
        moe.experts.register_forward_hook(lambda module, args, out: gather_rows(out, tp_group, module.num_rows))
    if moe.shared_expert is not None:
        _shard_mlp(moe.shared_expert, tp, tp_rank)
        moe.shared_expert.register_forward_pre_hook(_enter_rows_hook(tp_group, layout.sp))
        moe.shared_expert.register_forward_hook(_leave_rows_hook(tp_group, layout.sp))


def _enter_rows_hook(group: ProcessGroup, sp: bool):
    """Before a tp region on token rows `[T, H]`: replicated rows (all-gathered rows under sp)."""
    def hook(module, args):
        x = gather_seq(args[0][None], group)[0] if sp else copy_to_tp(args[0], group)
        return (x, *args[1:])
    return hook


def _leave_rows_hook(group: ProcessGroup, sp: bool):
    """After a tp region on token rows: the partial outputs summed over tp (reduce-scattered rows under sp)."""
    def hook(module, args, out):
        return reduce_scatter_seq(out[None], group)[0] if sp else reduce_from_tp(out, group)
    return hook


def _enter_experts_hook(group: ProcessGroup, sp: bool):
    """Before experts split over tp: the tokens and their routing weights replicated over tp, each summing its
    gradient over tp (under sp: every rank's rows gathered, the gradient reduce-scattered back)."""
    enter = _enter_rows_hook(group, sp)

    def hook(module, args):
        x_TH, weights_TK, indices_TK = args
        if sp:
            return enter(module, (x_TH,))[0], enter(module, (weights_TK,))[0], all_gather_dim(indices_TK, group, 0)
        return enter(module, (x_TH,))[0], enter(module, (weights_TK,))[0], indices_TK
    return hook


def _split_experts_rows_hook(group: ProcessGroup):
    """Before whole experts on a tp group's replicated rows: this rank's share of the rows (`split_rows`)."""
    def hook(module, args):
        x_TH, weights_TK, indices_TK = args
        module.num_rows = x_TH.shape[0]  # for the gather after the experts
        start, length, _ = row_share(x_TH.shape[0], group)
        return split_rows(x_TH, group), split_rows(weights_TK, group), indices_TK[start:start + length]
    return hook


class KVHeadSlice(nn.Module):
    """A k or v projection kept whole on every tp rank that computes one kv head (tp > kv heads).

    Keeps the `weight` / `bias` names of the linear it replaces; their gradient is partial over tp.
    """

    def __init__(self, linear: nn.Linear, start: int, length: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.start, self.length = start, length
        _mark_partial(self)

    def forward(self, x):
        weight = self.weight.narrow(0, self.start, self.length)
        bias = None if self.bias is None else self.bias.narrow(0, self.start, self.length)
        return nn.functional.linear(x, weight, bias)


def _sliced(param: nn.Parameter, dim: int, start: int, length: int) -> nn.Parameter:
    assert shard_of(param).dim is None, "already parallelized"
    local = nn.Parameter(param.detach().narrow(dim, start, length).clone(), requires_grad=param.requires_grad)
    set_shard(local, ParamShard(full_shape=tuple(param.shape), dim=dim, start=start, length=length))
    return local


def _shard_linear(linear: nn.Linear, dim: int, start: int, length: int) -> None:
    """Column-parallel (dim 0: output rows, and the bias) or row-parallel (dim 1: input columns)."""
    linear.weight = _sliced(linear.weight, dim, start, length)
    if linear.bias is not None:
        assert dim == 0, "row-parallel layers here have no bias"
        linear.bias = _sliced(linear.bias, 0, start, length)


def _mark_partial(*modules: nn.Module) -> None:
    for module in modules:
        for param in module.parameters(recurse=False):
            set_shard(param, replace(shard_of(param), partial_grad=True))


def _enter_hook(group: ProcessGroup, sp: bool):
    """Before attention / MLP: replicated input whose gradient is summed over tp (or all-gathered with sp)."""
    def hook(module, args):
        x = gather_seq(args[0], group) if sp else copy_to_tp(args[0], group)
        return (x, *args[1:])
    return hook


def _leave_hook(group: ProcessGroup, sp: bool):
    """After attention / MLP: sum the row-parallel partial outputs (reduce-scatter over sequence with sp)."""
    def hook(module, args, out):
        return reduce_scatter_seq(out, group) if sp else reduce_from_tp(out, group)
    return hook


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """A subclass of `cls` whose forward runs under non-reentrant activation checkpointing.

    Swapping the class (as FSDP2's `fully_shard` does) keeps parameter names and survives deepcopy,
    unlike a wrapper module (adds a name prefix) or an instance-level `forward` (copied by reference).
    """
    if cls not in _CHECKPOINTED:
        def forward(self, *args, **kwargs):
            return checkpoint(super(new_cls, self).forward, *args, use_reentrant=False, **kwargs)
        new_cls = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
        _CHECKPOINTED[cls] = new_cls
    return _CHECKPOINTED[cls]


def apply_recompute(model: StageModel, mode: str) -> None:
    """full: recompute each block (its tp collectives included) in backward; selective: only the attention core."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {mode!r}")
    if mode == "none":
        return
    targets: list[nn.Module] = []
    for block in model.layers.values():
        targets.append(block if mode == "full" else block.attn.core)
    for module in targets:
        assert isinstance(module, (Block, AttentionCore)) and type(module) not in _CHECKPOINTED.values(), \
            "recompute applied twice"
        module.__class__ = _checkpointed_class(type(module))
