"""Memory per device of one pipeline stage: training state, activations, transients and a reserve.

Each stage is priced at its own precision (`ParallelLayout.compute_precision`): `dtype_bytes` is the size
of its weights and activations, `state_bytes_per_param` its training state per parameter. Training state
is what the runtime allocates, `heteroflow.layout.state_bytes` (Megatron's layout): bf16/fp16 weights 2 bytes,
an fp32 gradient buffer 4 bytes, optimizer state 12 bytes (fp32 master copy, Adam m and v); fp32 training keeps
4 + 4 bytes and 8 bytes of moments (the weights are the master). Everything is divided by tp (kv heads
replicated when tp exceeds them); ZeRO over the stage's dp divides the optimizer state (stage >= 1,
`optimizer_shards`). ZeRO-3 keeps what its runtime (`models.zero3`, FSDP2) keeps: per parameter, split over
cp x dp, the fp32 shard (also the master weight), its fp32 gradient and the fp32 moments (`ZERO3_SHARD_BYTES`);
gathered in the stage's precision, a window of two units (the running block and the prefetched one; the
embedding or head when larger), and while a unit's gradients are reduce-scattered, those gradients plus
their fp32 copy in the reduce-scatter buffer. ZeRO-3 with optimizer state or parameters offloaded
(ZeRO-Infinity, `offload.zero3`, `layout.zero3_state_bytes`) keeps the same window; its shard, in the stage's
precision, stays on the device only with `params: device`; the reduce-scattered gradient shards leave for the
optimizer tier as produced; master and moments are in the optimizer tier.
ZeRO 2 keeps the whole gradient buffer, as ZeRO 1 (it accumulates the micro-batches before the dp
reduce-scatter). Offloading the optimizer moves its state, still divided by dp under ZeRO 1/2
(ZeRO-Offload), to the offload tier (`offloaded_optimizer_bytes`), and removes the gradient buffer from the
device (each gradient leaves for the host as autograd produces it); offloading
parameters leaves a window of two layers of weights (each tp rank's shards: one in use, one prefetched) and
one layer's `.grad`, plus the embedding, final norm and head, which the runtime keeps on the device.
Mixture-of-experts blocks: a device holds its num_experts / ep local experts split over etp (`layout.shards`:
the router and shared expert as in tp); ZeRO shards the routed experts' state over the expert-dp group
(`ParallelLayout.expert_dp`) instead of dp (`MemoryParts.layer_share`).

Activations stored per block and micro-batch, on one device: what the runtime's block saves for backward
(`activation_bytes`, checked against the runtime's meter by `benchmarks/bench_memory.py`): per token the two
RMSNorms' fp32 inputs, normalized values and outputs (under sp each column-parallel layer keeps its own
gathered copy of its input), Q, K, V, the attention output, the fp32 log-sum-exp per head (the fused attention
kernel groups query heads over the kv heads itself: K and V are not repeated, `models.llama.AttentionCore`),
SwiGLU's gate, up, activated gate and product; selective recompute (attention core) drops the log-sum-exp, which
comes back while the core is recomputed; full keeps the block input, plus one block's full activations while it
runs. The rope tables are built once per stage and shared by its blocks and micro-batches (`rope_table_bytes`).
Micro-batches in flight per stage: 1F1B keeps min(p - k, m) for stage k (p stages, m micro-batches),
GPipe all m. Activations offloaded to the CPU leave a window of one block of one micro-batch (the tier copies each
saved tensor out as it is saved and back when backward needs it, without prefetching).
The last stage also holds its final norm's activations and the logits of one micro-batch: the logits kept for the
backward and their gradient, both in the stage's precision (`logit_bytes`; the chunked cross entropy,
`models.cross_entropy`, makes no fp32 copy of them).
Reserve: RESERVE_GIB for the runtime context and communicator buffers plus RESERVE_FRACTION of the
capacity for allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from heteroflow.config.model import ModelSpec
from heteroflow.layout import ParallelLayout, in_flight
from heteroflow.layout.shards import (active_ffn_width, embedding_params_per_rank, expert_params_per_rank,
                                      head_params_per_rank, kv_heads_per_rank, layer_params_per_rank)
from heteroflow.layout.routing import routed_pairs_per_rank
from heteroflow.layout.state import GRAD_REDUCE_BYTES, optimizer_shards, state_bytes, zero3_state_bytes

GIB = float(1 << 30)
RESERVE_GIB = 1.0
RESERVE_FRACTION = 0.05


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one element in each precision: the one table the cost model reads dtype sizes from."""


