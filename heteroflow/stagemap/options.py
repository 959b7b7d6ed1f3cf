"""Per-stage option tables for the planner: every searched layout priced once per (stage shape,
micro-batch size), reduced to the layouts no other one beats everywhere, then, for one position in the
pipeline, to the (layers, layout) options not dominated in (forward, backward, tail) among those that fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from heteroflow.config.job import JobConfig
from heteroflow.stagemap.costs import StageCosts, StageHardware, stage_costs, stage_costs_many
from heteroflow.stagemap.dp import Option
from heteroflow.stagemap.hardware import Hardware
from heteroflow.layout import ParallelLayout
from heteroflow.layout.shards import expert_params_per_rank, layer_params_per_rank
from heteroflow.stagemap.memory import (GIB, RESERVE_FRACTION, RESERVE_GIB, activation_bytes, dtype_bytes,
                                        state_bytes_per_param)

# Columns of the coefficient matrix (`coefficients`): times, tail and memory as affine functions of the
# layer count and position.
_F, _FF, _FL, _B, _BF, _BL, _TC, _TL, _TF, _TLA, _TB, _MC, _ML, _MI, _MF, _MLA, _MB = range(17)


@dataclass(slots=True)
class LayoutTable:
    """The layouts of one stage shape and micro-batch size that some position could prefer."""

    layouts: list[ParallelLayout]
    costs: list[StageCosts]
    coef: np.ndarray
    capacity_bytes: float
    bounds: dict = field(default_factory=dict)
    """`least_curve`'s per-position figures that do not depend on the micro-batches in flight (cached)."""


def coefficients(c: StageCosts) -> list[float]:
    pp, prm, mem = c.tail_per_param_s, c.params, c.memory_total
    return [c.fwd_layer_s, c.fwd_first_s, c.fwd_last_s, c.bwd_layer_s, c.bwd_first_s, c.bwd_last_s,
            c.tail_const_s, pp * prm.per_layer + c.tail_expert_layer_s, pp * prm.first, pp * prm.last, pp * prm.both,
            mem.const, mem.per_layer, mem.per_layer_in_flight, mem.first, mem.last, mem.both]


def layout_table(job: JobConfig, hardware: Hardware, hw: StageHardware, layouts: list[ParallelLayout],
                 micro_batch_size: int) -> LayoutTable:
    """Price `layouts` and drop those another layout beats in every coefficient (exact: all figures are
    non-decreasing in every coefficient for every position)."""
    costs = stage_costs_many(job.model, hw, layouts, micro_batch_size, hardware)
    coef = np.array([coefficients(c) for c in costs], dtype=float).reshape(len(costs), 17)
    # A layout that cannot hold one layer with one micro-batch in flight (the least any position asks) never fits.
    fits = coef[:, _MC] + coef[:, _ML] + coef[:, _MI] <= hw.device.memory_gib * GIB
    keep = [i for i in _skyline(coef) if fits[i]]
    return LayoutTable([layouts[i] for i in keep], [costs[i] for i in keep], coef[keep],
                       hw.device.memory_gib * GIB)


def _skyline(rows: np.ndarray) -> list[int]:
    """Indices of rows no other row dominates (<= everywhere; of equal rows the lowest index stays).

    In lexicographic order a row can only be dominated by rows before it, and a row dominated by a dominated
    row is dominated by the one that dominates that one: a row stays when no row before it dominates it.
    Taken in blocks: each block against the rows kept so far and against its own earlier rows."""
    order = np.lexsort(rows.T[::-1])
    ranked = rows[order]
    kept: list[np.ndarray] = []
    kept_rows = ranked[:0]
    block = 64
    earlier = np.tri(block, k=-1, dtype=bool)  # earlier[i, j]: j before i
    for start in range(0, len(ranked), block):
        chunk = ranked[start:start + block]
        b = len(chunk)
        inside = (chunk[None, :, :] <= chunk[:, None, :]).all(axis=2) & earlier[:b, :b]
        beaten = inside.any(axis=1)
        if len(kept_rows):
            beaten |= (kept_rows[None, :, :] <= chunk[:, None, :]).all(axis=2).any(axis=1)
        fresh = np.flatnonzero(~beaten)
        kept.append(order[start + fresh])
        kept_rows = np.concatenate([kept_rows, chunk[fresh]])
    return sorted(int(i) for i in np.concatenate(kept)) if kept else []


