"""Megatron's mixture-of-experts arguments -> the job's `model.moe` (with Megatron's defaults and rules).

Megatron-core's router (`moe/router.py`, `moe_utils.topk_routing_with_score_function`) against
heteroflow's (`models/moe.py`):
- softmax: top-k of the logits, then softmax over those k = heteroflow's softmax over all experts with
  the top-k weights normalised; `--moe-router-pre-softmax` keeps the raw top-k probabilities
  (`normalize_top_k: false`).
- sigmoid: top-k of the sigmoid scores, normalised when k > 1, as heteroflow (which also normalises one).
- The aux loss: Megatron's `switch_load_balancing_loss_func` divides the assignment counts by
  tokens * top_k, Hugging Face's form (heteroflow's) by tokens, so the same gradient needs
  `aux_loss_coeff = --moe-aux-loss-coeff / top_k`.
- The capacity: both take ceil(factor * tokens * top_k / num_experts) per expert. heteroflow keeps each
  expert's earliest tokens, the documented intent of Megatron's "position" drop policy; its code picks them
  with torch.topk over equal values, which does not guarantee the earliest (so: approximated).
- seq_aux_loss: the same per sequence, averaged over the micro-batch (`aux_loss_type: sequence`); the z-loss
  and the top-k scaling factor map one to one.
- The experts use the model's MLP: SwiGLU with --swiglu, else fc1 / fc2 with GELU.
- sinkhorn (given alone): `sinkhorn: true`, approximated: Megatron balances each rank's tokens, heteroflow the
  micro-batch's (what one device would), with Megatron's weights (sigmoid for top-k 1, else softmax, as they are).
What heteroflow's MoE does not model (expert bias, group-limited routing, quantile balancing, ...) blocks the import
by name with what to change.
"""

from __future__ import annotations

from heteroflow.megatron.context import Context
from heteroflow.megatron.moe_pattern import dense_first_and_freq, parse_layer_freq

_KERNEL = "kernel or implementation choice for the experts: same model, same layout"
_COMM = "token-exchange backend tuning: same model; heteroflow's runtime exchanges tokens by all-to-all"
_SAME = {
    "moe_grouped_gemm": "grouped GEMM over the local experts: a kernel choice, same model",
    "moe_use_legacy_grouped_gemm": _KERNEL, "moe_use_grouped_tensor": _KERNEL,
    "moe_single_grouped_weight": _KERNEL, "moe_single_grouped_bias": _KERNEL,
    "moe_mlp_glu_interleave_size": "weight layout for a fused GLU kernel: same model",
    "moe_shared_expert_glu_interleave_size": "weight layout for a fused GLU kernel: same model",
    "moe_permute_fusion": "fused token permutation: same routing, a kernel choice",
    "moe_permute_fusion_into_hybridep": _KERNEL,
    "moe_router_fusion": "fused top-k and aux-loss kernel: same routing, a kernel choice",
    "moe_shared_expert_overlap": "runs the shared expert while tokens are exchanged: communication overlap, "
                                 "same model",
    "moe_enable_deepep": _COMM, "moe_flex_dispatcher_backend": _COMM, "moe_deepep_num_sms": _COMM,
    "moe_flex_dispatcher_num_sms": _COMM, "moe_ncclep_zero_copy": _COMM,
    "moe_per_layer_logging": "logging only", "moe_enable_routing_replay": "records / replays routing decisions "
                                                                         "for debugging: same model",
    "moe_pad_experts_for_cuda_graph_inference": "inference-only option",
    "moe_router_padding_for_fp8": "pads expert inputs for FP8 kernels (Transformer Engine): same model",
    "moe_router_padding_for_quantization": "pads expert inputs for FP8/FP4 kernels: same model",
    "moe_dispatch_fwd_dtype": "FP8 token exchange (Transformer Engine): heteroflow exchanges tokens in the "
                              "job's precision",
    "moe_combine_bwd_dtype": "FP8 token exchange (Transformer Engine): heteroflow exchanges tokens in the "
                             "job's precision",
    "moe_use_upcycling": "converts a dense Megatron checkpoint into the MoE model's first weights: heteroflow "
                         "does not read Megatron checkpoints (use train.init_from)",
    "moe_upcycling_granularity": "used only by --moe-use-upcycling (checkpoint conversion)",
    "moe_token_dropping": "Megatron does not implement it (TransformerConfig: \"currently unsupported\")",
}
_SAME_PREFIXES = (("moe_hybridep_", _COMM), ("moe_routing_trace_", "logging only"),
                  ("moe_paged_stash", "activation memory management (paged stash): same model"))