def dtype_bytes(precision: str) -> int:
    """Bytes of one weight or activation element of a stage computing in `precision`."""
    return DTYPE_BYTES[precision]


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter of a stage computing in `precision`: the runtime's
    layout, `heteroflow.layout.state_bytes` (16-bit weights, fp32 gradient buffer, fp32 master and moments)."""
    state = state_bytes(precision)
    return state.weights, state.grads, state.optimizer


class Affine(NamedTuple):
    """Bytes as a function of the stage's layers, in-flight micro-batches and first/last position."""

    const: float = 0.0
    per_layer: float = 0.0
    per_layer_in_flight: float = 0.0
    first: float = 0.0
    last: float = 0.0
    both: float = 0.0
    """Correction when the stage is first and last (a tied LM head needs no copy)."""

    def at(self, layers: int, in_flight: int, first: bool, last: bool) -> float:
        """The value for a stage with `layers` blocks and `in_flight` micro-batches."""
        return (self.const + layers * (self.per_layer + in_flight * self.per_layer_in_flight)
                + self.first * first + self.last * last + self.both * (first and last))


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """Per-device memory of a stage by component."""

    weights: Affine
    gradients: Affine
    optimizer: Affine
    activations: Affine
    transient: Affine
    reserve: Affine

    def components(self, layers: int, in_flight: int, first: bool, last: bool) -> dict[str, float]:
        """GiB per component."""
        return {name: getattr(self, name).at(layers, in_flight, first, last) / GIB
                for name in ("weights", "gradients", "optimizer", "activations", "transient", "reserve")}

    def total(self) -> Affine:
        """All components summed."""
        parts = (self.weights, self.gradients, self.optimizer, self.activations, self.transient, self.reserve)
        return Affine(*map(sum, zip(*parts)))


def norm_bytes(model: ModelSpec, *, tokens: float, tp: int, sp: bool, consumers: int, dtype_bytes: int) -> float:
    """Saved activations of one normalization and its output over `tokens` tokens of one micro-batch: its input
    in fp32 (the RMSNorm computes in fp32; an fp32 input is kept as is), the normalized values and the fp32
    inverse root per token, on the tokens this device holds (1/tp of them under sp), and the output kept by
    the layers that read it: once, or under sp once per column-parallel layer (`consumers`), each of which
    all-gathers the sequence and keeps its own gathered copy."""
    h = model.hidden_size
    local = tokens / tp if sp else tokens
    return local * (4 * h + dtype_bytes * h + 4) + tokens * dtype_bytes * h * (consumers if sp else 1)