@dataclass(slots=True)
class SlotCurve:
    """One stage position's view of a layout table, before boundary transfers: for every layer count, the
    layouts that fit, their (forward, backward, tail) and the least F + B among them."""

    forward: np.ndarray
    """[layers - 1, layout] seconds (layout columns: the table's layouts that could fit here)."""
    backward: np.ndarray
    tail: np.ndarray
    fits: np.ndarray
    layouts: list[ParallelLayout]
    least_time: np.ndarray
    """[layers - 1]: least F + B over the layouts that fit (inf where none does)."""
    least_tail: float
    """Least tail of any layout that fits one layer."""


def slot_curve(table: LayoutTable, *, first: bool, last: bool, in_flight: int, max_layers: int) -> SlotCurve:
    """The options of a stage at one position (boundary transfers excluded: they add the same to all)."""
    key = ("slot", first, last)
    if key not in table.bounds:
        table.bounds[key] = _slot_parts(table.coef, first=first, last=last)
    cand, c, f0, b0, t0, m0, beats_if_holds, beats_if_more = table.bounds[key]
    mslope = c[:, _ML] + in_flight * c[:, _MI]
    room = table.capacity_bytes - m0
    with np.errstate(divide="ignore", invalid="ignore"):
        lmax = np.where(mslope > 0, np.floor(room / np.where(mslope > 0, mslope, 1.0)),
                        np.where(room >= 0, max_layers, -1))
    lmax = np.minimum(lmax, max_layers)
    # Drop layouts another one beats at every layer count here (times and room for layers): the skyline of
    # (times, -lmax) rows, `_skyline`'s rule with the time part of the comparison precomputed.
    holds = lmax[None, :] >= lmax[:, None]  # holds[j, i]: layout i fits at least as many layers as j
    beaten = ((beats_if_holds & holds) | (beats_if_more & (lmax[None, :] > lmax[:, None]))).any(axis=1)
    live = np.flatnonzero(~beaten & (lmax >= 1))  # table order: simpler layouts first
    layers = np.arange(1, max_layers + 1, dtype=float)[:, None]
    if len(live) == 0:
        empty = np.zeros((max_layers, 0))
        return SlotCurve(empty, empty, empty, empty.astype(bool), [], np.full(max_layers, np.inf), np.inf)
    fwd = c[live, _F][None, :] * layers + f0[live][None, :]
    bwd = c[live, _B][None, :] * layers + b0[live][None, :]
    tail = c[live, _TL][None, :] * layers + t0[live][None, :]
    fits = lmax[live][None, :] >= layers
    least = np.where(fits, fwd + bwd, np.inf).min(axis=1)
    least_tail = float(np.where(fits[0], tail[0], np.inf).min())
    return SlotCurve(fwd, bwd, tail, fits, [table.layouts[cand[i]] for i in live.tolist()], least, least_tail)


def _slot_parts(c: np.ndarray, *, first: bool, last: bool) -> tuple:
    """What `slot_curve` needs at one position whatever the micro-batches in flight.

    The table rows it can keep: it drops row j when a row i is <= it in forward, backward and tail (per layer
    and at this position) and in memory (constant, per layer, per layer in flight), and i either comes first in
    the table or is < it in a time column. Such an i holds at least as many layers as j and comes before it in
    the skyline (ties keep the first row), so j would be dropped there too, and every row j beats, i beats (the
    relation is transitive); the kept rows and their order are the same.

    For those rows: their coefficients, the position's constant parts, and the time part of the skyline test:
    [j, i] true where i's times are <= j's and either i is < j in one or comes first (then i beats j if it holds
    as many layers), and true where i's times are <= j's (then i beats j if it holds more layers)."""
    both = first and last
    times = np.stack([c[:, _F], c[:, _FF] * first + c[:, _FL] * last, c[:, _B], c[:, _BF] * first + c[:, _BL] * last,
                      c[:, _TL], c[:, _TC] + c[:, _TF] * first + c[:, _TLA] * last + c[:, _TB] * both], axis=1)
    memory = np.stack([c[:, _MC] + c[:, _MF] * first + c[:, _MLA] * last + c[:, _MB] * both, c[:, _ML], c[:, _MI]],
                      axis=1)
    rows = np.concatenate([times, memory], axis=1)
    below = (rows[None, :, :] <= rows[:, None, :]).all(axis=2)  # below[j, i]: row i <= row j everywhere
    faster = (times[None, :, :] < times[:, None, :]).any(axis=2)
    earlier = np.tri(len(rows), k=-1, dtype=bool)  # earlier[j, i]: i before j
    cand = np.flatnonzero(~(below & (faster | earlier)).any(axis=1))
    times, memory = times[cand], memory[cand]
    no_slower = (times[None, :, :] <= times[:, None, :]).all(axis=2)
    faster = (times[None, :, :] < times[:, None, :]).any(axis=2)
    earlier = np.tri(len(cand), k=-1, dtype=bool)
    return (cand, c[cand], times[:, 1], times[:, 3], times[:, 5], memory[:, 0], no_slower & (faster | earlier),
            no_slower)


