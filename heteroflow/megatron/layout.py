"""Megatron's parallel layout: tp / pp / cp / dp, the layer split, batches, ZeRO, recompute, offload.

Megatron uses one layout for every pipeline stage, so the result is a uniform set of stages. Megatron's
own validity rules (`validate_args`, `TransformerConfig.__post_init__`) are checked here with their
messages; a violation is an error because Megatron would refuse to start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from heteroflow.layout import OffloadSpec, ParallelLayout
from heteroflow.megatron.context import Context


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    """A Megatron layout in Megatron's terms: one `ParallelLayout` for every pipeline stage, and how many."""

    world_size: int
    pp: int
    parallel: ParallelLayout
    """Every pipeline stage's layout (Megatron uses one for all): tp, cp, dp, sp, ZeRO, recompute, offload."""
    micro_batch_size: int
    """Megatron's micro-batch, per data-parallel rank."""
    global_batch_size: int
    stage_layers: tuple[int, ...]
    """Transformer layers held by each pipeline rank (all its virtual stages together)."""
    virtual_stages: int | None = None
    rank_order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    """Axes from fastest- to slowest-varying global rank (Megatron's default order tp-cp-ep-dp-pp)."""

    @property
    def plan_micro_batch_size(self) -> int:
        """heteroflow's micro-batch: one Megatron micro-batch on every dp replica."""
        return self.micro_batch_size * self.parallel.dp


def _positive(ctx: Context, dest: str) -> int:
    value = ctx.value(dest)
    if value is None:
        return 1
    if value < 1:
        ctx.error(f"{ctx.key(dest)} must be at least 1, got {value}")
        return 1
    return value


def map_layout(ctx: Context, world_size: int, num_layers: int, seq_length: int | None,
               num_experts: int | None = None) -> MegatronLayout | None:
    """The layout, or None when errors were recorded (`num_experts`: the MoE model's, for ep and etp)."""
    if ctx.given("model_parallel_size"):
        ctx.error("--model-parallel-size is no longer valid in Megatron; use --tensor-model-parallel-size")
    tp, pp, cp = (_positive(ctx, d) for d in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "context_parallel_size"))
    ctx.mark_or_default("tensor_model_parallel_size", "mapped", f"plan.stages[*].tp = {tp}")
    ctx.mark("pipeline_model_parallel_size", "mapped", f"plan: {pp} stage{'s' * (pp != 1)}")
    ctx.mark("context_parallel_size", "mapped", f"plan.stages[*].cp = {cp}")
    if world_size % (tp * pp * cp):
        ctx.error(f"world size ({world_size}) is not divisible by tp * pp * cp = {tp} * {pp} * {cp} = "
                  f"{tp * pp * cp} (Megatron: \"world size is not divisible by total_model_size\")")
        return None
    dp = world_size // (tp * pp * cp)
    if cp > 1 and seq_length is not None and seq_length % (2 * cp):
        ctx.error(f"seq-length {seq_length} should be a multiple of 2 * context-parallel-size = {2 * cp}")
    sp = _sequence_parallel(ctx, tp, seq_length)
    stage_layers, vp = _layer_split(ctx, num_layers, pp)
    mbs, gbs = _batches(ctx, dp)
    zero = _zero(ctx, pp)
    ep, etp = _expert_layout(ctx, world_size, tp, pp, sp, num_experts)
    recompute = _recompute(ctx, stage_layers, tp, sp)
    offload = _offload(ctx, num_layers, pp, recompute)
    order = ("tp", "cp", "dp", "pp")
    if ctx.get("use_tp_pp_dp_mapping"):
        order = ("tp", "cp", "pp", "dp")
        ctx.mark("use_tp_pp_dp_mapping", "mapped", "ranks ordered tp-cp-pp-dp: each stage's devices interleave "
                                                   "across the cluster (see plan.stages[*].devices)")
    if ctx.errors or stage_layers is None or mbs is None:
        return None
    parallel = ParallelLayout(tp=tp, cp=cp, dp=dp, sp=sp, zero=zero, recompute=recompute,
                              offload=OffloadSpec(**offload), ep=ep, etp=etp)
    return MegatronLayout(world_size, pp, parallel, mbs, gbs, tuple(stage_layers), vp, order)