def map_moe(ctx: Context, num_layers: int, ffn_hidden_size: int, tp: int, swiglu: bool) -> dict | None:
    """`model.moe` for the source's MoE arguments (every field written out); None when the model is dense
    or a value could not be read. Blockers and Megatron's rule errors go to `ctx`."""
    num_experts = ctx.value("num_experts")
    if num_experts is not None and num_experts < 0:
        ctx.error(f"{ctx.key('num_experts')} {num_experts}: num_moe_experts must be non-negative (Megatron)")
        return None
    if not num_experts:
        return None
    # Megatron's experts (and shared expert) are MLPs of the model's TransformerConfig: gated (SwiGLU) with
    # --swiglu, else its activation_func over fc1 / fc2, as heteroflow's experts follow model.activation.
    ctx.mark("num_experts", "mapped", f"model.moe.num_experts = {num_experts}, experts with the model's "
                                      f"{'SwiGLU' if swiglu else 'GELU'} MLP")
    top_k = ctx.value("moe_router_topk")
    ctx.mark_or_default("moe_router_topk", "mapped", f"model.moe.top_k = {top_k}")
    if isinstance(top_k, int) and not 1 <= top_k <= num_experts:
        ctx.error(f"{ctx.key('moe_router_topk')} {top_k} must be between 1 and --num-experts {num_experts} "
                  "(Megatron's top-k selection)")
    width = ctx.value("moe_ffn_hidden_size")
    if width is None:
        width = ffn_hidden_size
        ctx.default_value("moe_ffn_hidden_size", width, f"model.moe.ffn_hidden_size = {width} (Megatron's "
                                                        "default: --ffn-hidden-size)")
    else:
        ctx.mark("moe_ffn_hidden_size", "mapped", f"model.moe.ffn_hidden_size = {width}")
    shared, gate = _shared_expert(ctx)
    first_dense, freq = _layer_pattern(ctx, num_layers)
    sinkhorn = _balancing_types(ctx) == ["sinkhorn"]  # Megatron routes by Sinkhorn only when it is the one type
    score, normalize, factor = _router(ctx, top_k, sinkhorn)
    coeff, aux_type = _load_balancing(ctx, top_k)
    z_coeff = _z_loss(ctx)
    capacity = _capacity(ctx, tp)
    _dispatcher(ctx)
    _blockers(ctx)
    _same_model(ctx)
    if None in (top_k, width, first_dense, score, coeff) or not isinstance(top_k, int):
        return None
    return {"num_experts": num_experts, "top_k": top_k, "ffn_hidden_size": width, "score_function": score,
            "normalize_top_k": normalize, "shared_expert_ffn_hidden_size": shared, "shared_expert_gate": gate,
            "first_dense_layers": first_dense, "layer_freq": freq, "aux_loss_coeff": coeff,
            "aux_loss_type": aux_type, "z_loss_coeff": z_coeff, "topk_scaling_factor": factor, "sinkhorn": sinkhorn,
            "capacity_factor": capacity}


