"""`StageCosts`: one stage's forward/backward time per micro-batch, per-step tail and memory per device.

A stage is priced at its own precision, the one its device model computes in (`StageHardware.device`,
built for `ParallelLayout.compute_precision`): GEMMs at that precision's peak or measured curve, weights,
activations and collectives at its element size (`memory.dtype_bytes`), training state at
`memory.state_bytes_per_param`.

Everything is affine in the stage's layer count (plus first/last-stage extras), so the planner can price a
layout once and read off any layer count; `evaluate_plan` uses the same numbers.

Overlap assumptions:
- TP collectives are exposed (added to compute); recompute repeats the forward ones in the backward.
- Per block, traffic that a prefetching runtime hides behind that block's compute is overlapped with it
  (time = max(compute, traffic)): ZeRO-3 parameter all-gathers and gradient reduce-scatters, parameter
  fetches from CPU/SSD, activation offload to CPU and back.
- Context parallelism (`models/cp_attention.py`): each block all-gathers K/V over cp before its attention
  in the forward, and gathers them again and reduce-scatters their gradients in the backward, exposed
  (the runtime waits for them); the weights' gradients are all-reduced over cp once per step, in the
  tail, before the dp reduction. The backward's gathered K/V (at the kv heads) and their fp32 gradients are
  transient memory of one block (`context_parallel_working_bytes`).
- A MoE block's all-to-alls (token dispatch and combine in the forward, their adjoints in the backward; again
  in the backward under full recompute) are exposed, on the ep group's links (`comm.ep_alltoall_s`), at the
  expected bytes of uniform routing times the load allowance (`layout.routing`). The routed experts'
  gradients are reduced over expert-dp, in collectives of their own when that group is not the dp group.
- The tail of a step (the dp gradient reduction: an all-reduce for ZeRO 0, a reduce-scatter for ZeRO 1 and 2,
  which `models.data_parallel` runs alike; the parameter all-gather after the step for ZeRO 1/2, the
  optimizer step with any offload traffic and CPU Adam) is not overlapped: it starts after the pipeline flush,
  and the step ends when the slowest stage finishes it (gradient clipping needs the global norm, so the stages
  synchronize there).
- Gradient reductions (over dp, over cp, ZeRO-3's reduce-scatters) send `layout.GRAD_REDUCE_BYTES` per
  element, the fp32 buffer the runtime reduces, whatever the stage computes in.
- ZeRO 1/2 with the optimizer offloaded (ZeRO-Offload): every gradient goes to the host (in the compute
  dtype), is reduce-scattered there over dp (after the backward), the host Adam updates 1/dp of the state and
  1/dp of the updated weights go back up before the all-gather.
- Offload bandwidths: the device's host link for CPU; for SSD the node's NVMe read/write bandwidth shared
  by the node's devices (and never more than the host link); CPU Adam streams 28 bytes per parameter at
  the node's host memory bandwidth shared by its devices; the on-device AdamW streams what heteroflow's
  unfused implementation does (`DEVICE_ADAM_BYTES_PER_PARAM`, `FLAT_BUFFER_BYTES_PER_PARAM`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from heteroflow.config.model import ModelSpec
from heteroflow.stagemap.comm import all_gather_s, all_reduce_s, dp_link, ep_alltoall_s
from heteroflow.layout.routing import ALLTOALLS_PER_LAYER, alltoall_bytes_per_rank, load_allowance
from heteroflow.layout.shards import (embedding_params_per_rank, expert_params_per_rank, head_params_per_rank,
                                      kv_heads_per_rank, layer_params_per_rank)
from heteroflow.stagemap.compute import embedding_s, grad_accumulate_s, head_s, layer_forward
from heteroflow.stagemap.hardware import DeviceModel, Hardware
from heteroflow.stagemap.topology import Placement, slices, stage_fractions
from heteroflow.layout import GRAD_REDUCE_BYTES, ParallelLayout
from heteroflow.stagemap.memory import (Affine, MemoryModel, MemoryParts, activation_bytes, dtype_bytes,
                                        memory_from_parts, memory_parts,
                                        memory_total_from_parts, state_bytes_per_param)

ADAM_BYTES_PER_PARAM = 28
"""A fused AdamW step (CPU Adam of offloaded optimizer state): read grad, master, two moments; write three."""
DEVICE_ADAM_BYTES_PER_PARAM = 104
"""heteroflow's on-device AdamW (`models.data_parallel.DataParallelAdamW`), per parameter of the rank's shard:
the clip scale, weight decay, lerp, mul, addcmul, sqrt, bias division, eps add, addcdiv (92 bytes) and the
gradient-norm share (12)."""
FLAT_BUFFER_BYTES_PER_PARAM = 20
"""...and per local parameter: its flat fp32 gradient buffer zeroed and filled (12), the weights copied back (8)
(not under ZeRO-3: `models.zero3.Zero3AdamW` updates the parameter shards in place)."""


@dataclass(frozen=True, slots=True)
class StageHardware:
    """The shape of one stage's devices: their model (in the stage's precision), count, how many nodes they
    span, devices per node."""

    device: DeviceModel
    num_devices: int
    num_nodes: int
    node_count: int
    """Devices per node on these nodes (shares of NVMe and host memory bandwidth)."""
    placement: Placement | None = None
    """(node ordinal, device index) of each stage-local rank, for the device's topology; None: any slice of a
    node of this size (the planner), priced as the slowest (`stagemap.topology`)."""

    @property
    def single_node(self) -> bool:
        return self.num_nodes == 1

    @property
    def precision(self) -> str:
        """The precision the stage computes in (its device model's)."""
        return self.device.precision


@dataclass(frozen=True, slots=True)
class StageComm:
    """The exposed tp-collective seconds inside `StageCosts`' forward and backward figures (per layer, first-
    and last-stage extras), and the dp gradient reduction's share of its tail (constant, per parameter)."""

    fwd_layer_s: float
    bwd_layer_s: float
    fwd_first_s: float
    bwd_first_s: float
    fwd_last_s: float
    bwd_last_s: float
    dp_const_s: float
    dp_per_param_s: float
    alltoall_fwd_layer_s: float = 0.0
    """A MoE block's all-to-alls (dispatch and combine) inside its forward figure, per layer."""
    alltoall_bwd_layer_s: float = 0.0
    dp_expert_layer_s: float = 0.0
    """Per layer, what the routed experts' gradient reduction over expert-dp adds to `dp_per_param_s` x params
    (their reduction replaces the dp one, so this may be negative)."""


@dataclass(frozen=True, slots=True)
class MicroBatchParts:
    """One stage's priced time split by part: forward and backward of one micro-batch (compute, and the
    exposed tp collectives inside it; no boundary transfer) and the step's tail (dp reduction, optimizer)."""

    forward_s: float
    forward_comm_s: float
    backward_s: float
    backward_comm_s: float
    dp_s: float
    optimizer_s: float
    forward_alltoall_s: float = 0.0
    """A MoE stage's all-to-alls inside its forward (dispatch and combine of every block)."""
    backward_alltoall_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Affine cost model of one stage under one layout and micro-batch size."""

    fwd_layer_s: float
    bwd_layer_s: float
    fwd_first_s: float
    bwd_first_s: float
    fwd_last_s: float
    bwd_last_s: float
    tail_const_s: float
    tail_per_param_s: float
    params: Affine
    """Parameters per device (as an affine function; in_flight unused)."""
    memory_total: Affine
    memory_parts: MemoryParts = field(repr=False, compare=False)
    layout: ParallelLayout = field(repr=False, compare=False)
    comm: StageComm = field(repr=False, compare=False)
    """The collective and dp-reduction shares of the figures above (`parts` splits a stage's time with them)."""
    tail_expert_layer_s: float = 0.0
    """Per layer, what pricing the routed experts' state at the expert layout (gradients reduced and ZeRO state
    sharded over expert-dp) adds to `tail_per_param_s` x params (negative when expert-dp is the larger group)."""

    @property
    def memory(self) -> MemoryModel:
        """Memory by component (weights, gradients, optimizer, activations, transient, reserve)."""
        return memory_from_parts(self.memory_parts, self.layout)

    def forward_s(self, layers: int, first: bool, last: bool) -> float:
        """Forward seconds of one micro-batch (compute and exposed collectives, no boundary transfer)."""
        return layers * self.fwd_layer_s + self.fwd_first_s * first + self.fwd_last_s * last

    def backward_s(self, layers: int, first: bool, last: bool) -> float:
        """Backward seconds of one micro-batch."""
        return layers * self.bwd_layer_s + self.bwd_first_s * first + self.bwd_last_s * last

    def tail_s(self, layers: int, first: bool, last: bool) -> float:
        """Seconds after the flush: gradient reduction, parameter gather and optimizer step."""
        return (self.tail_const_s + self.tail_per_param_s * self.params.at(layers, 0, first, last)
                + self.tail_expert_layer_s * layers)

    def memory_bytes(self, layers: int, in_flight: int, first: bool, last: bool) -> float:
        """Peak bytes per device, reserve included."""
        return self.memory_total.at(layers, in_flight, first, last)

    def parts(self, layers: int, first: bool, last: bool) -> MicroBatchParts:
        """`forward_s`, `backward_s` and `tail_s` split into compute, exposed tp collectives, dp reduction and
        optimizer step: the split of the very figures the planner adds up, so the parts sum to them."""
        c = self.comm
        fwd_comm = layers * c.fwd_layer_s + c.fwd_first_s * first + c.fwd_last_s * last
        bwd_comm = layers * c.bwd_layer_s + c.bwd_first_s * first + c.bwd_last_s * last
        fwd_a2a, bwd_a2a = layers * c.alltoall_fwd_layer_s, layers * c.alltoall_bwd_layer_s
        dp = c.dp_const_s + c.dp_per_param_s * self.params.at(layers, 0, first, last) + c.dp_expert_layer_s * layers
        return MicroBatchParts(forward_s=self.forward_s(layers, first, last) - fwd_comm - fwd_a2a,
                               forward_comm_s=fwd_comm,
                               backward_s=self.backward_s(layers, first, last) - bwd_comm - bwd_a2a,
                               backward_comm_s=bwd_comm, dp_s=dp, optimizer_s=self.tail_s(layers, first, last) - dp,
                               forward_alltoall_s=fwd_a2a, backward_alltoall_s=bwd_a2a)


def stage_costs(model: ModelSpec, hw: StageHardware, layout: ParallelLayout, micro_batch_size: int,
                hardware: Hardware) -> StageCosts:
    """The cost model of a stage computing in `hw.precision` (cached: the planner asks for the same
    combinations many times). A layout that names a precision must name that one."""
    _check_precision(hw, layout)
    return _stage_costs(model, hw, layout, micro_batch_size, hardware.inter_node_gb_per_s,
                        hardware.inter_latency_s, hardware.emulate)


def _check_precision(hw: StageHardware, layout: ParallelLayout) -> None:
    assert layout.precision in (None, hw.precision), (layout.precision, hw.precision)


@lru_cache(maxsize=200_000)
def _stage_costs(model: ModelSpec, hw: StageHardware, layout: ParallelLayout, mbs: int,
                 inter_gb_per_s: float, inter_latency_s: float, emulate: bool) -> StageCosts:
    b = _base(model, hw, layout.tp, layout.dp, layout.cp, layout.sp, layout.ep, layout.etp, mbs, inter_gb_per_s,
              inter_latency_s, emulate)
    return costs_from_base(hw, layout, b)


def stage_costs_many(model: ModelSpec, hw: StageHardware, layouts: list[ParallelLayout], mbs: int,
                     hardware: Hardware) -> list[StageCosts]:
    """`stage_costs` for many layouts of one stage shape (the shared part computed once per tp/dp/cp/sp/ep/etp)."""
    bases: dict[tuple, _Base] = {}
    out = []
    for lay in layouts:
        _check_precision(hw, lay)
        key = (lay.tp, lay.dp, lay.cp, lay.sp, lay.ep, lay.etp)
        if key not in bases:
            bases[key] = _base(model, hw, *key, mbs,
                               hardware.inter_node_gb_per_s, hardware.inter_latency_s, hardware.emulate)
        out.append(costs_from_base(hw, lay, bases[key]))
    return out


def costs_from_base(hw: StageHardware, layout: ParallelLayout, b: "_Base") -> StageCosts:
    """Apply ZeRO, recompute and offload to the shared part of a stage's costs."""
    compute_fwd = b.compute_fwd
    compute_bwd = b.compute_bwd
    tp_bwd, a2a_bwd = b.tp_bwd, b.alltoall_bwd
    if layout.recompute == "full":  # the recomputed forward dispatches and combines its tokens again
        compute_bwd += compute_fwd
        tp_bwd += b.tp_fwd
        a2a_bwd += b.alltoall_fwd
    elif layout.recompute == "selective":
        compute_bwd += b.attn_fwd + b.activation_fn_s

    off = layout.offload
    # ZeRO-3 reduce-scatters each micro-batch's gradients instead; an offloaded optimizer adds them in its tier.
    on_device = layout.zero < 3 and off.optimizer == "device"
    accumulate_layer, accumulate_emb, accumulate_head = b.accumulate if on_device else (0.0, 0.0, 0.0)
    compute_bwd += accumulate_layer

    # Traffic hidden behind each block's compute.
    overlap_fwd = overlap_bwd = 0.0
    if layout.zero >= 3:  # `models.zero3`: gathered for forward, again for backward, gradients reduced in fp32
        overlap_fwd += b.gather_weights_s
        overlap_bwd += b.gather_weights_s + b.zero3_scatter_s
    if off.params != "device":
        read_bw, write_bw = _tier_bandwidth(hw.device, hw, off.params)
        shard = b.p_layer / (layout.replicas if layout.zero >= 3 else 1)
        overlap_fwd += shard * b.wb / (read_bw * 1e9)
        overlap_bwd += shard * b.wb / (read_bw * 1e9) + shard * b.gb / (write_bw * 1e9)
    if off.activations != "device":
        stored = b.stored[layout.recompute]
        overlap_fwd += stored / (hw.device.host_link_gb_per_s * 1e9)
        overlap_bwd += stored / (hw.device.host_link_gb_per_s * 1e9)
    fwd_layer = max(compute_fwd, overlap_fwd) + b.tp_fwd + b.alltoall_fwd
    bwd_layer = max(compute_bwd, overlap_bwd) + tp_bwd + a2a_bwd

    emb_f, emb_b, head_f, head_b = b.emb_f, b.emb_b + accumulate_emb, b.head_f, b.head_b + accumulate_head
    if layout.zero >= 3:
        emb_f, emb_b, head_f, head_b = (emb_f + b.zero3_extras[0], emb_b + b.zero3_extras[1],
                                        head_f + b.zero3_extras[2], head_b + b.zero3_extras[3])
    dp_const, dp_per_param, opt_const, opt_per_param = _tail(layout, hw.device, hw, b.dp_bw, b.dp_lat, b.cp_bw,
                                                             b.wb, b.gb, b.ob)
    dp_expert = opt_expert = 0.0
    if b.p_expert and _separate_expert_groups(layout):
        # The routed experts' gradients are reduced (and their ZeRO state sharded) over expert-dp, in
        # collectives of their own: their per-parameter rates replace the dp ones, their latencies add.
        expert_layout = replace(layout, tp=1, cp=1, dp=layout.expert_dp, ep=1, etp=None)
        e_const, e_per_param, eo_const, eo_per_param = _tail(expert_layout, hw.device, hw, b.expert_dp_bw,
                                                             b.expert_dp_lat, b.cp_bw, b.wb, b.gb, b.ob)
        dp_const, opt_const = dp_const + e_const, opt_const + eo_const
        dp_expert = (e_per_param - dp_per_param) * b.p_expert
        opt_expert = (eo_per_param - opt_per_param) * b.p_expert
    comm = StageComm(fwd_layer_s=b.tp_fwd, bwd_layer_s=tp_bwd, fwd_first_s=b.comm_emb_f, bwd_first_s=0.0,
                     fwd_last_s=b.comm_head_f, bwd_last_s=b.comm_head_b, dp_const_s=dp_const,
                     dp_per_param_s=dp_per_param, alltoall_fwd_layer_s=b.alltoall_fwd, alltoall_bwd_layer_s=a2a_bwd,
                     dp_expert_layer_s=dp_expert)
    return StageCosts(fwd_layer_s=fwd_layer, bwd_layer_s=bwd_layer, fwd_first_s=emb_f, bwd_first_s=emb_b,
                      fwd_last_s=head_f, bwd_last_s=head_b, tail_const_s=dp_const + opt_const,
                      tail_per_param_s=dp_per_param + opt_per_param,
                      params=b.params, memory_total=memory_total_from_parts(b.memory, layout),
                      memory_parts=b.memory, layout=layout, comm=comm, tail_expert_layer_s=dp_expert + opt_expert)


def _separate_expert_groups(layout: ParallelLayout) -> bool:
    """Whether the routed experts' gradients are reduced over other ranks than the dp group (ep > 1, an etp other
    than tp, or cp folded into expert-dp)."""
    return layout.expert_dp != layout.dp or layout.cp > 1


@dataclass(frozen=True, slots=True)
class _Base:
    """What a stage costs before ZeRO, recompute and offload are applied."""

    tokens: float
    wb: int
    gb: int
    ob: int
    compute_fwd: float
    compute_bwd: float
    attn_fwd: float
    activation_fn_s: float
    tp_fwd: float
    tp_bwd: float
    """The tp collectives of one block's backward (the adjoints of the forward's)."""
    comm_emb_f: float
    comm_head_f: float
    comm_head_b: float
    """The tp collectives inside emb_f, head_f and head_b."""
    dp_bw: float
    dp_lat: float
    cp_bw: float
    """GB/s of the stage's cp collectives (the tp link, on the cp groups' slowest links)."""
    expert_dp_bw: float
    expert_dp_lat: float
    """The link of the expert-dp rings (`etp * ep` of them run side by side, as tp * cp dp rings do)."""
    alltoall_fwd: float
    alltoall_bwd: float
    """A MoE block's all-to-alls (`layout.routing.ALLTOALLS_PER_LAYER`) in its forward and backward."""
    p_layer: float
    p_expert: float
    """The routed experts' share of `p_layer`."""
    gather_weights_s: float
    zero3_scatter_s: float
    """A block's fp32 gradient reduce-scatter under ZeRO-3."""
    emb_f: float
    emb_b: float
    head_f: float
    head_b: float
    zero3_extras: tuple[float, float, float, float]
    accumulate: tuple[float, float, float]
    """Adding a micro-batch's gradients into the on-device fp32 buffer: a block's, the embedding's, the head's."""
    params: Affine
    stored: dict = field(hash=False)
    """Stored activation bytes per block and micro-batch, by recompute mode."""
    memory: MemoryParts = field(hash=False)


@lru_cache(maxsize=20_000)
def _base(model: ModelSpec, hw: StageHardware, tp: int, dp: int, cp: int, sp: bool, ep: int, etp: int | None, mbs: int,
          inter_gb_per_s: float, inter_latency_s: float, emulate: bool) -> _Base:
    hardware = Hardware(models={}, inter_node_gb_per_s=inter_gb_per_s, inter_latency_s=inter_latency_s,
                        emulate=emulate)
    dev, precision = hw.device, hw.precision
    wb, _, ob = state_bytes_per_param(precision)
    act = dtype_bytes(precision)
    gb = act  # a gradient as autograd produces it (what an offloaded optimizer copies to the host)
    tokens = mbs / dp * model.seq_length / cp
    lc = layer_forward(model, dev, tokens=tokens, tp=tp, sp=sp, dtype_bytes=act, ep=ep, etp=etp)
    tp_frac, cp_frac, dp_frac = _topology_fractions(hw, ParallelLayout(tp=tp, cp=cp, dp=dp), emulate)
    intra, intra_lat = dev.tp_link()
    cp_bw = intra * cp_frac
    intra *= tp_frac
    dp_bw, dp_lat = dp_link(dev, hardware, single_node=hw.single_node, tp=tp, cp=cp)
    dp_bw *= dp_frac if hw.single_node else 1.0
    expert_tp = tp if etp is None else etp
    # etp * ep expert-dp rings run side by side; a node's NIC carries at most one per device of the node
    expert_dp_bw, expert_dp_lat = dp_link(dev, hardware, single_node=hw.single_node,
                                          tp=min(expert_tp * ep, hw.node_count), cp=1)
    alltoall_fwd = alltoall_bwd = 0.0
    if model.moe is not None:  # every block priced as a MoE block, like its compute (the costlier kind)
        sent = (alltoall_bytes_per_rank(model, tokens, tp=tp, ep=ep, etp=expert_tp, dtype_bytes=act)
                * load_allowance(model.moe, ep))
        one = ep_alltoall_s(sent, dev, hardware, ep=ep, etp=expert_tp, node_count=hw.node_count,
                            single_node=hw.single_node)
        alltoall_fwd, alltoall_bwd = (n * one for n in ALLTOALLS_PER_LAYER)
    act_bytes = tokens * model.hidden_size * act
    tp_fwd = 2 * all_reduce_s(act_bytes, tp, intra, intra_lat)
    # Context parallelism: all-gather of every rank's K/V chunk in the forward; gather again and
    # reduce-scatter their gradients in the backward.
    kv_chunk = tokens * 2 * kv_heads_per_rank(model, tp) * model.kv_channels * act
    cp_fwd = all_gather_s(cp * kv_chunk, cp, cp_bw, intra_lat)
    attn_fwd = lc.attention_s + cp_fwd
    attn_bwd = lc.attention_backward_s + 2 * cp_fwd
    p_layer = layer_params_per_rank(model, tp, ep=ep, etp=etp)
    # First stage: embedding (vocab-parallel: an all-reduce over tp); last: norm, LM head, loss.
    emb_f, emb_b = embedding_s(model, dev, tokens=tokens, dtype_bytes=act)
    head_f, head_b = head_s(model, dev, tokens=tokens, tp=tp, sp=sp, dtype_bytes=act)
    comm_emb_f = all_reduce_s(act_bytes, tp, intra, intra_lat)
    if sp:
        comm_head_f = comm_head_b = all_gather_s(act_bytes, tp, intra, intra_lat)
    else:
        comm_head_f, comm_head_b = 0.0, all_reduce_s(act_bytes, tp, intra, intra_lat)
    emb_f, head_f, head_b = emb_f + comm_emb_f, head_f + comm_head_f, head_b + comm_head_b
    p_emb, p_head = embedding_params_per_rank(model, tp), head_params_per_rank(model, tp, single_stage=False)
    # ZeRO-3: the embedding and the head are units of their own: gathered for forward; gathered again and
    # their fp32 gradients reduce-scattered (the same ring traffic as an all-gather) in backward. Every ZeRO-3
    # collective spans the stage's cp x dp ranks (`ParallelLayout.replicas`), timed on the dp link.
    z3 = cp * dp
    emb_gather, head_gather = all_gather_s(p_emb * wb, z3, dp_bw, dp_lat), all_gather_s(p_head * wb, z3, dp_bw, dp_lat)
    zero3 = (emb_gather, emb_gather + all_gather_s(p_emb * GRAD_REDUCE_BYTES, z3, dp_bw, dp_lat),
             head_gather, head_gather + all_gather_s(p_head * GRAD_REDUCE_BYTES, z3, dp_bw, dp_lat))
    # A block's ZeRO collectives: the routed experts' over expert-dp (cp x dp when the expert layout is tp's).
    p_expert = expert_params_per_rank(model, tp, ep=ep, etp=etp)
    expert_dp = tp * cp * dp // (expert_tp * ep)

    def block_gather(per_param: float, ranks: int) -> float:
        if expert_dp == ranks:
            return all_gather_s(p_layer * per_param, ranks, dp_bw, dp_lat)
        return (all_gather_s((p_layer - p_expert) * per_param, ranks, dp_bw, dp_lat)
                + all_gather_s(p_expert * per_param, expert_dp, expert_dp_bw, expert_dp_lat))

    params = Affine(0.0, p_layer, 0.0, p_emb, p_head,
                    -(model.vocab_size * model.hidden_size / tp) if model.tie_embeddings else 0.0)
    return _Base(tokens=tokens, wb=wb, gb=gb, ob=ob,
                 compute_fwd=lc.gemm_s + attn_fwd + lc.elementwise_s + lc.overhead_s,
                 compute_bwd=2 * lc.gemm_s + attn_bwd + 2 * lc.elementwise_s + lc.overhead_backward_s,
                 attn_fwd=attn_fwd, activation_fn_s=lc.activation_fn_s, tp_fwd=tp_fwd, tp_bwd=tp_fwd,
                 comm_emb_f=comm_emb_f, comm_head_f=comm_head_f, comm_head_b=comm_head_b, dp_bw=dp_bw, dp_lat=dp_lat,
                 cp_bw=cp_bw, expert_dp_bw=expert_dp_bw, expert_dp_lat=expert_dp_lat, alltoall_fwd=alltoall_fwd,
                 alltoall_bwd=alltoall_bwd, p_layer=p_layer, p_expert=p_expert, gather_weights_s=block_gather(wb, z3),
                 zero3_scatter_s=block_gather(GRAD_REDUCE_BYTES, z3), emb_f=emb_f, emb_b=emb_b,
                 head_f=head_f, head_b=head_b, zero3_extras=zero3, params=params,
                 accumulate=tuple(grad_accumulate_s(p, dev, weight_bytes=wb) for p in (p_layer, p_emb, p_head)),
                 stored={rc: activation_bytes(model, tokens=tokens, tp=tp, sp=sp, recompute=rc, dtype_bytes=act,
                                              etp=etp)
                         for rc in ("none", "selective", "full")},
                 memory=_with_cp_working(memory_parts(model, tp=tp, sp=sp, tokens=tokens, precision=precision,
                                                      capacity_gib=dev.memory_gib, ep=ep, etp=etp, cp=cp),
                                         context_parallel_working_bytes(model, tokens=tokens, tp=tp, cp=cp,
                                                                        dtype_bytes=act)))


def _topology_fractions(hw: StageHardware, layout: ParallelLayout, emulate: bool) -> tuple[float, float, float]:
    """(tp, cp, dp) multipliers of the stage's collective bandwidth from its device type's node topology (1.0
    emulated: every rank is a local process)."""
    dev = hw.device
    if emulate or dev.topology is None:
        return 1.0, 1.0, 1.0
    placements = [hw.placement] if hw.placement is not None else slices(hw.num_devices, hw.node_count)
    return stage_fractions(dev.topology, layout, placements, host_gb_per_s=dev.host_link_gb_per_s,
                           device_gb_per_s=dev.intra_node_gb_per_s)


def context_parallel_working_bytes(model: ModelSpec, *, tokens: float, tp: int, cp: int, dtype_bytes: int) -> float:
    """Transient bytes of one block's cp attention backward: the whole sequence's K and V at this rank's kv heads
    (the fused kernels group query heads over them) and their fp32 gradients (0 without cp)."""
    if cp == 1:
        return 0.0
    heads = kv_heads_per_rank(model, tp) * model.kv_channels
    return 2 * tokens * cp * heads * (dtype_bytes + 4)


def _with_cp_working(parts: MemoryParts, extra: float) -> MemoryParts:
    if not extra:
        return parts
    return replace(parts, working={mode: bytes_ + extra for mode, bytes_ in parts.working.items()})


def _tier_bandwidth(dev: DeviceModel, hw: StageHardware, tier: str) -> tuple[float, float]:
    """(read, write) GB/s per device to an offload tier."""
    if tier == "ssd":
        return (min(dev.host_link_gb_per_s, dev.ssd_read_gb_per_s / hw.node_count),
                min(dev.host_link_gb_per_s, dev.ssd_write_gb_per_s / hw.node_count))
    return dev.host_link_gb_per_s, dev.host_link_gb_per_s


def _tail(layout: ParallelLayout, dev: DeviceModel, hw: StageHardware, dp_bw: float, dp_lat: float, cp_bw: float,
          wb: int, gb: int, ob: int) -> tuple[float, float, float, float]:
    """The step's tail as (constant seconds, seconds per parameter held by a device) of the dp gradient
    reduction, then the same of the optimizer step (which, as the runtime's does, includes ZeRO's all-gather
    of the updated parameters)."""
    dp = layout.dp
    rb = GRAD_REDUCE_BYTES
    dp_const = dp_per_param = opt_const = opt_per_param = 0.0
    if layout.cp > 1 and layout.zero < 3:  # each cp rank's gradients are its tokens': summed over cp first
        # (ZeRO-3's reduce-scatter sums over cp x dp at once, during the backward)
        cp_latency_s = dev.tp_link()[1]
        dp_per_param += 2 * (layout.cp - 1) / layout.cp * rb / (cp_bw * 1e9)
        dp_const += 2 * (layout.cp - 1) * cp_latency_s
    if dp > 1:
        ring = (dp - 1) / dp / (dp_bw * 1e9)
        if layout.zero == 0:  # all-reduce of the gradients
            dp_per_param += 2 * ring * rb
            dp_const += 2 * (dp - 1) * dp_lat
        elif layout.zero in (1, 2):  # reduce-scatter of the gradients after the flush (on the host when the
            # optimizer is offloaded), all-gather of the updated parameters
            dp_per_param += ring * rb
            dp_const += (dp - 1) * dp_lat
            opt_per_param += ring * wb
            opt_const += (dp - 1) * dp_lat
    shard = 1.0 / (layout.replicas if layout.zero >= 3 else dp) if layout.zero >= 1 else 1.0
    off = layout.offload
    if off.optimizer == "device":
        flat = 0 if layout.zero >= 3 else FLAT_BUFFER_BYTES_PER_PARAM  # ZeRO-3 steps on its shards in place
        opt_per_param += (flat + shard * DEVICE_ADAM_BYTES_PER_PARAM) / (dev.hbm_gb_per_s * 1e9)
        return dp_const, dp_per_param, opt_const, opt_per_param
    host_adam = ADAM_BYTES_PER_PARAM / (dev.host_memory_gb_per_s / hw.node_count * 1e9)
    opt_per_param += shard * host_adam
    if off.params == "device":  # every gradient down (reduced over dp on the host), this rank's updated weights up
        down = shard * gb if layout.zero >= 3 else gb  # ZeRO-3's gradient shards leave as the backward makes them
        opt_per_param += (down + shard * wb) / (dev.host_link_gb_per_s * 1e9)
    if off.optimizer == "ssd":
        read_bw, write_bw = _tier_bandwidth(dev, hw, "ssd")
        opt_per_param += shard * ob * (1 / (read_bw * 1e9) + 1 / (write_bw * 1e9))
    if off.params == "ssd":  # the step writes the updated weights (this rank's tp shards) to their swap files
        opt_per_param += shard * wb / (_tier_bandwidth(dev, hw, "ssd")[1] * 1e9)
    return dp_const, dp_per_param, opt_const, opt_per_param