def _expert_layout(ctx: Context, world_size: int, tp: int, pp: int, sp: bool,
                   num_experts: int | None) -> tuple[int, int | None]:
    """ep and etp (None when it is tp, heteroflow's default) of a MoE model, with Megatron's rules on them:
    Megatron folds etp x ep x expert-dp over the world per pipeline stage, as heteroflow folds them over
    each stage's tp x cp x dp ranks, so the same divisibility rule holds."""
    if not num_experts:
        return 1, None  # features.py marks them (and refuses ep > 1 without experts)
    ep = _positive(ctx, "expert_model_parallel_size")
    etp = tp if ctx.value("expert_tensor_parallel_size") is None else _positive(ctx, "expert_tensor_parallel_size")
    if num_experts % ep:
        ctx.error(f"Number of experts should be a multiple of expert model parallel_size. (Megatron: --num-experts "
                  f"{num_experts}, {ctx.key('expert_model_parallel_size')} {ep})")
    if world_size % (etp * ep * pp):
        ctx.error(f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size "
                  f"({etp * ep * pp}) (Megatron: etp {etp} x ep {ep} x pp {pp}; each pipeline stage's "
                  f"{world_size // pp} ranks must hold etp x ep; give more ranks with --nnodes / --nproc-per-node or the "
                  "launcher's variables with --env, or lower --expert-model-parallel-size)")
    if ctx.get("add_bias_linear") and etp != 1:
        ctx.error("Bias in Moe is only supported when ETP==1 (Megatron): pass --disable-bias-linear or "
                  "--expert-tensor-parallel-size 1")
    if tp > 1 and not sp:
        ctx.error("During training, performance may degrade if MoE and tensor parallelism are enabled without also "
                  "enabling sequence parallelism. (Megatron's MoE layer raises this: pass --sequence-parallel)")
    if ctx.get("use_torch_fsdp2") and ep > 1:
        ctx.error("--use-torch-fsdp2 is not supported with expert parallelism (Megatron)")
    ctx.mark_or_default("expert_model_parallel_size", "mapped", f"plan.stages[*].ep = {ep}")
    if ctx.given("expert_tensor_parallel_size"):
        ctx.mark("expert_tensor_parallel_size", "mapped", f"plan.stages[*].etp = {etp}" if etp != tp else
                 f"etp {etp} = tp: heteroflow's default (etp left out of the plan)")
    return ep, (None if etp == tp else etp)


def _sequence_parallel(ctx: Context, tp: int, seq_length: int | None) -> bool:
    if not ctx.get("sequence_parallel"):
        if ctx.get("tp_comm_overlap"):
            ctx.error("--tp-comm-overlap needs sequence parallelism (Megatron: \"Tensor parallel communication/"
                      "GEMM overlap can happen only when sequence parallelism is enabled\")")
        return False
    if tp == 1:
        ctx.mark("sequence_parallel", "ignored", "Megatron disables sequence parallelism when tp = 1")
        if ctx.get("tp_comm_overlap"):
            ctx.error("--tp-comm-overlap needs sequence parallelism, which Megatron disables at tp = 1")
        return False
    if seq_length is not None and seq_length % tp:
        ctx.error(f"sequence parallelism splits the sequence over tp: seq-length {seq_length} is not divisible "
                  f"by tp {tp}")
    ctx.mark("sequence_parallel", "mapped", "plan.stages[*].sp = true")
    ctx.mark("tp_comm_overlap", "ignored", "tp communication / GEMM overlap: communication tuning")
    return True


