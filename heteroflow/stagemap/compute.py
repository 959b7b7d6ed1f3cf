"""FLOPs and compute time of a Llama-family decoder, per layer and per device, forward and backward.

Per layer and token (h hidden, f MLP width, a query heads, k kv heads, d head width, s sequence):
- projections: q and o are h x (a d), k and v are h x (k d): 2 (2 a d + 2 k d) h FLOPs forward;
- attention core (flash attention, causal): QK^T and PV over s/2 keys on average: 2 s a d FLOPs;
- MLP: SwiGLU has three h x f matrices (6 h f FLOPs), GELU two (4 h f); a MoE block its router, shared expert
  and the routed experts' GEMMs on the (token, expert) pairs a device's local experts get (`ffn_gemm_s`), plus
  the routing's memory traffic (`routing_bytes`);
- LM head (last stage): 2 h V; embedding lookup (first stage): memory traffic only.
Backward costs 2x the forward for GEMMs (input and weight gradients), 2.5x for the attention core (flash
attention recomputes the probabilities) and 2x the memory traffic of elementwise kernels (norms, residual
adds, RoPE, the activation function, the loss), which are priced at device memory bandwidth. The elementwise
traffic is that of heteroflow's own unfused model code (`elementwise_elements`), which runs on every device.
A device with measured attention rates and block overheads (an emulated rank priced from the profile's
`cpu_thread`) uses those for the attention core and for the per-block host cost instead.
Tensor parallelism splits heads and the MLP width (kv heads are replicated when tp > kv heads); with
sequence parallelism the norms and residual adds also work on 1/tp of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.config.model import ModelSpec
from heteroflow.layout import GRAD_REDUCE_BYTES
from heteroflow.layout.routing import load_allowance, routed_pairs_per_rank
from heteroflow.layout.shards import active_ffn_width, kv_heads_per_rank, mlp_matrices
from heteroflow.stagemap.hardware import DeviceModel

ATTENTION_BACKWARD_FACTOR = 2.5
KERNELS_PER_LAYER = 24
"""Kernels one block launches in its forward (norms, projections, RoPE, attention, MLP, adds); twice that
in the backward."""
NORM_PASSES = {"rmsnorm": 7, "layernorm": 2}
"""Elements read and written per element of one norm's input. heteroflow's RMSNorm: pow (read, write), mean
(read), times the reciprocal root (read, write), times the weight (read, write); LayerNorm: one fused kernel."""
ROPE_PASSES = 10
"""Per query or key element: rotate-half (negate half, concatenate), x * cos, rotated * sin, their sum."""
ROUTER_PASSES = 5
"""Reads and writes per router score: cast to fp32 (read, write), softmax or sigmoid (read, write), top-k (read)."""
LOSS_BYTES_PER_LOGIT = 12
"""Cross-entropy traffic per logit: read the bf16 logits, write and re-read fp32 probabilities."""


def elementwise_elements(model: ModelSpec, *, tp: int, sp: bool) -> tuple[float, float]:
    """(all, activation function) elements one token reads and writes in a block's elementwise kernels, forward.

    Counts heteroflow's model code (models/llama.py), kernel by kernel: two norms and two residual adds (on
    1/tp of the tokens under sp), q/k norms, RoPE on the local queries and keys, the attention output made
    contiguous, and the activation: SwiGLU is silu (read f, write f) and the gate product (read 2f, write f), GELU
    one kernel (read f, write f). Grouped-query attention copies nothing: the fused kernel reads the kv heads
    (`models.llama.AttentionCore`).
    """
    h_e = model.hidden_size / tp if sp else model.hidden_size
    d = model.kv_channels
    q, kv = model.num_attention_heads // tp * d, kv_heads_per_rank(model, tp) * d
    f = active_ffn_width(model) / tp
    elements = (2 * NORM_PASSES[model.normalization] + 2 * 3) * h_e + 2 * q
    if model.qk_norm:
        elements += NORM_PASSES["rmsnorm"] * (q + kv)
    if model.position_embedding == "rope":
        elements += ROPE_PASSES * (q + kv)
    act_fn = 5 * f if model.activation == "swiglu" else 2 * f
    return elements + act_fn, act_fn


def model_flops_per_sample(model: ModelSpec) -> float:
    """Training FLOPs of one sample (forward + backward = 3 x forward, no recompute), for MFU."""
    h, d, s = model.hidden_size, model.kv_channels, model.seq_length
    a, k = model.num_attention_heads, model.num_kv_heads
    per_token = (2 * (2 * a * d + 2 * k * d) * h + 2 * s * a * d
                 + 2 * mlp_matrices(model) * h * active_ffn_width(model))
    forward = s * (model.num_layers * per_token + 2 * h * model.vocab_size)
    return 3.0 * forward


@dataclass(frozen=True, slots=True)
class LayerCompute:
    """Compute seconds of one block on one device for one micro-batch, split by kind."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    activation_fn_s: float
    """The part of `elementwise_s` spent in the MLP activation (recomputed by selective recompute)."""
    overhead_s: float
    """Host-side cost: kernel launches, or the measured per-block overhead."""
    attention_backward_s: float
    """The attention core's backward (measured, or `ATTENTION_BACKWARD_FACTOR` x the forward)."""
    overhead_backward_s: float
    """The host-side cost of the backward (measured, or twice the forward's launches)."""