def attention_core_bytes(model: ModelSpec, *, tokens: float, tp: int, dtype_bytes: int) -> float:
    """What the attention core keeps for backward beyond its inputs and output, and selective recompute drops: the
    fp32 log-sum-exp per local head and token (a fused kernel that groups query heads over the kv heads keeps no
    repeated K and V; `dtype_bytes` is unused and kept for the signature's symmetry)."""
    return tokens * 4 * (model.num_attention_heads // tp)


def rope_table_bytes(model: ModelSpec, *, sequence_tokens: float, dtype_bytes: int) -> float:
    """The stage's RoPE cos and sin tables ([local sequence, head_dim] each, in the stage's precision): one pair
    per stage, shared by its blocks and micro-batches (`models.llama.RotaryTables`); 0 without RoPE."""
    if model.position_embedding != "rope":
        return 0.0
    return 2 * sequence_tokens * model.kv_channels * dtype_bytes


def logit_bytes(dtype_bytes: int) -> int:
    """Bytes per logit of the last stage's head: the logits kept for the backward and their gradient, both in the
    stage's precision (`models.cross_entropy`)."""
    return 2 * dtype_bytes


def activation_bytes(model: ModelSpec, *, tokens: float, tp: int, sp: bool, recompute: str, dtype_bytes: int,
                     etp: int | None = None) -> float:
    """Stored activations of one block for one micro-batch on one device, as the runtime's block saves them.

    Two norms (`norm_bytes`, over h / tp values per token under sp); Q after rope, K, V and the attention output;
    the attention core's own (`attention_core_bytes`: the log-sum-exp); SwiGLU's
    gate, up, activated gate and product (a plain MLP: its input to the activation and the activation's output;
    a MoE block: those of its routed pairs, plus `routing_bytes`). Selective recompute drops the core's; full
    keeps only the block input."""
    h, d = model.hidden_size, model.kv_channels
    h_e = h / tp if sp else h
    if recompute == "full":
        return tokens * h_e * dtype_bytes
    q, kv = model.num_attention_heads // tp * d, kv_heads_per_rank(model, tp) * d
    f_loc = active_ffn_width(model) / tp
    swiglu = model.activation == "swiglu"
    mlp = (4 if swiglu else 2) * f_loc
    norms = (norm_bytes(model, tokens=tokens, tp=tp, sp=sp, consumers=3, dtype_bytes=dtype_bytes)  # wq, wk, wv
             + norm_bytes(model, tokens=tokens, tp=tp, sp=sp, consumers=2 if swiglu else 1, dtype_bytes=dtype_bytes))
    outside_core = norms + tokens * dtype_bytes * (2 * q + 2 * kv + mlp)
    if model.moe is not None:
        outside_core += routing_bytes(model, tokens=tokens, tp=tp, sp=sp, etp=tp if etp is None else etp,
                                      dtype_bytes=dtype_bytes)
    if recompute == "selective":
        return outside_core
    return outside_core + attention_core_bytes(model, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes)


def routing_bytes(model: ModelSpec, *, tokens: float, tp: int, sp: bool, etp: int, dtype_bytes: int) -> float:
    """What a MoE block saves beyond its experts' MLP activations (`models.moe`): the router's fp32 scores over
    every expert, each routed pair's expert input row and weighted expert output (h values each), and the int64
    token and slot indices that route them. A rank routes its sequence chunk under sp, and its experts compute
    `layout.routing.routed_pairs_per_rank` pairs (uniform routing)."""
    moe = model.moe
    routed = tokens / tp if sp else tokens
    pairs = routed_pairs_per_rank(model, tokens, tp=tp, etp=etp)
    return routed * moe.num_experts * 4 + pairs * (2 * model.hidden_size * dtype_bytes + 2 * 8)


@dataclass(frozen=True, slots=True)
class MemoryParts:
    """What a stage's memory depends on before ZeRO, recompute and offload (shared by many layouts)."""

    p_layer: float
    p_embed: float
    p_head: float
    tied: float
    stored: dict
    """Stored activation bytes per block and micro-batch, by recompute mode."""
    working: dict
    """Transient activation bytes while a block is recomputed, by recompute mode."""
    logits: float
    reserve: float
    wb: int
    gb: int
    ob: int
    precision: str
    """What the stage computes in (ZeRO-3 reads its state bytes by it, `zero3_state_bytes`)."""
    p_expert: float = 0.0
    """The routed experts' part of `p_layer`: their ZeRO shards and gradient reduction span the expert-dp group."""
    tables: float = 0.0
    """Activation bytes held once per stage, whatever its blocks and micro-batches: the rope tables."""

    def layer_share(self, dense_ranks: int, expert_ranks: int) -> float:
        """A block's parameters one device keeps of state sharded over `dense_ranks` (the routed experts' over
        `expert_ranks`)."""
        return (self.p_layer - self.p_expert) / dense_ranks + self.p_expert / expert_ranks


def memory_parts(model: ModelSpec, *, tp: int, sp: bool, tokens: float, precision: str,
                 capacity_gib: float, ep: int = 1, etp: int | None = None, cp: int = 1) -> MemoryParts:
    """The pieces of a stage's memory that do not depend on ZeRO, recompute and offload (the expert layout `ep`,
    `etp` sets which experts a device holds; `cp` the share of a sequence a device holds)."""
    wb, gb, ob = state_bytes_per_param(precision)
    act = dtype_bytes(precision)
    p_layer, p_embed, p_head, tied = _params(model, tp, ep, etp)
    stored = {rc: activation_bytes(model, tokens=tokens, tp=tp, sp=sp, recompute=rc, dtype_bytes=act, etp=etp)
              for rc in ("none", "selective", "full")}
    working = {"none": 0.0, "full": stored["none"],
               "selective": attention_core_bytes(model, tokens=tokens, tp=tp, dtype_bytes=act)}
    # The last stage's head: the final norm's saved activations and the logits of one micro-batch.
    head = (norm_bytes(model, tokens=tokens, tp=tp, sp=sp, consumers=1, dtype_bytes=act)
            + tokens * model.vocab_size / tp * logit_bytes(act))
    return MemoryParts(p_layer=p_layer, p_embed=p_embed, p_head=p_head, tied=tied, stored=stored, working=working,
                       logits=head,
                       reserve=(RESERVE_GIB + RESERVE_FRACTION * capacity_gib) * GIB, wb=wb, gb=gb, ob=ob,
                       p_expert=expert_params_per_rank(model, tp, ep=ep, etp=etp), precision=precision,
                       tables=rope_table_bytes(model, sequence_tokens=model.seq_length / cp, dtype_bytes=act))


def memory_model(model: ModelSpec, layout: ParallelLayout, *, tokens: float, precision: str, capacity_gib: float) -> MemoryModel:
    """The memory model of one device of a stage with `layout`, `tokens` tokens per micro-batch per device."""
    parts = memory_parts(model, tp=layout.tp, sp=layout.sp, tokens=tokens, precision=precision,
                         capacity_gib=capacity_gib, ep=layout.ep, etp=layout.etp, cp=layout.cp)
    return memory_from_parts(parts, layout)


def memory_from_parts(parts: MemoryParts, layout: ParallelLayout) -> MemoryModel:
    """Apply a layout's ZeRO stage, recompute and offload to the shared pieces."""
    off = layout.offload
    p_layer, p_embed, p_head, tied = parts.p_layer, parts.p_embed, parts.p_head, parts.tied

    def state(per_param: float, div: int) -> Affine:
        k = per_param / div
        return Affine(0.0, p_layer * k, 0.0, p_embed * k, p_head * k, tied * k)

    if layout.zero >= 3:
        weights, gradients, optimizer = _zero3_state(parts, layout)
    else:
        gradients = _gradients(parts, layout)
        if off.params != "device":  # the window of fetched blocks; embedding, final norm and head stay resident
            weights = Affine(2 * p_layer * parts.wb, 0.0, 0.0, p_embed * parts.wb, p_head * parts.wb,
                             tied * parts.wb)
        else:
            weights = state(parts.wb, 1)
        optimizer = _ZERO if off.optimizer != "device" else optimizer_state(parts, layout)
    stored, working = parts.stored[layout.recompute], parts.working[layout.recompute] + parts.tables
    if off.activations != "device":
        activations = Affine(stored + working, 0.0, 0.0, 0.0, 0.0, 0.0)
    else:
        activations = Affine(working, 0.0, stored, 0.0, 0.0, 0.0)
    return MemoryModel(weights=weights, gradients=gradients, optimizer=optimizer, activations=activations,
                       transient=Affine(0.0, 0.0, 0.0, 0.0, parts.logits, 0.0),
                       reserve=Affine(parts.reserve, 0.0, 0.0, 0.0, 0.0, 0.0))


_ZERO = Affine(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def optimizer_state(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """Optimizer state bytes of one device of a stage, wherever they live: 1/dp of the stage's under ZeRO 1/2
    (also in the offload tier: ZeRO-Offload shards it over dp like the device does; the routed experts' over
    expert-dp), 1/(cp x dp) under ZeRO-3 (offloaded: an fp32 master copy besides the shard, `zero3_state_bytes`;
    experts with a layout of their own do not run under ZeRO-3, `ParallelLayout.validate`)."""
    if layout.zero >= 3:
        k = zero3_state_bytes(parts.precision, offloaded=layout.offload.moves_state).optimizer / layout.replicas
        return Affine(0.0, parts.p_layer * k, 0.0, parts.p_embed * k, parts.p_head * k, parts.tied * k)
    k = parts.ob / optimizer_shards(layout.zero, layout.dp)
    per_layer = parts.ob * parts.layer_share(optimizer_shards(layout.zero, layout.dp),
                                             optimizer_shards(layout.zero, layout.expert_dp))
    return Affine(0.0, per_layer, 0.0, parts.p_embed * k, parts.p_head * k, parts.tied * k)


def offloaded_optimizer_bytes(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """Optimizer state bytes one device keeps in its offload tier (cpu or ssd); zero when it stays on the device."""
    return optimizer_state(parts, layout) if layout.offload.optimizer != "device" else _ZERO


def _zero3_state(parts: MemoryParts, layout: ParallelLayout) -> tuple[Affine, Affine, Affine]:
    """(weights, gradients, optimizer) on the device of a ZeRO-3 stage: `models.zero3` with its state on the
    device, `offload.zero3` (ZeRO-Infinity) with optimizer state or parameters in their tiers."""
    p_layer, p_embed, p_head, tied = parts.p_layer, parts.p_embed, parts.p_head, parts.tied
    w1, w2 = max(0.0, p_embed - p_layer), max(0.0, p_head - p_layer)
    off = layout.offload
    per_param = zero3_state_bytes(parts.precision, offloaded=off.moves_state)

    def shard(per_param: float) -> Affine:
        k = per_param / layout.replicas
        return Affine(0.0, p_layer * k, 0.0, p_embed * k, p_head * k, tied * k)

    def window(units: float, per_param: float) -> Affine:
        return Affine(units * p_layer * per_param, 0.0, 0.0, w1 * per_param, w2 * per_param, 0.0)

    resident = shard(per_param.weights if off.params == "device" else 0)
    weights = Affine(*map(sum, zip(resident, window(2, parts.wb))))
    # a unit's gradients come out of its backward in the stage's precision, then fp32 for the reduce-scatter;
    # offloaded, the reduced shard leaves for the optimizer tier at once
    kept = shard(per_param.grads if not off.moves_state else 0)
    gradients = Affine(*map(sum, zip(kept, window(1, parts.wb + GRAD_REDUCE_BYTES))))
    optimizer = _ZERO if off.optimizer != "device" else shard(per_param.optimizer)
    return weights, gradients, optimizer


def _gradients(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """Gradient bytes on the device under ZeRO 0-2 (`_zero3_state` prices ZeRO-3). With the optimizer on the
    device, its fp32 buffer (`parts.gb` per parameter). With the optimizer offloaded, each gradient leaves for
    the host as soon as autograd has it, so nothing stays. Offloaded parameters add the `.grad` (parameter dtype) of the
    block whose backward runs (handed to the optimizer tier once the block's last gradient is in)."""
    p_layer, p_embed, p_head, tied = parts.p_layer, parts.p_embed, parts.p_head, parts.tied
    out = _ZERO
    if layout.offload.optimizer == "device":
        k = parts.gb
        out = Affine(0.0, p_layer * k, 0.0, p_embed * k, p_head * k, tied * k)
    if layout.offload.params != "device":
        out = out._replace(const=out.const + p_layer * parts.wb)
    return out


def memory_total_from_parts(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """`memory_from_parts(parts, layout).total()` without building the components (the planner's hot path;
    a test checks both agree)."""
    zero, off = layout.zero, layout.offload
    p_layer, p_embed, p_head, tied = parts.p_layer, parts.p_embed, parts.p_head, parts.tied
    const = parts.reserve
    if zero >= 3:
        state = Affine(*map(sum, zip(*_zero3_state(parts, layout))))
        const, per_layer, first, last, both = (const + state.const, state.per_layer, state.first, state.last,
                                               state.both)
    else:
        grads = _gradients(parts, layout)
        const += grads.const
        per_layer, first, last, both = grads.per_layer, grads.first, grads.last, grads.both
        if off.params != "device":
            const += 2 * p_layer * parts.wb
        else:
            per_layer += p_layer * parts.wb
        first += p_embed * parts.wb
        last += p_head * parts.wb
        both += tied * parts.wb
        if off.optimizer == "device":
            k = parts.ob / optimizer_shards(zero, layout.dp)
            per_layer += parts.ob * parts.layer_share(optimizer_shards(zero, layout.dp),
                                                      optimizer_shards(zero, layout.expert_dp))
            first += p_embed * k
            last += p_head * k
            both += tied * k
    stored, working = parts.stored[layout.recompute], parts.working[layout.recompute] + parts.tables
    in_flight = 0.0
    if off.activations != "device":
        const += stored + working
    else:
        const += working
        in_flight = stored
    return Affine(const, per_layer, in_flight, first, last + parts.logits, both)


@lru_cache(maxsize=1024)
def _params(model: ModelSpec, tp: int, ep: int, etp: int | None) -> tuple[float, float, float, float]:
    """(per block, first-stage extra, last-stage extra, tied-head saving when first and last) per device."""
    tied = -(model.vocab_size * model.hidden_size / tp) if model.tie_embeddings else 0.0
    return (layer_params_per_rank(model, tp, ep=ep, etp=etp), embedding_params_per_rank(model, tp),
            head_params_per_rank(model, tp, single_stage=False), tied)


def stage_memory_bytes(model: ModelSpec, layout: ParallelLayout, *, precision: str, micro_batch_size: int,
                       schedule: str, num_stages: int, stage: int, num_micro_batches: int,
                       layers: int) -> dict[str, float]:
    """One device's bytes of plan stage `stage` by component, the fixed reserve left out: `params`, `grads`,
    `optimizer`, `activations` (micro-batches in flight included) and `transient` (the last stage's logits).
    The runtime records these next to what it measures."""
    tokens = micro_batch_size / layout.dp * model.seq_length / layout.cp
    memory = memory_model(model, layout, tokens=tokens, precision=precision, capacity_gib=0.0)
    f = in_flight(schedule, num_stages, stage, num_micro_batches)
    gib = memory.components(layers, f, stage == 0, stage == num_stages - 1)
    names = {"weights": "params", "gradients": "grads", "optimizer": "optimizer", "activations": "activations",
             "transient": "transient"}
    return {ours: gib[theirs] * GIB for theirs, ours in names.items()}


def stage_offloaded_optimizer_bytes(model: ModelSpec, layout: ParallelLayout, *, precision: str, stage: int,
                                    num_stages: int, layers: int) -> float:
    """One device's optimizer state bytes in the offload tier (cpu or ssd) of plan stage `stage`; 0 when the
    state stays on the device. The runtime's dry run reports it next to what the offload store holds."""
    parts = memory_parts(model, tp=layout.tp, sp=layout.sp, tokens=1.0, precision=precision, capacity_gib=0.0,
                         ep=layout.ep, etp=layout.etp)
    return offloaded_optimizer_bytes(parts, layout).at(layers, 0, stage == 0, stage == num_stages - 1)
