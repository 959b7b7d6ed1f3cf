"""Memory per device of one pipeline stage: training state, activations, transients and a reserve.

Each stage is priced at its own precision (`ParallelLayout.compute_precision`): `dtype_bytes` is the size
of its weights and activations, `state_bytes_per_param` its training state per parameter. Training state
(mixed precision Adam, ZeRO paper accounting): bf16/fp16 weights 2 bytes and gradients 2 bytes per
parameter, optimizer state 12 bytes (fp32 master copy, Adam m and v); fp32 training keeps 4 + 4 bytes and
8 bytes of moments. Everything is divided by tp (kv heads replicated when tp exceeds them);
ZeRO over the stage's dp divides the optimizer state (stage >= 1), gradients (>= 2) and weights (3, plus a
prefetch buffer of two gathered layers). Offloading the optimizer moves its state, still divided by dp under
ZeRO 1/2 (ZeRO-Offload), to the offload tier (`offloaded_optimizer_bytes`);
offloading parameters leaves a window of two layers of weights and of gradients on the device (each tp
rank's shards: the block in use and the one prefetched), plus the weights and gradients of the embedding,
final norm and head, which the runtime keeps on the device (`offload.stage_optimizer`).

Activations stored per block and micro-batch, on one device holding `t` tokens (with flash attention,
no dropout; h_e = h / tp with sequence parallelism, else h; q and kv the local query and key/value widths):
- no recompute: t * (4 h_e + 2 q + 2 kv + 3 f/tp) elements (norm inputs and outputs, Q, K, V, attention
  output, SwiGLU gate, up and product) + 4 bytes per local head and token (softmax statistics);
- selective (attention core and activation function recomputed): t * (4 h_e + q + 2 kv + 2 f/tp);
- full (each block recomputed from its input): t * h_e, plus one block's full activations while it runs.
Micro-batches in flight per stage: 1F1B keeps min(p - k, m) for stage k (p stages, m micro-batches),
GPipe all m. Activations offloaded to the CPU leave a window of two blocks of one micro-batch.
The last stage also holds the logits of one micro-batch (bf16 logits + fp32 gradient, 6 bytes per logit).
Reserve: RESERVE_GIB for the runtime context and communicator buffers plus RESERVE_FRACTION of the
capacity for allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from heteroflow.config.model import ModelSpec
from heteroflow.layout import ParallelLayout
from heteroflow.layout.shards import (embedding_params_per_rank, head_params_per_rank, kv_heads_per_rank,
                                      layer_params_per_rank)

GIB = float(1 << 30)
RESERVE_GIB = 1.0
RESERVE_FRACTION = 0.05
LOGIT_BYTES = 6


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one element in each precision: the one table the cost model reads dtype sizes from."""


def dtype_bytes(precision: str) -> int:
    """Bytes of one weight or activation element of a stage computing in `precision`."""
    return DTYPE_BYTES[precision]


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter of a stage computing in `precision`: weights and
    gradients in that precision; the optimizer keeps fp32 Adam moments, plus an fp32 master copy of the
    weights when they are 16-bit."""
    size = dtype_bytes(precision)
    return size, size, 8 if size == 4 else 12


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


def activation_bytes(model: ModelSpec, *, tokens: float, tp: int, sp: bool, recompute: str, dtype_bytes: int) -> float:
    """Stored activations of one block for one micro-batch on one device."""
    h, d = model.hidden_size, model.kv_channels
    h_e = h / tp if sp else h
    q, kv = model.num_attention_heads // tp * d, kv_heads_per_rank(model, tp) * d
    f_loc = model.ffn_hidden_size / tp
    up = 2 if model.activation == "swiglu" else 1
    if recompute == "full":
        return tokens * h_e * dtype_bytes
    if recompute == "selective":
        return tokens * dtype_bytes * (4 * h_e + q + 2 * kv + up * f_loc)
    return tokens * dtype_bytes * (4 * h_e + 2 * q + 2 * kv + (up + 1) * f_loc) + tokens * 4 * (q // d)


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


def memory_parts(model: ModelSpec, *, tp: int, sp: bool, tokens: float, precision: str,
                 capacity_gib: float) -> MemoryParts:
    """The layout-independent pieces of a stage's memory."""
    wb, gb, ob = state_bytes_per_param(precision)
    act = dtype_bytes(precision)
    p_layer, p_embed, p_head, tied = _params(model, tp)
    stored = {rc: activation_bytes(model, tokens=tokens, tp=tp, sp=sp, recompute=rc, dtype_bytes=act)
              for rc in ("none", "selective", "full")}
    working = {"none": 0.0, "full": stored["none"],
               "selective": tokens * act * (model.num_attention_heads // tp * model.kv_channels
                                           + model.ffn_hidden_size / tp)}
    return MemoryParts(p_layer=p_layer, p_embed=p_embed, p_head=p_head, tied=tied, stored=stored, working=working,
                       logits=tokens * model.vocab_size / tp * LOGIT_BYTES,
                       reserve=(RESERVE_GIB + RESERVE_FRACTION * capacity_gib) * GIB, wb=wb, gb=gb, ob=ob)


def memory_model(model: ModelSpec, layout: ParallelLayout, *, tokens: float, precision: str, capacity_gib: float) -> MemoryModel:
    """The memory model of one device of a stage with `layout`, `tokens` tokens per micro-batch per device."""
    parts = memory_parts(model, tp=layout.tp, sp=layout.sp, tokens=tokens, precision=precision,
                         capacity_gib=capacity_gib)
    return memory_from_parts(parts, layout)


