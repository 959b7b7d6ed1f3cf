"""Baselines reported next to every plan.

- `megatron_uniform`: what Megatron-LM can express: every device of the cluster, ranks in cluster order
  cut into p equal pipeline stages with an even layer split (p divides the layers), the same tp and dp on
  every stage and the same sp / ZeRO / recompute / offload settings (and, for a MoE model, the same ep and
  etp: Megatron has one `--expert-model-parallel-size`), 1F1B; the best such plan.
- `best_single_type`: the best plan the planner finds using devices of one type only (same search space).

Both give each stage the precision the planner would (`space.stage_precisions`): `train.precision`, or on
a device type that cannot train in it, the best of those it can.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from heteroflow.config.cluster import DeviceRef
from heteroflow.config.job import JobConfig
from heteroflow.config.plan import PlanSpec, StageSpec
from heteroflow.stagemap.costs import StageHardware, stage_costs_many
from heteroflow.stagemap.options import coefficients
from heteroflow.stagemap.estimate import boundary_times
from heteroflow.stagemap.hardware import Hardware
from heteroflow.layout import ParallelLayout, tp_valid
from heteroflow.stagemap.layout import expert_choices, offload_allowed, searched
from heteroflow.stagemap.memory import GIB
from heteroflow.stagemap.pipeline import in_flight, pipeline_time
from heteroflow.stagemap.space import SearchOptions, layout_precision, micro_batch_sizes, stage_precisions


@dataclass(frozen=True, slots=True)
class _Chunk:
    refs: tuple[DeviceRef, ...]
    device_type: str
    nodes: frozenset[str]
    devices: tuple[str, ...]


def _chunks(job: JobConfig, p: int) -> list[_Chunk] | None:
    """All devices in cluster order cut into p equal chunks, each of one device type (None if impossible)."""
    refs = job.cluster.devices()
    size = len(refs) // p
    out = []
    for k in range(p):
        part = refs[k * size:(k + 1) * size]
        types = {job.cluster.node(r.node).device for r in part}
        if len(types) != 1:
            return None
        out.append(_Chunk(tuple(part), types.pop(), frozenset(r.node for r in part), _spell(job, part)))
    return out


def _spell(job: JobConfig, part: list[DeviceRef]) -> tuple[str, ...]:
    """`NODE` for whole nodes, `NODE:i-j` for parts."""
    by_node: dict[str, list[int]] = {}
    for r in part:
        by_node.setdefault(r.node, []).append(r.index)
    out = []
    for node, idx in by_node.items():
        if len(idx) == job.cluster.node(node).count:
            out.append(node)
        else:
            out.append(f"{node}:{idx[0]}" if len(idx) == 1 else f"{node}:{idx[0]}-{idx[-1]}")
    return tuple(out)


def _tp_inside_nodes(chunk: _Chunk, tp: int) -> bool:
    return all(len({r.node for r in chunk.refs[g:g + tp]}) == 1 for g in range(0, len(chunk.refs), tp))


def megatron_uniform(job: JobConfig, hardware: Hardware, options: SearchOptions) -> tuple[float, PlanSpec] | str:
    """The best Megatron-style uniform plan as (step time, plan), or the reason there is none."""
    types = sorted({n.device for n in job.cluster.nodes})
    if not all(hardware.precisions(t) for t in types):
        return "it must use every device, and some device types cannot train in any precision"
    # One precision per device type: each choice `stage_precisions` leaves (usually just one).
    choices = [dict(zip(types, combo)) for combo in itertools.product(*(stage_precisions(job, hardware, t)
                                                                        for t in types))]
    total, layers = job.cluster.num_devices, job.model.num_layers
    combos = []  # (bound, p, mbs, tp, chunks, shapes)
    for p, precision in itertools.product([d for d in range(1, layers + 1) if layers % d == 0 and total % d == 0],
                                          choices):
        chunks = _chunks(job, p)
        if chunks is None:
            continue
        size = total // p
        shapes = [StageHardware(device=hardware.device(c.device_type, precision[c.device_type]), num_devices=size,
                                num_nodes=len(c.nodes), node_count=max(job.cluster.node(n).count for n in c.nodes))
                  for c in chunks]
        for mbs in micro_batch_sizes(job, options):
            m = job.train.global_batch_size // mbs
            for tp in range(1, size + 1):
                if size % tp or mbs % (size // tp) or not tp_valid(job.model, tp):
                    continue
                if not all(_tp_inside_nodes(c, tp) for c in chunks):
                    continue
                bound = _uniform_bound(job, hardware, shapes, tp, size // tp, mbs, m, layers // p, options)
                if bound < math.inf:  # some layout exists (an ep option may leave none)
                    combos.append((bound, p, mbs, tp, chunks, shapes))
    if not combos:
        return "no even split of the devices into stages keeps each stage on one device type"
    best: tuple[float, PlanSpec] | None = None
    for bound, p, mbs, tp, chunks, shapes in sorted(combos, key=lambda c: c[0]):
        if best is not None and bound >= best[0]:
            break
        m = job.train.global_batch_size // mbs
        recv = boundary_times(job, hardware, list(zip(shapes, (c.nodes for c in chunks))), mbs)
        found = _best_uniform(job, hardware, shapes, chunks, recv, tp, (total // p) // tp, mbs, m, layers // p, options)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best if best is not None else "no uniform layout fits in memory"


def _uniform_bound(job: JobConfig, hardware: Hardware, shapes: list[StageHardware], tp: int, dp: int, mbs: int,
                   m: int, per_stage: int, options: SearchOptions) -> float:
    """step >= m * (F + B) of the slowest stage, each at its fastest layout (ZeRO 0/1, no recompute or offload)."""
    # ZeRO 0 is never slower per layer than ZeRO 1-3, so it bounds whichever stages are allowed.
    fast = [lay for lay in (ParallelLayout(tp=tp, dp=dp, sp=sp, ep=ep, etp=etp) for sp in (False, True)
                            for ep, etp in expert_choices(job.model, tp=tp, num_devices=tp * dp, ep=options.ep,
                                                          expert_parallel=options.expert_parallel))
            if searched(lay, job.model, micro_batch_size=mbs)]
    if not fast:
        return math.inf
    worst = 0.0
    for shape in set(shapes):
        rate = min(c.fwd_layer_s + c.bwd_layer_s for c in stage_costs_many(job.model, shape, _at(job, fast, shape),
                                                                               mbs, hardware))
        worst = max(worst, rate)
    return m * per_stage * worst


def _best_uniform(job: JobConfig, hardware: Hardware, shapes: list[StageHardware], chunks: list[_Chunk],
                  recv: list[float], tp: int, dp: int, mbs: int, m: int, per_stage: int,
                  options: SearchOptions) -> tuple[float, PlanSpec] | None:
    """Best uniform layout for fixed stages, tp and dp."""
    layouts = [ParallelLayout(tp=tp, dp=dp, sp=sp, zero=z, recompute=rc, offload=off, ep=ep, etp=etp)
               for ep, etp in expert_choices(job.model, tp=tp, num_devices=tp * dp, ep=options.ep,
                                             expert_parallel=options.expert_parallel)
               for sp in options.sp for z in options.zero for rc in options.recompute for off in options.offload]
    layouts = [lay for lay in layouts if searched(lay, job.model, micro_batch_size=mbs)]
    layouts = [lay for lay in layouts if offload_allowed(lay, offload_zero=options.offload_zero)]
    if not layouts:
        return None
    p = len(shapes)
    coef = {s: np.array([coefficients(c) for c in stage_costs_many(job.model, s, _at(job, layouts, s), mbs,
                                                                   hardware)]) for s in set(shapes)}
    n = len(layouts)
    fwd, bwd, tail = np.zeros((n, p)), np.zeros((n, p)), np.zeros((n, p))
    fits = np.ones(n, dtype=bool)
    ell = per_stage
    for k, shape in enumerate(shapes):
        c = coef[shape]
        first, last = k == 0, k == p - 1
        f = in_flight("1f1b", p, k, m)
        fwd[:, k] = c[:, 0] * ell + c[:, 1] * first + c[:, 2] * last + (recv[k - 1] if k else 0.0)
        bwd[:, k] = c[:, 3] * ell + c[:, 4] * first + c[:, 5] * last + (recv[k] if k < p - 1 else 0.0)
        tail[:, k] = c[:, 6] + c[:, 7] * ell + c[:, 8] * first + c[:, 9] * last + c[:, 10] * (first and last)
        mem = (c[:, 11] + ell * (c[:, 12] + f * c[:, 13]) + c[:, 14] * first + c[:, 15] * last
               + c[:, 16] * (first and last))
        fits &= mem <= shape.device.memory_gib * GIB
    # step >= m * max_k (F_k + B_k) + max tail: evaluate layouts in that order until the bound passes the best.
    bound = m * (fwd + bwd).max(axis=1) + tail.max(axis=1)
    best = None
    for i in sorted(np.flatnonzero(fits), key=lambda i: bound[i]):
        if best is not None and bound[i] >= best[0]:
            break
        value = pipeline_time([float(x) for x in fwd[i]], [float(x) for x in bwd[i]], m, "1f1b") + float(tail[i].max())
        if best is None or value < best[0]:
            best = (value, int(i))
    if best is None:
        return None
    lay = layouts[best[1]]
    stages = tuple(StageSpec(devices=c.devices, device_refs=c.refs, device_type=c.device_type, layers=per_stage,
                             layout=_at(job, [lay], s)[0]) for c, s in zip(chunks, shapes))
    return best[0], PlanSpec(stages=stages, schedule="1f1b", micro_batch_size=mbs)


def _at(job: JobConfig, layouts: list[ParallelLayout], shape: StageHardware) -> list[ParallelLayout]:
    """`layouts` for a stage computing in `shape`'s precision."""
    precision = layout_precision(job, shape.precision)
    return [replace(lay, precision=precision) for lay in layouts]
