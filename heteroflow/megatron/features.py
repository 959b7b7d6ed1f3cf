"""Model features heteroflow cannot represent: the import names them and produces no job.

A heteroflow model is a decoder-only Transformer (`ModelSpec`), dense or mixture-of-experts (`model.moe`,
mapped by `moe.py`, which refuses the MoE variants it cannot represent one by one). Multi-latent
attention, Mamba layers, multi-token prediction, Retro, per-layer heterogeneous blocks, and other
entry points (BERT, T5, vision) would describe a different model, so they block the import.
"""

from __future__ import annotations

import os

from heteroflow.megatron.argtable import FEATURE_GROUPS, FEATURE_SWITCHES
from heteroflow.megatron.context import Context
from heteroflow.megatron.programs import program_family



def _active(ctx: Context, group: str, program: str) -> bool:
    """Whether a feature group is switched on."""
    get = ctx.get
    if group == "moe":
        return bool(get("num_experts"))  # Megatron treats --num-experts 0 as no MoE
    if group == "mla":
        return bool(get("multi_latent_attention"))
    if group == "hybrid":
        return (program in ("pretrain_mamba.py", "pretrain_hybrid.py") or bool(get("is_hybrid_model"))
                or get("hybrid_override_pattern") is not None or get("hybrid_layer_pattern") is not None)
    if group == "mtp":
        return bool(get("mtp_num_layers"))
    if group == "retro":
        return bool(get("retro_add_retriever"))
    if group == "rl":
        return bool(get("perform_rl_step"))
    if group == "heterogeneous":
        return (get("heterogeneous_layers_config_path") is not None
                or get("heterogeneous_layers_config_encoded_json") is not None)
    return False


def check_features(ctx: Context, program: str | None) -> None:
    """Record a blocker for every feature that is on; mark the feature's arguments either way."""
    name = os.path.basename(program or "")
    family = program_family(program) if program else None
    if family is not None:
        ctx.block(family)
    for group, label in FEATURE_GROUPS.items():
        members = [s for s in ctx.args.settings if s.group == group]
        switch = FEATURE_SWITCHES.get(group)
        switch_dest = switch[2:].replace("-", "_") if switch else None
        switch_setting = ctx.args.setting(switch_dest) if switch_dest else None
        if group == "moe":
            members += [s for s in ctx.args.settings if s.dest in ("expert_model_parallel_size",
                                                                     "expert_tensor_parallel_size")]
        if switch_setting is not None:
            members.insert(0, switch_setting)
        if group == "hybrid":
            members += [s for s in ctx.args.settings if s.dest in ("is_hybrid_model", "hybrid_override_pattern",
                                                                     "hybrid_layer_pattern")]
        active = _active(ctx, group, name)
        if active and group == "moe":
            continue  # moe.py maps the MoE arguments and refuses, by name, what it cannot represent
        if not active:
            for setting in members:
                if setting.dest == switch_dest and switch_dest is not None:
                    ctx.mark_setting(setting, "ignored", f"{label} is off")
                elif setting.dest in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
                    continue  # checked below
                else:
                    ctx.mark_setting(setting, "ignored", f"{label} option without effect: the feature is off")
            continue
        shown = list(dict.fromkeys(f"{s.key} {s.shown}".strip() for s in members))
        ctx.block(f"{label} ({', '.join(shown[:6])}{', ...' if len(shown) > 6 else ''}): heteroflow's models "
                  "are dense decoders; importing would describe a different model")
        for setting in members:
            ctx.mark_setting(setting, "unsupported", f"{label}: not representable in heteroflow's ModelSpec")
    if not _active(ctx, "moe", name):
        ep = ctx.get("expert_model_parallel_size")
        if isinstance(ep, int) and ep > 1:
            ctx.error(f"{ctx.key('expert_model_parallel_size')} {ep} needs --num-experts (Megatron: "
                      "\"num_experts must be non None to use expert model parallelism\")")
        if ctx.given("moe_ffn_hidden_size") and str(ctx.get("moe_layer_freq")) == "1":
            ctx.error("moe_ffn_hidden_size is set but num_moe_experts is None. Please set num_moe_experts or remove "
                      "moe_ffn_hidden_size. (Megatron)")
        ctx.mark("expert_model_parallel_size", "ignored", "expert parallelism without experts has no effect")
        ctx.mark("expert_tensor_parallel_size", "ignored", "expert parallelism without experts has no effect")