def _shared_expert(ctx: Context) -> tuple[int, bool]:
    size = ctx.value("moe_shared_expert_intermediate_size")
    if size is not None and size <= 0:
        ctx.error(f"moe_shared_expert_intermediate_size must be num_shared_experts * "
                  f"ffn_size_of_each_shared_expert, but got {size} (Megatron)")
        size = None
    gate = bool(ctx.get("moe_shared_expert_gate"))
    if size is None:
        ctx.mark("moe_shared_expert_gate", "ignored", "only effective with --moe-shared-expert-intermediate-size")
        ctx.mark("moe_shared_expert_overlap", "ignored", "only effective with --moe-shared-expert-intermediate-size")
        return 0, False
    ctx.mark("moe_shared_expert_intermediate_size", "mapped", f"model.moe.shared_expert_ffn_hidden_size = {size}")
    ctx.mark("moe_shared_expert_gate", "mapped", "model.moe.shared_expert_gate = true: sigmoid(linear(x)) scales "
                                                 "the shared expert, as Megatron's gate")
    if ctx.get("moe_shared_expert_overlap") and ctx.get("moe_token_dispatcher_type") not in ("alltoall", "flex"):
        ctx.error("moe_shared_expert_overlap only works with alltoall or flex token dispatcher (Megatron)")
    return size, gate


def _layer_pattern(ctx: Context, num_layers: int) -> tuple[int | None, int]:
    raw = ctx.value("moe_layer_freq")
    key = ctx.key("moe_layer_freq")
    try:
        freq = parse_layer_freq(raw if raw is not None else 1)
    except ValueError as exc:
        ctx.error(f"{key}: {exc}")
        return None, 1
    if isinstance(freq, int):
        if freq < 1:
            ctx.error(f"{key} {freq} must be at least 1 (layer i is MoE when i % freq == 0)")
            return None, 1
        ctx.mark_or_default("moe_layer_freq", "mapped", f"model.moe.layer_freq = {freq}")
        return 0, freq
    if len(freq) != num_layers:
        ctx.error(f"Invalid length of moe_layer_pattern: {len(freq)}, expected {num_layers}, current moe layer "
                  f"pattern: {raw} (Megatron)")
        return None, 1
    found = dense_first_and_freq(freq)
    if found is None:
        shown = "".join(map(str, freq))
        ctx.block(f"mixture-of-experts layer pattern ({key} {raw} = {shown}): heteroflow's model.moe places MoE "
                  "layers as the first k layers dense, then every layer_freq-th layer; write the pattern that way")
        ctx.mark("moe_layer_freq", "unsupported", "this pattern of MoE and dense layers is not representable")
        return None, 1
    first, step = found
    ctx.mark("moe_layer_freq", "mapped", f"model.moe.first_dense_layers = {first}, layer_freq = {step}")
    return first, step


def _router(ctx: Context, top_k: object, sinkhorn: bool) -> tuple[str | None, bool, float]:
    """The score function, whether the top-k weights are normalised, and their scaling factor."""
    if sinkhorn:
        why = ("Megatron's sinkhorn routing weighs the chosen experts by sigmoid (top-k 1) or softmax scores, "
               "unnormalised and unscaled, whatever it says: model.moe.sinkhorn = true")
        for dest in ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor"):
            ctx.mark(dest, "ignored", why)
        _router_dtype(ctx)
        return "softmax", False, 1.0
    score = ctx.get("moe_router_score_function")
    pre = bool(ctx.get("moe_router_pre_softmax"))
    if score == "sqrtsoftplus":
        _block(ctx, "moe_router_score_function", "the sqrt-softplus router score function",
               "heteroflow's router scores with softmax or sigmoid")
        return None, True, 1.0
    if score == "softmax":
        if top_k == 1 and not pre and "sinkhorn" not in _balancing_types(ctx):
            ctx.error("Please use --moe-router-pre-softmax when topk is 1. (Megatron: softmax over one selected "
                      "logit has a zero gradient)")
        ctx.mark_or_default("moe_router_score_function", "mapped", "model.moe.score_function = softmax")
        ctx.mark("moe_router_pre_softmax", "mapped", "model.moe.normalize_top_k = false: softmax over all experts, "
                                                     "the top-k probabilities kept as they are" if pre else
                 "model.moe.normalize_top_k = true")
        if not pre:
            ctx.default("moe_router_pre_softmax", "mapped", "top-k of the logits, then softmax over those k: "
                                                            "model.moe.normalize_top_k = true")
        normalize = not pre
    else:
        if top_k == 1:
            _block(ctx, "moe_router_score_function", "sigmoid routing with --moe-router-topk 1",
                   "Megatron weighs the one expert by its sigmoid score, heteroflow's sigmoid router normalises "
                   "the top-k weights (to 1 for one expert); use softmax with --moe-router-pre-softmax or top-k > 1")
            return None, True, 1.0
        ctx.mark("moe_router_score_function", "mapped", "model.moe.score_function = sigmoid (top-k weights "
                                                        "normalised, as Megatron does for top-k > 1)")
        ctx.mark("moe_router_pre_softmax", "ignored", "no effect with sigmoid scores (Megatron applies the "
                                                      "sigmoid before the top-k either way)")
        normalize = True
    factor = ctx.value("moe_router_topk_scaling_factor")
    if factor is not None:
        ctx.mark("moe_router_topk_scaling_factor", "mapped", f"model.moe.topk_scaling_factor = {factor:g}: the "
                 "top-k weights (after normalisation) times it, as Megatron")
    _router_dtype(ctx)
    return score, normalize, 1.0 if factor is None else float(factor)


