"""What one rank of a layout holds: heads, kv heads and parameters per tp rank, and which copy of a value
counts once.

Used by the planner's memory and compute model and by the runtime (the offload swap sizing, the gradient
norm, the optimizer and checkpoints), so both count the same things.
"""

from __future__ import annotations

from heteroflow.layout.parallel import ModelShape


def heads_per_rank(model: ModelShape, tp: int) -> int:
    """Query heads one tp rank computes."""
    return model.num_attention_heads // tp


def replicates_kv_heads(model: ModelShape, tp: int) -> bool:
    """Whether every tp rank keeps the whole k/v projections (tp exceeds the kv heads: each rank then computes
    the one kv head its query heads use, and the k/v gradients are partial sums over tp)."""
    return tp > model.num_kv_heads


def kv_heads_per_rank(model: ModelShape, tp: int) -> int:
    """KV heads one tp rank computes with (one when tp exceeds the kv heads)."""
    return 1 if replicates_kv_heads(model, tp) else model.num_kv_heads // tp


def mlp_matrices(model: ModelShape) -> int:
    """Weight matrices of the MLP: 3 for SwiGLU, 2 for GELU."""
    return 3 if model.activation == "swiglu" else 2


def has_dense_layers(model: ModelShape) -> bool:
    """Whether any block has the dense MLP: every block of a dense model; in a mixture-of-experts model the first
    dense layers and those the layer frequency skips (`is_moe_layer`)."""
    return model.moe is None or not all(model.is_moe_layer(i) for i in range(model.num_layers))


def active_ffn_width(model: ModelShape) -> int:
    """FFN inner width one token goes through in a block, for activations and model FLOPs: `ffn_hidden_size`, or
    in a mixture-of-experts model top_k routed experts plus the shared expert, or the larger of the two when the
    model also has dense layers (a block is priced at its costlier layer kind)."""
    moe = model.moe
    if moe is None:
        return model.ffn_hidden_size
    routed = moe.top_k * moe.ffn_hidden_size + moe.shared_expert_ffn_hidden_size
    return max(model.ffn_hidden_size, routed) if has_dense_layers(model) else routed