def least_curve(table: LayoutTable, *, first: bool, last: bool, in_flight: int, max_layers: int,
                micro_batches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """By layer count, over the layouts that fit: (least F + B, least m (F + B) + tail with m =
    `micro_batches`, least tail), boundary transfers excluded; inf where nothing fits. What the planner's
    bounds need, without the per-position reduction."""
    key = (first, last, max_layers, micro_batches)
    if key not in table.bounds:
        table.bounds[key] = _least_parts(table.coef, first=first, last=last, max_layers=max_layers,
                                         micro_batches=micro_batches)
    m0, per_layer, per_flight, time, tail, own_all = table.bounds[key]
    if not len(m0):
        return np.full(max_layers, np.inf), np.full(max_layers, np.inf), np.full(max_layers, np.inf)
    layers = np.arange(1, max_layers + 1, dtype=float)[:, None]
    mslope = per_layer + in_flight * per_flight
    fits = m0[None, :] + mslope[None, :] * layers <= table.capacity_bytes
    least = np.where(fits, time, np.inf).min(axis=1)
    own = np.where(fits, own_all, np.inf).min(axis=1)
    return least, own, np.where(fits, tail, np.inf).min(axis=1)


def _least_parts(c: np.ndarray, *, first: bool, last: bool, max_layers: int, micro_batches: int) -> tuple:
    """What `least_curve` needs at one position whatever the micro-batches in flight, over the layouts no other
    beats there in every figure it reads (time and tail per layer and at the ends, constant memory, memory per
    layer and per layer in flight): a layout so beaten fits wherever the other fits and is no faster, so the
    least values are the same (rounding is monotone)."""
    both = first and last
    f0 = c[:, _FF] * first + c[:, _FL] * last + c[:, _BF] * first + c[:, _BL] * last
    t0 = c[:, _TC] + c[:, _TF] * first + c[:, _TLA] * last + c[:, _TB] * both
    m0 = c[:, _MC] + c[:, _MF] * first + c[:, _MLA] * last + c[:, _MB] * both
    rate = c[:, _F] + c[:, _B]
    keep = np.array(_skyline(np.stack([rate, f0, c[:, _TL], t0, m0, c[:, _ML], c[:, _MI]], axis=1)), dtype=int)
    layers = np.arange(1, max_layers + 1, dtype=float)[:, None]
    time = rate[keep][None, :] * layers + f0[keep][None, :]
    tail = c[keep, _TL][None, :] * layers + t0[keep][None, :]
    return m0[keep], c[keep, _ML], c[keep, _MI], time, tail, micro_batches * time + tail


class StageOptions:
    """A stage's options at one position with its boundary transfers, for the dynamic program: the options
    of a layer count are reduced to those not dominated in (forward, backward, tail) when first asked for."""

    def __init__(self, curve: SlotCurve, recv_in: float, recv_out: float):
        self.curve = curve
        self.recv_in, self.recv_out = recv_in, recv_out
        self.least = curve.least_time + (recv_in + recv_out)
        self.least_tail = curve.least_tail
        """Least tail of any option (at one layer: tails grow with layers)."""
        self._front: dict[int, list[int]] = {}
        self._options: dict[int, list[Option]] = {}

    def _pareto(self, layers: int) -> list[int]:
        if layers not in self._front:
            c, row = self.curve, layers - 1
            if row >= c.fits.shape[0] or c.fits.shape[1] == 0:
                self._front[layers] = []
            else:
                idx = np.flatnonzero(c.fits[row])
                f, b, t = c.forward[row, idx], c.backward[row, idx], c.tail[row, idx]
                le = (f[None, :] <= f[:, None]) & (b[None, :] <= b[:, None]) & (t[None, :] <= t[:, None])
                lt = ((f[None, :] < f[:, None]) | (b[None, :] < b[:, None]) | (t[None, :] < t[:, None])
                      | np.tri(len(idx), k=-1, dtype=bool))
                self._front[layers] = [int(i) for i in idx[~np.any(le & lt, axis=1)]]
        return self._front[layers]

    def options(self, layers: int) -> list[Option]:
        """Options with `layers` layers that fit and that no other beats in (F, B, tail); ties keep the
        simplest layout (the table's order)."""
        if layers not in self._options:
            c, row = self.curve, layers - 1
            self._options[layers] = [Option(layers, float(c.forward[row, i]) + self.recv_in,
                                            float(c.backward[row, i]) + self.recv_out, float(c.tail[row, i]),
                                            c.layouts[i]) for i in self._pareto(layers)]
        return self._options[layers]

    def fastest(self, layers: int) -> Option | None:
        """The option with the least F + B (then tail)."""
        opts = self.options(layers)
        return min(opts, key=lambda o: (o.forward_s + o.backward_s, o.tail_s)) if opts else None


@dataclass(frozen=True, slots=True)
class QuickStats:
    """Bounds for one stage shape and micro-batch size without pricing every layout: the least time per
    layer and the least first/last-stage extras of any layout (memory ignored), and the least memory per
    layer of any layout, split into training state and activations per micro-batch in flight (each taken
    at its own minimum over the layouts; constant parts other than the reserve ignored)."""

    rate_s: float
    first_s: float
    last_s: float
    state_per_layer: float
    act_per_layer: float
    room: float

    def max_layers(self, in_flight: int, cap: int) -> int:
        """An upper bound on the layers any layout fits with `in_flight` micro-batches in flight."""
        slope = self.state_per_layer + in_flight * self.act_per_layer
        if self.room < 0:
            return 0
        return cap if slope <= 0 else min(cap, int(self.room // slope))


_RC_RANK = {"none": 0, "selective": 1, "full": 2}


def _speed_rank(lay: ParallelLayout) -> tuple:
    return (lay.zero >= 2, lay.zero, _RC_RANK[lay.recompute], lay.offload.any)


def quick_stats(job: JobConfig, hardware: Hardware, hw: StageHardware, layouts: list[ParallelLayout],
                micro_batch_size: int) -> QuickStats:
    """Valid bounds: per-layer time and the first/last extras only grow with ZeRO 2/3, recompute and
    offload, so only the fastest layout per (tp, sp) is priced; memory bounds come from closed formulas (at
    the stage's precision, `hw.precision`)."""
    fastest: dict[tuple, ParallelLayout] = {}
    for lay in layouts:
        key = (lay.tp, lay.sp)
        if key not in fastest or _speed_rank(lay) < _speed_rank(fastest[key]):
            fastest[key] = lay
    costs = [stage_costs(job.model, hw, lay, micro_batch_size, hardware) for lay in fastest.values()]
    wb, gb, ob = state_bytes_per_param(hw.precision)
    room = hw.device.memory_gib * GIB - (RESERVE_GIB + RESERVE_FRACTION * hw.device.memory_gib) * GIB
    state = act = float("inf")
    per_rank: dict[tuple, tuple[float, float]] = {}  # layouts differing in ZeRO, recompute, offload share these
    acts: dict[tuple, float] = {}
    for lay in layouts:
        shard = (lay.tp, lay.ep, lay.etp)
        if shard not in per_rank:
            per_rank[shard] = (layer_params_per_rank(job.model, lay.tp, ep=lay.ep, etp=lay.etp),
                               expert_params_per_rank(job.model, lay.tp, ep=lay.ep, etp=lay.etp))
        p_layer, p_expert = per_rank[shard]
        off = lay.offload
        held = 0.0
        for params, ranks in ((p_layer - p_expert, lay.dp), (p_expert, lay.expert_dp)):  # experts: over expert-dp
            weights = 0.0 if off.params != "device" else wb / (ranks if lay.zero >= 3 else 1)
            grads = 0.0 if off.optimizer != "device" else gb / (ranks if lay.zero >= 3 else 1)
            optim = 0.0 if off.optimizer != "device" else ob / (ranks if lay.zero >= 1 else 1)
            held += params * (weights + grads + optim)
        state = min(state, held)
        if off.activations != "device":
            act = 0.0
        elif act > 0:
            key = (lay.dp, lay.cp, lay.tp, lay.sp, lay.recompute, lay.etp)
            if key not in acts:
                tokens = micro_batch_size / lay.dp * job.model.seq_length / lay.cp
                acts[key] = activation_bytes(job.model, tokens=tokens, tp=lay.tp, sp=lay.sp, recompute=lay.recompute,
                                             dtype_bytes=dtype_bytes(hw.precision), etp=lay.etp)
            act = min(act, acts[key])
    return QuickStats(rate_s=min(c.fwd_layer_s + c.bwd_layer_s for c in costs),
                      first_s=min(c.fwd_first_s + c.bwd_first_s for c in costs),
                      last_s=min(c.fwd_last_s + c.bwd_last_s for c in costs),
                      state_per_layer=state, act_per_layer=act, room=room)