def _router_dtype(ctx: Context) -> None:
    dtype = ctx.get("moe_router_dtype")
    if dtype is None:
        return
    if not (ctx.get("bf16") or ctx.get("fp16")):
        ctx.mark("moe_router_dtype", "mapped" if dtype == "fp32" else "approximated",
                 "the job trains in fp32: the router runs in fp32" if dtype == "fp32" else
                 "heteroflow's router runs in fp32, not fp64")
        return
    ctx.mark("moe_router_dtype", "approximated", f"Megatron computes the router's logits in {dtype}; heteroflow "
                                                 "computes them in the job's half precision and its scores and "
                                                 "routing weights in fp32 (close, not bitwise equal, routing)")


def _balancing_types(ctx: Context) -> list[str]:
    kinds = ctx.get("moe_router_load_balancing_type")
    return list(kinds) if isinstance(kinds, list) else [kinds or "aux_loss"]


def _load_balancing(ctx: Context, top_k: object) -> tuple[float | None, str]:
    """heteroflow's aux_loss_coeff (None when the source's load balancing is not representable) and
    aux_loss_type."""
    kinds = _balancing_types(ctx)
    coeffs = ctx.get("moe_aux_loss_coeff")
    coeffs = list(coeffs) if isinstance(coeffs, list) else [coeffs if coeffs is not None else 0.0]
    if len(kinds) > 1 and len(coeffs) != len(kinds):
        ctx.error("moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type "
                  f"(Megatron): {len(coeffs)} coefficients for {len(kinds)} types")
        return None, "batch"
    if len(kinds) == 1 and len(coeffs) > 1:
        ctx.error(f"--moe-aux-loss-coeff has {len(coeffs)} values for one load-balancing type (Megatron keeps "
                  "a list only when --moe-router-load-balancing-type is a list of the same length)")
        return None, "batch"
    pairs = list(zip(kinds, coeffs))
    coeff, kind_used = 0.0, "batch"
    for kind, value in pairs:
        if kind == "sinkhorn" and len(kinds) == 1:
            if value:
                ctx.error("Sinkhorn routing does not support aux loss. (Megatron: --moe-aux-loss-coeff must be 0 with "
                          "--moe-router-load-balancing-type sinkhorn)")
                return None, "batch"
            continue
        if kind in ("sinkhorn", "quantile_balancing", "global_aux_loss") and (kind != "global_aux_loss" or value):
            what = {"sinkhorn": "Sinkhorn routing listed with other load-balancing types (Megatron routes by "
                                "Sinkhorn only when it is the one type)",
                    "quantile_balancing": "quantile-balancing routing (a learnt per-expert bias)",
                    "global_aux_loss": "the global-batch load-balancing loss"}[kind]
            _block(ctx, "moe_router_load_balancing_type", f"{what} ({kind})",
                   "heteroflow's MoE balances with the micro-batch or per-sequence aux loss (aux_loss, "
                   "seq_aux_loss), Sinkhorn routing (sinkhorn alone) or none")
            ctx.mark("moe_aux_loss_coeff", "unsupported", f"a coefficient of {what}, which heteroflow lacks")
            return None, "batch"
        if kind in ("aux_loss", "seq_aux_loss") and value:
            if coeff:
                _block(ctx, "moe_router_load_balancing_type", "both the micro-batch and the per-sequence "
                       "load-balancing loss", "heteroflow's model.moe trains one of them (aux_loss_type); keep "
                       "aux_loss or seq_aux_loss")
                ctx.mark("moe_aux_loss_coeff", "unsupported", "two load-balancing coefficients")
                return None, "batch"
            coeff, kind_used = value, "sequence" if kind == "seq_aux_loss" else "batch"
    if not isinstance(top_k, int) or top_k < 1:
        return None, kind_used
    ours = float(f"{coeff / top_k:.12g}")  # 12 digits: the export's coeff * top_k reads back as the same value
    if coeff:
        detail = (f"model.moe.aux_loss_type = {kind_used}, aux_loss_coeff = {ours:g} = {coeff:g} / top_k {top_k}: "
                  "Megatron's aux loss divides the assignment counts by tokens * top_k, heteroflow's (Hugging "
                  "Face's) by tokens, so the gradient is the same; the aux_loss figure heteroflow reports is "
                  f"{top_k} x Megatron's")
    elif kinds == ["sinkhorn"]:
        detail = ("model.moe.sinkhorn = true: the top-k chosen by Sinkhorn-balanced scores (S-BASE); approximated: "
                  "heteroflow balances over the micro-batch (pooled over dp, cp and sp ranks, as one device), Megatron "
                  "over each rank's tokens")
        ctx.mark("moe_router_load_balancing_type", "approximated", detail)
        ctx.mark("moe_aux_loss_coeff", "mapped", "0: Sinkhorn routing trains no aux loss")
        return ours, kind_used
    else:
        detail = "model.moe.aux_loss_coeff = 0: no load-balancing loss"
    ctx.mark_or_default("moe_router_load_balancing_type", "mapped", detail)
    ctx.mark_or_default("moe_aux_loss_coeff", "mapped", detail)
    return ours, kind_used