def routed_expert_params_per_rank(model: ModelShape, *, ep: int = 1, etp: int = 1) -> float:
    """Parameters of one MoE layer's routed experts on one rank: its num_experts / ep local experts (`mlp_matrices`
    h x f matrices each: the model's activation), every matrix split over the expert tensor-parallel degree `etp`."""
    moe = model.moe
    if moe is None:
        return 0.0
    return mlp_matrices(model) * model.hidden_size * moe.ffn_hidden_size * (moe.num_experts // ep) / etp


def _moe_ffn_params_per_rank(model: ModelShape, tp: int, ep: int, etp: int) -> tuple[float, float]:
    """(outside the routed experts, routed experts) of one MoE layer's FFN on one rank: the shared expert split
    over tp, the router and the shared expert's gate whole on every rank, the local experts split over etp."""
    moe, h = model.moe, model.hidden_size
    shared = mlp_matrices(model) * h * moe.shared_expert_ffn_hidden_size / tp
    outside = shared + moe.num_experts * h + (h if moe.shared_expert_gate else 0)
    return outside, routed_expert_params_per_rank(model, ep=ep, etp=etp)


def _priced_ffn_params(model: ModelShape, tp: int, ep: int, etp: int | None) -> tuple[float, float]:
    """(FFN parameters, the routed experts' part of them) of one block on one rank, for the layer kind a block is
    priced at: the dense MLP split over tp; a MoE layer (`_moe_ffn_params_per_rank`) when every block is MoE;
    with both kinds in the model, the costlier."""
    dense = mlp_matrices(model) * model.hidden_size * model.ffn_hidden_size / tp
    if model.moe is None:
        return dense, 0.0
    outside, routed = _moe_ffn_params_per_rank(model, tp, ep, tp if etp is None else etp)
    if has_dense_layers(model) and dense > outside + routed:
        return dense, 0.0
    return outside + routed, routed


def mlp_params_per_rank(model: ModelShape, tp: int, *, ep: int = 1, etp: int | None = None) -> float:
    """Parameters of one block's FFN on one rank, every local expert counted (memory, gradients, optimizer), under
    expert parallelism `ep` and expert tensor parallelism `etp` (None: tp); see `_priced_ffn_params`."""
    return _priced_ffn_params(model, tp, ep, etp)[0]


def expert_params_per_rank(model: ModelShape, tp: int, *, ep: int = 1, etp: int | None = None) -> float:
    """The routed experts' share of `layer_params_per_rank`: the parameters whose gradients are reduced (and whose
    ZeRO state is sharded) over the expert-dp group rather than dp; 0 for a dense model, or when a dense layer
    is the costlier kind the block is priced at."""
    return _priced_ffn_params(model, tp, ep, etp)[1]


def layer_params_per_rank(model: ModelShape, tp: int, *, ep: int = 1, etp: int | None = None) -> float:
    """Parameters of one transformer block that one rank holds (kv counted at its local heads; every local expert
    of a MoE block under `ep` and `etp`, see `mlp_params_per_rank`)."""
    h, d = model.hidden_size, model.kv_channels
    q_loc, kv_loc = heads_per_rank(model, tp), kv_heads_per_rank(model, tp)
    attn = 2 * h * q_loc * d + 2 * h * kv_loc * d
    if model.qkv_bias:
        attn += (q_loc + 2 * kv_loc) * d
    norms = 2 * h * (2 if model.normalization == "layernorm" else 1) + (2 * d if model.qk_norm else 0)
    return attn + mlp_params_per_rank(model, tp, ep=ep, etp=etp) + norms


def embedding_params_per_rank(model: ModelShape, tp: int) -> float:
    """Parameters of the first stage beyond its blocks: the (vocab-parallel) embedding, learned positions."""
    positions = model.seq_length * model.hidden_size if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden_size / tp + positions


def head_params_per_rank(model: ModelShape, tp: int, *, single_stage: bool) -> float:
    """Parameters of the last stage beyond its blocks: final norm and LM head (a copy when tied across stages)."""
    head = 0 if (model.tie_embeddings and single_stage) else model.vocab_size * model.hidden_size / tp
    return head + model.hidden_size


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global indices of the experts ep rank `ep_rank` holds: a contiguous 1/ep of them, as Megatron-core
    places them (the runtime keeps them under these indices, so checkpoints do not depend on ep)."""
    per_rank = num_experts // ep
    assert per_rank * ep == num_experts and 0 <= ep_rank < ep, (num_experts, ep, ep_rank)
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def counted_once(*, split_over_tp: bool, tp_rank: int, dp_rank: int = 0, split_over_dp: bool = False,
                 tied_head_copy: bool = False) -> bool:
    """Whether this rank's copy of a value is the one that counts (in the global gradient norm, in a
    checkpoint), so that every value of the model counts exactly once over the world.

    A value split over tp counts on every tp rank (each holds a different part), a tp-replicated one on tp
    rank 0; likewise over dp (ZeRO-sharded state is split, plain replicas count on dp rank 0; ZeRO-3 splits over
    cp x dp, so its `dp_rank` is the rank in that group). The LM head's
    copy of an embedding tied across stages never counts: it equals the first stage's embedding.
    """
    return (not tied_head_copy and (split_over_tp or tp_rank == 0)
            and (split_over_dp or dp_rank == 0))


def zero_flat_range(numel: int, *, dp: int, dp_rank: int, zero: int) -> tuple[int, int, int]:
    """`(lo, hi, padded)`: the stage's flat parameter buffer (`numel` elements in parameter order) padded to a
    multiple of dp, and the part `[lo, hi)` of it whose fp32 master weights and Adam moments this dp rank keeps:
    its 1/dp under ZeRO 1 and 2, all of it without ZeRO. The on-device and the offloaded optimizer both cut
    their state with it, so a plan keeps the same values on each rank with and without offload."""
    padded = -(-numel // dp) * dp
    if not zero:
        return 0, padded, padded
    shard_len = padded // dp
    return dp_rank * shard_len, (dp_rank + 1) * shard_len, padded
