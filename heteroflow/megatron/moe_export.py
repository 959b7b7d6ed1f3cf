"""heteroflow's `model.moe` and per-stage ep / etp -> Megatron's MoE arguments (the inverse of `moe.py`)."""

from __future__ import annotations

from heteroflow.config.moe import MoESpec
from heteroflow.errors import UserError
from heteroflow.megatron.moe_pattern import layer_freq_arg


def moe_args(moe: MoESpec, num_layers: int) -> list[str]:
    """The MoE model arguments (`MOE_ARGS`) reproducing `moe`."""
    if moe.top_k == 1 and (moe.score_function == "sigmoid" or moe.normalize_top_k):
        # Megatron weighs a single expert by its raw probability (softmax needs --moe-router-pre-softmax at
        # top-k 1; sigmoid is not normalised for one expert); heteroflow's normalised weight is 1.
        raise UserError("model.moe: top_k 1 with normalised weights has no Megatron equivalent (Megatron weighs the "
                        "one expert by its probability); set normalize_top_k: false with softmax scores")
    args = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.ffn_hidden_size),
            "--moe-router-score-function", moe.score_function]
    if moe.score_function == "softmax" and not moe.normalize_top_k:
        args.append("--moe-router-pre-softmax")
    if moe.shared_expert_ffn_hidden_size:
        args += ["--moe-shared-expert-intermediate-size", str(moe.shared_expert_ffn_hidden_size)]
        if moe.shared_expert_gate:
            args.append("--moe-shared-expert-gate")
    if moe.first_dense_layers or moe.layer_freq != 1:
        args += ["--moe-layer-freq", layer_freq_arg(num_layers, moe.first_dense_layers, moe.layer_freq)]
    if moe.sinkhorn:
        args += ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]
    elif moe.aux_loss_coeff:
        # Megatron's aux loss is heteroflow's / top_k (moe.py): the same gradient needs top_k x the coefficient.
        kind = "seq_aux_loss" if moe.aux_loss_type == "sequence" else "aux_loss"
        args += ["--moe-router-load-balancing-type", kind, "--moe-aux-loss-coeff", repr(moe.aux_loss_coeff * moe.top_k)]
    else:
        args += ["--moe-router-load-balancing-type", "none"]
    if moe.z_loss_coeff:
        args += ["--moe-z-loss-coeff", repr(moe.z_loss_coeff)]
    if moe.topk_scaling_factor != 1.0:
        args += ["--moe-router-topk-scaling-factor", repr(moe.topk_scaling_factor)]
    if moe.capacity_factor is not None:
        args += ["--moe-expert-capacity-factor", repr(moe.capacity_factor), "--moe-token-drop-policy", "position"]
    # heteroflow's runtime exchanges tokens by all-to-all; Megatron's default dispatcher is allgather.
    args += ["--moe-token-dispatcher-type", "alltoall"]
    return args


def expert_parallel_args(ep: int, expert_tp: int, tp: int) -> list[str]:
    """`--expert-model-parallel-size` / `--expert-tensor-parallel-size` (only where not Megatron's default)."""
    args = ["--expert-model-parallel-size", str(ep)] if ep != 1 else []
    if expert_tp != tp:
        args += ["--expert-tensor-parallel-size", str(expert_tp)]
    return args