def _z_loss(ctx: Context) -> float:
    """model.moe.z_loss_coeff: Megatron's z-loss is coeff * the mean of logsumexp(logits)^2 over a micro-batch's
    tokens (divided over its tp x cp ranks, which hold parts of them), heteroflow's the same."""
    value = ctx.value("moe_z_loss_coeff")
    if value is None or not value:
        ctx.mark("moe_z_loss_coeff", "ignored", "off: same as heteroflow")
        return 0.0
    if value < 0:
        ctx.error(f"{ctx.key('moe_z_loss_coeff')} {value}: the z-loss coefficient must not be negative")
        return 0.0
    ctx.mark("moe_z_loss_coeff", "mapped", f"model.moe.z_loss_coeff = {value:g}: coeff * mean over the "
                                           "micro-batch's tokens of logsumexp(router logits)^2, as Megatron")
    return float(value)


def _capacity(ctx: Context, tp: int) -> float | None:
    factor = ctx.value("moe_expert_capacity_factor")
    pad = ctx.get("moe_pad_expert_input_to_capacity")
    if factor is not None and factor < 0:
        factor = None  # Megatron: a negative capacity factor means dropless
        ctx.mark("moe_expert_capacity_factor", "mapped", "negative: dropless (Megatron), model.moe.capacity_factor "
                                                         "= null")
    if factor is None:
        if pad:
            ctx.error("moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity (Megatron)")
        ctx.mark("moe_token_drop_policy", "ignored", "no effect without --moe-expert-capacity-factor (dropless)")
        ctx.mark("moe_expert_capacity_factor", "mapped", "model.moe.capacity_factor = null (dropless)")
        return None
    if any(kind not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none") for kind in _balancing_types(ctx)):
        ctx.error("moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss or none load "
                  "balancing (Megatron)")
    if ctx.get("moe_token_drop_policy") == "probs":
        _block(ctx, "moe_token_drop_policy", "dropping each expert's lowest-probability tokens over capacity "
               "(Megatron's default drop policy)",
               f"heteroflow's capacity keeps each expert's earliest tokens: set {ctx.key('moe_token_drop_policy')} "
               f"position, or leave out {ctx.key('moe_expert_capacity_factor')} (dropless)")
        ctx.mark("moe_expert_capacity_factor", "unsupported", "a capacity with the probs drop policy")
        return None
    detail = (f"model.moe.capacity_factor = {factor:g}: the same ceil(factor * tokens * top_k / experts) per "
              "expert; heteroflow keeps each expert's earliest tokens (the position policy's documented intent), "
              "Megatron picks them with torch.topk over equal values, which need not be the earliest")
    if tp > 1:
        detail += ("; and Megatron counts the capacity over each tp rank's sequence-parallel shard of the tokens, "
                   "heteroflow over the stage's micro-batch share")
    ctx.mark("moe_token_drop_policy", "approximated", detail)
    ctx.mark("moe_expert_capacity_factor", "approximated", detail)
    if pad:
        ctx.mark("moe_pad_expert_input_to_capacity", "approximated", "Megatron pads every expert's input to its "
                 "capacity (same outputs, more compute); heteroflow computes the routed tokens only")
    return factor


def _dispatcher(ctx: Context) -> None:
    kind = ctx.get("moe_token_dispatcher_type")
    ep = ctx.get("expert_model_parallel_size")
    etp = ctx.get("expert_tensor_parallel_size")
    tp = ctx.get("tensor_model_parallel_size")
    exchanged = (isinstance(ep, int) and ep > 1) or ((etp if isinstance(etp, int) else tp) or 1) > 1
    if ctx.get("overlap_moe_expert_parallel_comm"):
        if not (isinstance(ep, int) and ep > 1):
            ctx.error("overlap_moe_expert_parallel_comm is only supported with expert model parallelism (Megatron)")
        if kind not in ("alltoall", "flex"):
            ctx.error("overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher (Megatron)")
    if kind == "allgather" and exchanged:
        ctx.mark_or_default("moe_token_dispatcher_type", "approximated",
                            "Megatron's allgather dispatcher (its default) gathers every token on every expert "
                            "rank; heteroflow's runtime exchanges them by all-to-all in the stage's ep group: same "
                            "model and routing, the planner prices all-to-all traffic")
    elif kind == "allgather":
        ctx.mark_or_default("moe_token_dispatcher_type", "mapped", "no expert parallelism: tokens are not "
                                                                   "exchanged")
    else:
        ctx.mark("moe_token_dispatcher_type", "mapped", f"{kind}: tokens travel by all-to-all in the ep group, "
                                                        "as heteroflow's runtime does")


def _blockers(ctx: Context) -> None:
    """MoE features heteroflow's model does not have: each named, with what to change."""
    if ctx.get("moe_router_enable_expert_bias"):
        if ctx.get("moe_router_score_function") not in ("sigmoid", "sqrtsoftplus"):
            ctx.error("Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score "
                      "functions. Please set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset "
                      "--moe-router-enable-expert-bias. (Megatron)")
        _block(ctx, "moe_router_enable_expert_bias", "aux-loss-free routing with a learnt per-expert bias "
               "(DeepSeek-V3)", "heteroflow's router has no expert bias; remove --moe-router-enable-expert-bias")
        ctx.mark("moe_router_bias_update_rate", "unsupported", "used by the expert bias, which heteroflow lacks")
    else:
        ctx.mark("moe_router_bias_update_rate", "ignored", "used only with --moe-router-enable-expert-bias")
    if ctx.get("moe_router_group_topk") or ctx.get("moe_router_topk_limited_devices"):
        if ctx.get("moe_router_group_topk") and not ctx.get("moe_router_num_groups"):
            ctx.error("When using group limited routing, moe_router_num_groups must be specified. (Megatron)")
        dest = "moe_router_group_topk" if ctx.get("moe_router_group_topk") else "moe_router_topk_limited_devices"
        _block(ctx, dest, "group-limited routing (experts chosen within the top groups)",
               "heteroflow's router picks the top-k over all experts; remove --moe-router-num-groups and "
               "--moe-router-group-topk")
        ctx.mark("moe_router_num_groups", "unsupported", "group-limited routing is not representable")
    else:
        ctx.mark("moe_router_num_groups", "ignored", "used only with --moe-router-group-topk")
    rules = (
        ("moe_input_jitter_eps", lambda v: v, "router input jitter",
         "heteroflow's router takes its input unchanged (as it refuses Hugging Face's router_jitter_noise); "
         "remove --moe-input-jitter-eps"),
        ("moe_router_force_load_balancing", lambda v: v, "forced load balancing (random router logits, a "
         "benchmark mode)", "remove --moe-router-force-load-balancing"),
        ("moe_router_force_biased", lambda v: v is not None, "random router bias (a benchmark mode)",
         "remove --moe-router-force-biased"),
        ("moe_apply_probs_on_input", lambda v: v, "routing weights applied to the experts' input",
         "heteroflow weighs the experts' outputs; remove --moe-apply-probs-on-input"),
        ("moe_latent_size", lambda v: v is not None, "latent projections around the experts",
         "heteroflow's experts work at the hidden size; remove --moe-latent-size"),
        ("moe_expert_rank_capacity_factor", lambda v: v is not None, "a capacity per expert rank",
         "heteroflow's capacity is per expert (--moe-expert-capacity-factor); remove "
         "--moe-expert-rank-capacity-factor"),
        ("moe_extended_tp", lambda v: v, "older Megatron's extended tensor parallelism for experts",
         "current Megatron writes it --expert-tensor-parallel-size"),
    )
    for dest, active, what, fix in rules:
        if active(ctx.get(dest)):
            _block(ctx, dest, what, fix)
        else:
            ctx.mark(dest, "ignored", "off: same as heteroflow")
    if "quantile_balancing" not in _balancing_types(ctx):
        ctx.mark("moe_router_quantile_balancing_ema", "ignored", "used only with quantile_balancing")
    if ctx.get("moe_layer_recompute"):
        ctx.mark("moe_layer_recompute", "approximated", "Megatron recomputes the MoE layers in backward; "
                 "heteroflow's stage recompute (plan.stages[*].recompute) decides for whole layers")


def _same_model(ctx: Context) -> None:
    """Performance, kernel, logging and communication switches of the MoE layer: ignored, each with why;
    any other MoE argument nothing decided is unknown (it might change the model)."""
    for setting in ctx.args.settings:
        dest = setting.dest
        if setting.index in ctx.decided or (dest is None and setting.group != "moe"):
            continue
        reason = None if dest is None else (_SAME.get(dest) or next(
            (why for prefix, why in _SAME_PREFIXES if dest.startswith(prefix)), None))
        if reason is not None:
            ctx.mark_setting(setting, "ignored", reason)
        elif setting.group == "moe" and ctx.args.effective.get(dest or "") in (setting, None):
            ctx.mark_setting(setting, "unknown", "a mixture-of-experts argument heteroflow has no rule for: not "
                                                 "used; check that it does not change the model you want")


def _block(ctx: Context, dest: str, what: str, fix: str) -> None:
    """Refuse the model by one MoE feature, naming its argument and what to change."""
    value = ctx.get(dest)
    shown = "" if isinstance(value, bool) else " " + (" ".join(map(str, value)) if isinstance(value, list)
                                                        else str(value))
    ctx.block(f"mixture-of-experts: {what} ({ctx.key(dest)}{shown}): {fix}")
    ctx.mark(dest, "unsupported", f"{what} is not representable in heteroflow's model.moe")