def memory_from_parts(parts: MemoryParts, layout: ParallelLayout) -> MemoryModel:
    """Apply a layout's ZeRO stage, recompute and offload to the shared pieces."""
    dp, zero, off = layout.dp, layout.zero, layout.offload
    p_layer, p_embed, p_head, tied = parts.p_layer, parts.p_embed, parts.p_head, parts.tied
    w0, w1, w2 = 2 * p_layer, max(0.0, p_embed - p_layer), max(0.0, p_head - p_layer)

    def state(per_param: float, div: int) -> Affine:
        k = per_param / div
        return Affine(0.0, p_layer * k, 0.0, p_embed * k, p_head * k, tied * k)

    if off.params != "device":
        e1, e2, e3 = _offloaded_ends(parts, zero)
        weights = Affine(w0 * parts.wb, 0.0, 0.0, e1 * parts.wb, e2 * parts.wb, e3 * parts.wb)
        gradients = Affine(w0 * parts.gb, 0.0, 0.0, e1 * parts.gb, e2 * parts.gb, e3 * parts.gb)
    else:
        if zero >= 3:
            k = parts.wb / dp
            weights = Affine(w0 * parts.wb, p_layer * k, 0.0, p_embed * k + w1 * parts.wb, p_head * k + w2 * parts.wb,
                             tied * k)
        else:
            weights = state(parts.wb, 1)
        gradients = state(parts.gb, dp if zero >= 2 else 1)
    optimizer = _ZERO if off.optimizer != "device" else optimizer_state(parts, layout)
    stored, working = parts.stored[layout.recompute], parts.working[layout.recompute]
    if off.activations != "device":
        activations = Affine(2 * stored + working, 0.0, 0.0, 0.0, 0.0, 0.0)
    else:
        activations = Affine(working, 0.0, stored, 0.0, 0.0, 0.0)
    return MemoryModel(weights=weights, gradients=gradients, optimizer=optimizer, activations=activations,
                       transient=Affine(0.0, 0.0, 0.0, 0.0, parts.logits, 0.0),
                       reserve=Affine(parts.reserve, 0.0, 0.0, 0.0, 0.0, 0.0))


_ZERO = Affine(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def optimizer_state(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """Optimizer state bytes of one device of a stage, wherever they live: 1/dp of the stage's under ZeRO >= 1
    (also in the offload tier: ZeRO-Offload shards it over dp like the device does)."""
    k = parts.ob / (layout.dp if layout.zero >= 1 else 1)
    return Affine(0.0, parts.p_layer * k, 0.0, parts.p_embed * k, parts.p_head * k, parts.tied * k)


def offloaded_optimizer_bytes(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """Optimizer state bytes one device keeps in its offload tier (cpu or ssd); zero when it stays on the device."""
    return optimizer_state(parts, layout) if layout.offload.optimizer != "device" else _ZERO


def _offloaded_ends(parts: MemoryParts, zero: int) -> tuple[float, float, float]:
    """Parameters on the device beyond the two-block window when parameters are offloaded: (first-stage,
    last-stage, first-and-last correction). The runtime keeps embedding, final norm and head resident, tp
    shards only; ZeRO-3 (priced, not run with offload) gathers them into the window like a block."""
    if zero >= 3:
        return max(0.0, parts.p_embed - parts.p_layer), max(0.0, parts.p_head - parts.p_layer), 0.0
    return parts.p_embed, parts.p_head, parts.tied


def memory_total_from_parts(parts: MemoryParts, layout: ParallelLayout) -> Affine:
    """`memory_from_parts(parts, layout).total()` without building the components (the planner's hot path;
    a test checks both agree)."""
    dp, zero, off = layout.dp, layout.zero, layout.offload
    p_layer, p_embed, p_head, tied = parts.p_layer, parts.p_embed, parts.p_head, parts.tied
    w0, w1, w2 = 2 * p_layer, max(0.0, p_embed - p_layer), max(0.0, p_head - p_layer)
    const = parts.reserve
    per_layer = first = last = both = 0.0
    if off.params != "device":
        e1, e2, e3 = _offloaded_ends(parts, zero)
        const += w0 * (parts.wb + parts.gb)
        first += e1 * (parts.wb + parts.gb)
        last += e2 * (parts.wb + parts.gb)
        both += e3 * (parts.wb + parts.gb)
    else:
        k = parts.wb / dp if zero >= 3 else parts.wb
        if zero >= 3:
            const += w0 * parts.wb
            first += w1 * parts.wb
            last += w2 * parts.wb
        k += parts.gb / (dp if zero >= 2 else 1)
        per_layer += p_layer * k
        first += p_embed * k
        last += p_head * k
        both += tied * k
    if off.optimizer == "device":
        k = parts.ob / (dp if zero >= 1 else 1)
        per_layer += p_layer * k
        first += p_embed * k
        last += p_head * k
        both += tied * k
    stored, working = parts.stored[layout.recompute], parts.working[layout.recompute]
    in_flight = 0.0
    if off.activations != "device":
        const += 2 * stored + working
    else:
        const += working
        in_flight = stored
    return Affine(const, per_layer, in_flight, first, last + parts.logits, both)


@lru_cache(maxsize=1024)
def _params(model: ModelSpec, tp: int) -> tuple[float, float, float, float]:
    """(per block, first-stage extra, last-stage extra, tied-head saving when first and last) per device."""
    tied = -(model.vocab_size * model.hidden_size / tp) if model.tie_embeddings else 0.0
    return (layer_params_per_rank(model, tp), embedding_params_per_rank(model, tp),
            head_params_per_rank(model, tp, single_stage=False), tied)