def ffn_gemm_s(model: ModelSpec, dev: DeviceModel, *, tokens: float, tp: int, dtype_bytes: int, ep: int = 1,
               etp: int | None = None) -> float:
    """Forward GEMM seconds of one block's FFN on one device: the dense MLP split over tp, or the larger of it and
    a MoE layer (the costlier kind, as `layout.shards` counts parameters).

    A MoE layer runs the router (h x num_experts, on every token of the device), the shared expert split over tp,
    and each of its num_experts / ep local experts on its share of the routed (token, expert) pairs
    (`layout.routing.routed_pairs_per_rank`) at width ffn_hidden_size / etp, one GEMM per expert: more ep gives
    each expert more tokens. The pairs are scaled by the load allowance (`layout.routing.load_allowance`)."""
    h = model.hidden_size
    up = 2 if model.activation == "swiglu" else 1

    def ffn(rows: float, width: float) -> float:
        return dev.gemm_s(rows, up * width, h, dtype_bytes) + dev.gemm_s(rows, h, width, dtype_bytes) if width else 0.0

    dense = ffn(tokens, model.ffn_hidden_size / tp)
    moe = model.moe
    if moe is None:
        return dense
    etp = tp if etp is None else etp
    local = moe.num_experts // ep
    pairs = routed_pairs_per_rank(model, tokens, tp=tp, etp=etp) * load_allowance(moe, ep)
    routed = local * ffn(pairs / local, moe.ffn_hidden_size / etp)
    shared = ffn(tokens, moe.shared_expert_ffn_hidden_size / tp)
    return max(dense, dev.gemm_s(tokens, moe.num_experts, h, dtype_bytes) + shared + routed)


def routing_bytes(model: ModelSpec, *, tokens: float, tp: int, dtype_bytes: int, etp: int | None = None) -> float:
    """Memory traffic of one MoE layer's routing on one device, forward: the fp32 router scores (cast, softmax or
    sigmoid, top-k: `ROUTER_PASSES` per score) and the token permutation (gather each routed pair's hidden
    state, then read it back weighted into the combine, writing each token once); 0 for a dense model."""
    moe = model.moe
    if moe is None:
        return 0.0
    pairs = routed_pairs_per_rank(model, tokens, tp=tp, etp=tp if etp is None else etp)
    h = model.hidden_size
    return tokens * moe.num_experts * ROUTER_PASSES * 4 + dtype_bytes * h * (3 * pairs + tokens)