def _layer_split(ctx: Context, num_layers: int, pp: int) -> tuple[list[int] | None, int | None]:
    """Layers per pipeline rank, and the virtual stages per rank (None without interleaving)."""
    layout_string = ctx.value("pipeline_model_parallel_layout")
    per_vstage = ctx.value("num_layers_per_virtual_pipeline_stage")
    vstages = ctx.value("num_virtual_stages_per_pipeline_rank")
    first, last = ctx.value("decoder_first_pipeline_num_layers"), ctx.value("decoder_last_pipeline_num_layers")
    with_embedding, with_loss = ctx.get("account_for_embedding_in_pipeline_split"), \
        ctx.get("account_for_loss_in_pipeline_split")
    if sum(x is not None for x in (layout_string, per_vstage, vstages)) > 1:
        ctx.error("no more than one of --num-layers-per-virtual-pipeline-stage, "
                  "--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout can be set")
        return None, None
    if ctx.get("standalone_embedding_stage"):
        ctx.error("--standalone-embedding-stage puts no layers on the first stage; heteroflow stages hold at "
                  "least one layer (write the split with --decoder-first-pipeline-num-layers instead)")
        return None, None
    if layout_string is not None:
        return _parse_layout_string(ctx, layout_string, num_layers, pp)
    vp = None
    if per_vstage is not None:
        if first is not None or last is not None:
            ctx.error("please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel "
                      "degree when enable uneven pipeline parallelism (Megatron)")
            return None, None
        total = num_layers + int(bool(with_embedding)) + int(bool(with_loss))
        if total % pp:
            ctx.error(f"number of layers ({total}) must be divisible by pipeline-model-parallel size {pp}")
            return None, None
        if (total // pp) % per_vstage:
            ctx.error(f"number of layers per pipeline stage ({total // pp}) must be divisible by "
                      f"--num-layers-per-virtual-pipeline-stage {per_vstage}")
            return None, None
        vp = total // pp // per_vstage
    elif vstages is not None:
        vp = vstages
    if vp == 1:
        vp = None
    if vp is not None:
        if pp == 1 or (pp == 2 and ctx.get("no_overlap_p2p_communication")):
            ctx.error(f"the interleaved schedule needs pipeline-model-parallel size > {2 if pp == 2 else 1} "
                      f"(got {pp}) (Megatron)")
        detail = (f"heteroflow runs 1F1B without interleaving: each pipeline rank keeps its layers as one stage "
                  f"({vp} virtual stages per rank in Megatron; the smaller interleaved bubble is not modelled)")
        ctx.mark("num_layers_per_virtual_pipeline_stage", "approximated", detail)
        ctx.mark("num_virtual_stages_per_pipeline_rank", "approximated", detail)
    else:
        ctx.mark("num_layers_per_virtual_pipeline_stage", "mapped", "one virtual stage per rank: plain 1F1B")
        ctx.mark("num_virtual_stages_per_pipeline_rank", "mapped", "one virtual stage per rank: plain 1F1B")
    if first is not None or last is not None:
        if with_embedding or with_loss:
            ctx.error("--account-for-*-in-pipeline-split together with --decoder-first/last-pipeline-num-layers "
                      "is not supported by the importer; give the split with one of them")
            return None, vp
        layers = _uneven(ctx, num_layers, pp, first, last)
    else:
        total = num_layers + int(bool(with_embedding)) + int(bool(with_loss))
        if total % pp:
            ctx.error(f"Number of layers should be divisible by the pipeline-model-parallel size: {num_layers} "
                      f"layers{' + embedding' if with_embedding else ''}{' + loss' if with_loss else ''} over "
                      f"{pp} stages (give --decoder-first/last-pipeline-num-layers for an uneven split)")
            return None, vp
        layers = [total // pp] * pp
        layers[0] -= int(bool(with_embedding))
        layers[-1] -= int(bool(with_loss))
        for dest in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            ctx.mark(dest, "mapped", f"plan.stages[*].layers = {layers}")
    if layers is not None:
        if vp is not None and (with_embedding or with_loss) and first is None and last is None:
            # The embedding and the loss count as layers of the first / last virtual stage: what must
            # divide evenly is the layer slots, [1, 2, 2, 1] with vp 2 holds 2 slots per virtual stage.
            total = num_layers + int(bool(with_embedding)) + int(bool(with_loss))
            if total % (pp * vp):
                ctx.error(f"{num_layers} layers{' + embedding' if with_embedding else ''}"
                          f"{' + loss' if with_loss else ''} = {total} must be divisible by pipeline-model-parallel "
                          f"size {pp} x {vp} virtual stages (Megatron)")
        elif vp is not None and any(n % vp for n in layers):
            ctx.error(f"layers per pipeline rank {layers} must divide into {vp} virtual stages each")
        if any(n < 1 for n in layers):
            ctx.error(f"the split {layers} leaves a pipeline stage without transformer layers; heteroflow stages "
                      "hold at least one layer")
            return None, vp
    return layers, vp


def _uneven(ctx: Context, num_layers: int, pp: int, first: int | None, last: int | None) -> list[int] | None:
    if pp == 1:
        ctx.error("--decoder-first/last-pipeline-num-layers need pipeline-model-parallel size > 1")
        return None
    fixed = (first or 0) + (last or 0)
    middle = pp - (first is not None) - (last is not None)
    remaining = num_layers - fixed
    if remaining < 0 or (middle == 0 and remaining != 0) or (middle > 0 and remaining % middle):
        ctx.error(f"uneven pipeline split does not add up: {num_layers} layers, first stage {first}, last stage "
                  f"{last}, {max(middle, 0)} middle stages get {remaining} layers")
        return None
    per = remaining // middle if middle else 0
    layers = [per] * pp
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    for dest in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        ctx.mark(dest, "mapped", f"plan.stages[*].layers = {layers}")
    return layers


def _expand_layout(text: str) -> str:
    """`(t|)*3` -> `t|t|t|`; `t*3` -> `ttt` (Megatron's --pipeline-model-parallel-layout syntax)."""
    text = re.sub(r"[\s,]", "", text)
    while True:
        inner = re.search(r"\(([^()]*)\)\*(\d+)", text)
        if inner is None:
            break
        text = text[:inner.start()] + inner.group(1) * int(inner.group(2)) + text[inner.end():]
    return re.sub(r"([A-Za-z])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)


def _parse_layout_string(ctx: Context, text: str, num_layers: int, pp: int):
    expanded = _expand_layout(text)
    if re.search(r"[^ELtm|]", expanded):
        ctx.error(f"--pipeline-model-parallel-layout {text!r}: cannot read it (expected E, L, t, m, |, (...)*N)")
        return None, None
    stages = expanded.split("|")
    if len(stages) % pp:
        ctx.error(f"the length of --pipeline-model-parallel-layout ({len(stages)} stages) must be divisible by "
                  f"pipeline_model_parallel_size ({pp})")
        return None, None
    vp = len(stages) // pp
    layers = [sum(stages[v * pp + r].count("t") for v in range(vp)) for r in range(pp)]
    if sum(layers) != num_layers:
        ctx.error(f"--pipeline-model-parallel-layout places {sum(layers)} transformer layers, the model has "
                  f"{num_layers}")
        return None, None
    if any(n < 1 for n in layers):
        ctx.error(f"--pipeline-model-parallel-layout leaves a pipeline rank without transformer layers {layers}; "
                  "heteroflow stages hold at least one layer")
        return None, None
    detail = f"plan.stages[*].layers = {layers}"
    if vp > 1:
        ctx.mark("pipeline_model_parallel_layout", "approximated",
                 detail + f"; {vp} virtual stages per rank run as one (1F1B without interleaving)")
    else:
        ctx.mark("pipeline_model_parallel_layout", "mapped", detail)
    return layers, (vp if vp > 1 else None)


def _batches(ctx: Context, dp: int) -> tuple[int | None, int]:
    if ctx.given("batch_size"):
        ctx.error("--batch-size argument is no longer valid, use --micro-batch-size instead (Megatron)")
    mbs = ctx.required("micro_batch_size")
    if mbs is None:
        return None, 0
    if mbs < 1:
        ctx.error(f"{ctx.key('micro_batch_size')} must be positive, got {mbs}")
        return None, 0
    gbs = ctx.value("global_batch_size")
    if gbs is None:
        gbs = mbs * dp
        ctx.default_value("global_batch_size", gbs, f"train.global_batch_size = {gbs} (Megatron's default: "
                                                    f"micro-batch {mbs} x dp {dp})")
    elif gbs % (mbs * dp):
        ctx.error(f"global batch size ({gbs}) is not divisible by micro batch size ({mbs}) times data parallel "
                  f"size ({dp})")
    ctx.mark("micro_batch_size", "mapped", f"plan.micro_batch_size = {mbs} x dp {dp} = {mbs * dp} (one Megatron "
                                           "micro-batch on every dp replica)")
    ctx.mark("global_batch_size", "mapped", f"train.global_batch_size = {gbs} ({gbs // (mbs * dp)} micro-batches "
                                            "per step)")
    ramp = ctx.get("rampup_batch_size")
    if ramp:
        ctx.mark("rampup_batch_size", "approximated", f"heteroflow trains with the final global batch {gbs} "
                                                      "from the first step (no ramp-up)")
    return mbs, gbs


def _zero(ctx: Context, pp: int) -> int:
    if ctx.get("deepspeed"):
        stage = ctx.value("zero_stage")
        if stage is None or not 0 <= stage <= 3:
            ctx.error(f"--zero-stage must be 0, 1, 2 or 3, got {stage}")
            return 0
        if stage > 1 and pp > 1:
            ctx.error(f"ZeRO-{stage} is incompatible with pipeline parallelism (DeepSpeed); use --zero-stage 0 or 1")
        ctx.mark("deepspeed", "mapped", f"Megatron-DeepSpeed: plan.stages[*].zero = {stage} (--zero-stage)")
        ctx.mark_or_default("zero_stage", "mapped", f"plan.stages[*].zero = {stage}")
        return stage
    ctx.mark("zero_stage", "ignored", "used only with --deepspeed (Megatron-DeepSpeed)")
    dist_opt = bool(ctx.get("use_distributed_optimizer"))
    strategy = ctx.get("data_parallel_sharding_strategy")
    if ctx.get("use_torch_fsdp2"):
        if pp > 1:
            ctx.error("--use-torch-fsdp2 is not supported with pipeline parallelism (Megatron)")
        if dist_opt:
            ctx.error("--use-torch-fsdp2 is not supported with MCore's distributed optimizer (Megatron)")
        if not ctx.get("untie_embeddings_and_output_weights"):
            ctx.error("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights (Megatron)")
        if ctx.get("fp16"):
            ctx.error("--use-torch-fsdp2 not supported with fp16 yet (Megatron)")
        ctx.mark("use_torch_fsdp2", "mapped", "plan.stages[*].zero = 3 (FSDP2 shards parameters, gradients and "
                                              "optimizer state over dp)")
        if not ctx.get("torch_fsdp2_reshard_after_forward"):
            ctx.mark("torch_fsdp2_reshard_after_forward", "approximated",
                     "Megatron keeps parameters gathered from forward to backward; heteroflow's ZeRO-3 gathers "
                     "them again (less memory, more communication)")
        ctx.mark("data_parallel_sharding_strategy", "ignored", "used only with --use-megatron-fsdp")
        return 3
    if ctx.get("use_megatron_fsdp"):
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[strategy]
        ctx.mark("use_megatron_fsdp", "mapped", f"plan.stages[*].zero = {zero} (sharding strategy {strategy})")
        ctx.mark("data_parallel_sharding_strategy", "mapped", f"plan.stages[*].zero = {zero}")
        ctx.mark("use_distributed_optimizer", "mapped", "part of Megatron FSDP (see --data-parallel-sharding-strategy)")
        return zero
    ctx.mark("data_parallel_sharding_strategy", "ignored", "used only with --use-megatron-fsdp")
    ctx.mark("torch_fsdp2_reshard_after_forward", "ignored", "used only with --use-torch-fsdp2")
    if ctx.get("overlap_param_gather") and not dist_opt:
        ctx.error("--overlap-param-gather only supported with distributed optimizer or megatron fsdp (Megatron)")
    if ctx.get("overlap_param_gather") and not ctx.get("overlap_grad_reduce"):
        ctx.error("Must use --overlap-param-gather with --overlap-grad-reduce (Megatron)")
    ctx.mark("overlap_param_gather", "ignored", "overlaps the distributed optimizer's parameter all-gather: "
                                                "communication tuning")
    ctx.mark("overlap_grad_reduce", "ignored", "overlaps the data-parallel gradient reduction: communication tuning")
    instances = ctx.get("num_distributed_optimizer_instances")
    if not dist_opt:
        ctx.mark("num_distributed_optimizer_instances", "ignored", "used only with --use-distributed-optimizer")
        return 0
    ctx.mark("use_distributed_optimizer", "mapped", "plan.stages[*].zero = 1 (optimizer state sharded over dp)")
    if instances and instances > 1:
        ctx.mark("num_distributed_optimizer_instances", "approximated",
                 f"Megatron shards the optimizer over dp / {instances}; heteroflow's ZeRO-1 over the whole dp group")
    else:
        ctx.mark("num_distributed_optimizer_instances", "mapped", "one optimizer instance: ZeRO-1 over dp")
    return 1


def _recompute(ctx: Context, stage_layers: list[int] | None, tp: int, sp: bool) -> str:
    granularity = ctx.value("recompute_granularity")
    method, count = ctx.value("recompute_method"), ctx.value("recompute_num_layers")
    if ctx.get("checkpoint_activations") and granularity is None:
        granularity = "full"
        ctx.mark("checkpoint_activations", "approximated", "older Megatron spelling (current Megatron rejects it); "
                                                          "read as full recompute of every layer")
        method, count = method or "uniform", count or 1
    if ctx.get("recompute_activations"):
        granularity = "selective"
        ctx.mark("recompute_activations", "mapped", "plan.stages[*].recompute = selective (attention core)")
    if granularity is None:
        for dest in ("recompute_method", "recompute_num_layers", "recompute_modules", "distribute_saved_activations"):
            ctx.mark(dest, "ignored", "no effect without --recompute-granularity")
        if ctx.get("distribute_saved_activations"):
            ctx.error("distributed recompute activations is only application to full recompute granularity "
                      "(Megatron)")
        return "none"
    if granularity == "selective":
        if method is not None:
            ctx.error("recompute method is not yet supported for selective recomputing granularity (Megatron)")
        if count is not None:
            ctx.error("When using recompute_granularity: selective recompute_num_layers must be None (Megatron)")
        modules = ctx.get("recompute_modules") or ["core_attn"]
        ctx.mark("recompute_granularity", "mapped", "plan.stages[*].recompute = selective (attention core)")
        extra = [m for m in modules if m != "core_attn"]
        if extra:
            ctx.mark("recompute_modules", "approximated", f"heteroflow's selective recompute covers the attention "
                                                          f"core only; Megatron also recomputes {', '.join(extra)}")
        else:
            ctx.mark("recompute_modules", "mapped", "attention core: heteroflow's selective recompute")
        return "selective"
    if method is None:
        ctx.error("Using recompute_granularity: full so recompute_method must be \"block\" or \"uniform\" (Megatron)")
    per_rank = min(stage_layers) if stage_layers else None
    if count is None:
        ctx.error("When using recompute_granularity: full recompute_num_layers must be between 1 and "
                  "num_layers_per_pipeline_rank (Megatron)")
    elif count < 1 or (per_rank is not None and count > max(stage_layers)):
        ctx.error(f"recompute-num-layers {count} must be between 1 and the layers per pipeline rank")
    if ctx.get("distribute_saved_activations"):
        if tp == 1:
            ctx.error("can distribute recomputed activations only across tensor model parallel groups (tp > 1)")
        if sp:
            ctx.error("distribute_saved_activations must be false when sequence parallel is enabled (Megatron)")
        ctx.mark("distribute_saved_activations", "approximated", "Megatron splits checkpointed activations over tp; "
                                                                 "heteroflow keeps them whole on each tp rank")
    ctx.mark("recompute_granularity", "mapped", "plan.stages[*].recompute = full")
    ctx.mark("recompute_modules", "ignored", "used only with selective recompute")
    if method == "block" and count is not None and stage_layers and count < max(stage_layers):
        detail = (f"heteroflow recomputes every layer of a stage; Megatron recomputes {count} of each pipeline "
                  f"rank's {max(stage_layers)} layers (the planner overestimates compute, underestimates memory)")
        ctx.mark("recompute_method", "approximated", detail)
        ctx.mark("recompute_num_layers", "approximated", detail)
    else:
        ctx.mark("recompute_method", "mapped", "every layer is recomputed: plan.stages[*].recompute = full")
        ctx.mark("recompute_num_layers", "mapped", "checkpoint granularity inside full recompute (same compute)")
    return "full"


def _offload(ctx: Context, num_layers: int, pp: int, recompute: str) -> dict:
    offload: dict = {}
    precision_aware = bool(ctx.get("use_precision_aware_optimizer"))
    if ctx.get("optimizer_cpu_offload"):
        if not precision_aware:
            ctx.error("The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer` "
                      "(Megatron)")
        offload["optimizer"] = "cpu"
        ctx.mark("optimizer_cpu_offload", "mapped", "plan.stages[*].offload.optimizer = cpu")
        fraction = ctx.get("optimizer_offload_fraction")
        if fraction is not None and fraction < 1.0:
            ctx.mark("optimizer_offload_fraction", "approximated", f"Megatron keeps {1 - fraction:.0%} of the "
                                                                   "optimizer on the device; heteroflow offloads all")
        else:
            ctx.mark("optimizer_offload_fraction", "mapped", "the whole optimizer state is offloaded")
    else:
        ctx.mark("optimizer_offload_fraction", "ignored", "used only with --optimizer-cpu-offload")
    dtype_dests = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    if precision_aware:
        ctx.mark("use_precision_aware_optimizer", "mapped", "Adam with fp32 state unless the dtypes below say "
                                                            "otherwise")
        for dest in dtype_dests:
            if ctx.get(dest) not in (None, "fp32"):
                ctx.mark(dest, "approximated", f"heteroflow keeps this optimizer state in fp32, not {ctx.get(dest)} "
                                               "(the planner's memory estimate is higher than Megatron's)")
            else:
                ctx.mark(dest, "mapped", "fp32, as heteroflow")
    else:
        for dest in dtype_dests:
            ctx.mark(dest, "ignored", "used only with --use-precision-aware-optimizer")
    layers = ctx.get("cpu_offloading_num_layers") or 0
    if layers > 0:
        if layers >= num_layers:
            ctx.error(f"CPU offloading can be done only for layers less than {num_layers} (Megatron)")
        if pp > 1:
            ctx.error("Currently there is no support for Pipeline parallelism with CPU offloading (Megatron)")
        if recompute != "none":
            ctx.error("CPU offloading does not work when activation recomputation is enabled (Megatron)")
        offload["activations"] = "cpu"
        ctx.mark("cpu_offloading_num_layers", "approximated", f"plan.stages[*].offload.activations = cpu: heteroflow "
                                                              f"offloads every layer's activations, Megatron {layers}")
    else:
        ctx.mark("cpu_offloading_num_layers", "mapped", "activations stay on the device")
    return offload