def layer_forward(model: ModelSpec, dev: DeviceModel, *, tokens: float, tp: int, sp: bool,
                  dtype_bytes: int, ep: int = 1, etp: int | None = None) -> LayerCompute:
    """Forward compute of one block for `tokens` tokens on one device of a tp group (and the backward's
    attention and host overhead, which do not follow the 2x rule when measured); a MoE block under the expert
    layout `ep`, `etp` (the all-to-all is communication, priced in `costs`)."""
    h, d, s = model.hidden_size, model.kv_channels, model.seq_length
    q_dim = model.num_attention_heads // tp * d
    kv_dim = kv_heads_per_rank(model, tp) * d
    gemm = (dev.gemm_s(tokens, q_dim + 2 * kv_dim, h, dtype_bytes) + dev.gemm_s(tokens, h, q_dim, dtype_bytes)
            + ffn_gemm_s(model, dev, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes, ep=ep, etp=etp))
    attn_flops = 2.0 * tokens * s * (model.num_attention_heads // tp) * d
    rates = dev.attention_rates(d)
    if rates is not None:
        attention, attention_bwd = attn_flops / (rates[0] * 1e12), attn_flops / (rates[1] * 1e12)
    else:
        attention = attn_flops / (dev.gemm_tflops(min(tokens, s, d)) * 1e12)
        attention_bwd = ATTENTION_BACKWARD_FACTOR * attention
    elements, act_elements = elementwise_elements(model, tp=tp, sp=sp)
    act_fn = dev.memory_s(act_elements * tokens * dtype_bytes)
    elementwise = dev.memory_s(elements * tokens * dtype_bytes
                               + routing_bytes(model, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes, etp=etp))
    if dev.block_overhead_s is not None:
        overhead, overhead_bwd = dev.block_overhead_s
    else:
        overhead = dev.launch_s(KERNELS_PER_LAYER)
        overhead_bwd = 2 * overhead
    if tp > 1:  # the tp functions around the block's collectives (measured on emulated ranks)
        overhead, overhead_bwd = overhead + dev.tp_block_overhead_s[0], overhead_bwd + dev.tp_block_overhead_s[1]
    return LayerCompute(gemm_s=gemm, attention_s=attention, elementwise_s=elementwise, activation_fn_s=act_fn,
                        overhead_s=overhead, attention_backward_s=attention_bwd, overhead_backward_s=overhead_bwd)


def grad_accumulate_s(params: float, dev: DeviceModel, *, weight_bytes: int) -> float:
    """Adding one backward's gradients of `params` parameters into the fp32 gradient buffer, as the runtime's
    on-device optimizers do after every micro-batch (`models.data_parallel.DataParallelAdamW`): the gradient
    autograd produced (in the parameters' dtype, `weight_bytes` each) is read, the buffer read and written, at
    the device's memory bandwidth. (The hook's fixed host cost per parameter is in the measured block overhead of
    an emulated rank; on accelerators its launches are not counted.)"""
    return params * (weight_bytes + 2 * GRAD_REDUCE_BYTES) / (dev.hbm_gb_per_s * 1e9)


def embedding_s(model: ModelSpec, dev: DeviceModel, *, tokens: float, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of the embedding lookup and its gradient scatter-add."""
    h = model.hidden_size
    return dev.memory_s(2 * tokens * h * dtype_bytes), dev.memory_s(2 * tokens * h * 4)


def head_s(model: ModelSpec, dev: DeviceModel, *, tokens: float, tp: int, sp: bool,
           dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of the final norm, LM head and cross-entropy loss."""
    h, v_loc = model.hidden_size, model.vocab_size / tp
    gemm = dev.gemm_s(tokens, v_loc, h, dtype_bytes)
    norm = dev.memory_s(2 * tokens * (h / tp if sp else h) * dtype_bytes)
    loss = dev.memory_s(LOSS_BYTES_PER_LOGIT * tokens * v_loc)
    return gemm + norm + loss, 2 * gemm + 2 * norm + loss
