"""The planner's search: best-first branch and bound over templates (space.py), micro-batch sizes and
schedules, with the exact dynamic program of dp.py for each template's layer split and layouts.

Every template first gets a quick lower bound (per-layer rates of the fastest layouts, memory bounds from
closed formulas, see `Planner.bound`); the template with the least bound is taken next. A quick bound is
replaced by a refined one computed from the layouts that actually fit at each position (`dp.fill_bound`:
fill, drain, tails); a refined one leads to the dynamic program, which is seeded with a greedy plan and
prunes with the incumbent. The search stops when the least bound left reaches every incumbent: the best
plan, and the best plan of each device type (reported as the `best_single_type` baseline, so it keeps its
own incumbent). GPipe is not searched when 1F1B is allowed: on the same stages its closed form is never
smaller and it keeps more micro-batches in flight.

With `top_k > 1` the search also keeps the `top_k` best plans, each the best plan of its own template and
micro-batch size (so they differ in stages or batch, not only in one layer's place), and prunes with the
`top_k`-th of them (`heteroflow tune` runs these).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from heteroflow.config.job import JobConfig
from heteroflow.config.plan import PlanSpec, StageSpec
from heteroflow.stagemap.costs import StageHardware
from heteroflow.stagemap.dp import fill_bound, greedy, solve
from heteroflow.stagemap.estimate import boundary_times
from heteroflow.stagemap.hardware import Hardware
from heteroflow.stagemap.options import (LayoutTable, QuickStats, SlotCurve, StageOptions, layout_table, least_curve,
                                         quick_stats, slot_curve)
from heteroflow.stagemap.pipeline import in_flight, pipeline_time
from heteroflow.stagemap.space import (Group, SearchOptions, device_classes, groups, layouts_for,
                                       micro_batch_sizes, templates)

Template = tuple[tuple[int, int], ...]


@dataclass(slots=True)
class SearchResult:
    """Best plans found: overall and per device type, with counters."""

    best: tuple[float, PlanSpec] | None = None
    per_type: dict[str, tuple[float, PlanSpec]] = field(default_factory=dict)
    top: list[tuple[float, PlanSpec]] = field(default_factory=list)
    """The `top_k` best plans found, fastest first (the best one included)."""
    templates: int = 0
    solved: int = 0


class Planner:
    """Holds the caches of one search (layout tables, option tables, bounds)."""

    def __init__(self, job: JobConfig, hardware: Hardware, options: SearchOptions, top_k: int = 1):
        assert top_k >= 1
        self.job, self.hardware, self.options, self.top_k = job, hardware, options, top_k
        self.classes = device_classes(job, hardware, options.device_types)
        self._tables: dict[tuple, LayoutTable] = {}
        self._stats: dict[tuple, QuickStats] = {}
        self._curves: dict[tuple, SlotCurve] = {}
        self._least: dict[tuple, tuple[np.ndarray, float]] = {}
        self._placements: dict[tuple, tuple] = {}
        self._fill: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        """Per (template, micro-batch size, schedule): `dp.fill_bound`'s G and S for the dynamic program."""
        self.warm_bound = True
        self._layouts: dict[tuple, list] = {}

    def shape(self, c: int, size: int) -> StageHardware:
        cls = self.classes[c]
        return StageHardware(device=self.hardware.device(cls.device_type, cls.precision), num_devices=size,
                             num_nodes=max(1, size // cls.node_count), node_count=cls.node_count)

    def layouts(self, c: int, size: int, mbs: int) -> list:
        key = (c, size, mbs)
        if key not in self._layouts:
            self._layouts[key] = layouts_for(self.job, self.classes[c], size, mbs, self.options)
        return self._layouts[key]

    def stats(self, c: int, size: int, mbs: int) -> QuickStats | None:
        key = (c, size, mbs)
        if key not in self._stats:
            lays = self.layouts(c, size, mbs)
            self._stats[key] = quick_stats(self.job, self.hardware, self.shape(c, size), lays, mbs) if lays else None
        return self._stats[key]

    def placement(self, tpl: Template, mbs: int) -> tuple[list[tuple[int, int, Group]], list[float]]:
        """The template's stages (class, size, group) and the boundary transfer times between them."""
        key = (tpl, mbs)
        if key not in self._placements:
            slots = [(c, size, g) for c, size in tpl for g in self.groups(c, size)]
            recv = [self.boundary(a, b, mbs) for a, b in zip(slots, slots[1:])]
            self._placements[key] = slots, recv
        return self._placements[key]

    def boundary(self, sender: tuple[int, int, Group], receiver: tuple[int, int, Group], mbs: int) -> float:
        """`boundary_times` of two neighbouring stages, cached by what it depends on: the stages' shapes, how
        many nodes each spans and whether they share their one node."""
        (ca, sa, ga), (cb, sb, gb) = sender, receiver
        key = ("boundary", ca, sa, len(ga.nodes), cb, sb, len(gb.nodes), ga.nodes == gb.nodes, mbs)
        if key not in self._placements:
            placed = [(self.shape(ca, sa), ga.nodes), (self.shape(cb, sb), gb.nodes)]
            self._placements[key] = boundary_times(self.job, self.hardware, placed, mbs)[0]
        return self._placements[key]

    def groups(self, c: int, size: int) -> list[Group]:
        """The groups a class is cut into at this size (cached)."""
        key = ("groups", c, size)
        if key not in self._placements:
            self._placements[key] = groups(self.classes[c], size)
        return self._placements[key]

    def count(self, c: int, size: int) -> int:
        """Stages a class is cut into at this size."""
        return len(self.groups(c, size))

    def bound(self, tpl: Template, mbs: int, schedule: str) -> float | None:
        """A lower bound on the template's step time, or None when it cannot hold the model.

        Every stage k satisfies step >= sum_{l<k} t_l + m t_k with t = F + B (the first micro-batch reaches
        stage k, which then works m micro-batches, and the last gradient leaves it), hence (i) step >= m *
        max_k t_k and (ii) a weighted mean of these inequalities with equal coefficient c on every t_l:
        step >= c sum_l t_l, c = 1 / (1 - (1 - 1/m)^p). Here t_k >= layers_k * (least time per layer of any
        layout) + first/last-stage extras + the boundary transfers stage k receives, and layers_k is bounded by
        memory (`QuickStats`)."""
        m = self.job.train.global_batch_size // mbs
        layers = self.job.model.num_layers
        stats, counts = [], []
        for c, size in tpl:
            st = self.stats(c, size, mbs)
            if st is None:
                return None
            stats.append(st)
            counts.append(self.count(c, size))
        p = sum(counts)
        rate = np.repeat([st.rate_s for st in stats], counts)
        state = np.repeat([st.state_per_layer for st in stats], counts)
        act = np.repeat([st.act_per_layer for st in stats], counts)
        room = np.repeat([st.room for st in stats], counts)
        extra = _transfer_shift(self.placement(tpl, mbs)[1], p)  # every F + B includes its boundary transfers
        extra[0] += stats[0].first_s
        extra[-1] += stats[-1].last_s
        flight = np.full(p, float(m)) if schedule == "gpipe" else np.minimum(p - np.arange(p), m).astype(float)
        slope = state + flight * act
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(slope > 0, np.floor(room / np.where(slope > 0, slope, 1.0)), layers - p + 1)
        most = np.minimum(np.where(room >= 0, most, 0), layers - p + 1).astype(int)
        if most.min() < 1 or most.sum() < layers:
            return None
        # tau: the layers-th smallest of {extra_k + j rate_k : 1 <= j <= most_k}, and at least every first one.
        owner = np.repeat(np.arange(p), most)
        j = np.arange(len(owner)) - np.repeat(np.cumsum(most) - most, most) + 1
        values = extra[owner] + j * rate[owner]
        tau = max(float(np.max(rate + extra)), float(np.partition(values, layers - 1)[layers - 1]))
        coeff = 1.0 / (1.0 - (1.0 - 1.0 / m) ** p)
        fill = coeff * (float(np.sum(rate + extra)) + (layers - p) * float(np.min(rate)))
        return max(m * tau, fill) * (1 - 1e-9)

    def table(self, c: int, size: int, mbs: int) -> LayoutTable:
        key = (c, size, mbs)
        if key not in self._tables:
            self._tables[key] = layout_table(self.job, self.hardware, self.shape(c, size), self.layouts(c, size, mbs), mbs)
        return self._tables[key]

    def curves(self, slots: list[tuple[int, int, Group]], mbs: int, schedule: str) -> list[SlotCurve]:
        """Each stage's options at its position (before boundary transfers)."""
        p, m, layers = len(slots), self.job.train.global_batch_size // mbs, self.job.model.num_layers
        out = []
        for k, (c, size, _) in enumerate(slots):
            key = (c, size, mbs, k == 0, k == p - 1, in_flight(schedule, p, k, m), layers - p + 1)
            if key not in self._curves:
                self._curves[key] = slot_curve(self.table(c, size, mbs), first=key[3], last=key[4],
                                               in_flight=key[5], max_layers=key[6])
            out.append(self._curves[key])
        return out

    def least_times(self, tpl: Template, mbs: int, schedule: str, incumbent: float = float("inf")) -> tuple | None:
        """Per stage, by layer count, over the layouts that fit: least F + B (transfers included), least
        m (F + B) + tail and least tail, cut where the second reaches `incumbent` (such stages cannot be in a
        better plan)."""
        slots, recv = self.placement(tpl, mbs)
        p, m, layers = len(slots), self.job.train.global_batch_size // mbs, self.job.model.num_layers
        rows = []
        for k, (c, size, _) in enumerate(slots):
            key = (c, size, mbs, k == 0, k == p - 1, in_flight(schedule, p, k, m))
            if key not in self._least:
                self._least[key] = least_curve(self.table(c, size, mbs), first=key[3], last=key[4],
                                               in_flight=key[5], max_layers=layers, micro_batches=m)
            rows.append(self._least[key])
        top = layers - p + 1
        curve, own, tail = (np.stack([r[i][:top] for r in rows]) for i in range(3))
        shift = _transfer_shift(recv, p)
        t = curve + shift[:, None]
        o = own + m * shift[:, None]
        keep = (o < incumbent).sum(axis=1)  # o is non-decreasing: fewer layouts fit more layers
        if keep.min() == 0:
            return None
        return ([t[k, :n] for k, n in enumerate(keep.tolist())], [o[k, :n] for k, n in enumerate(keep.tolist())],
                [tail[k, :n] for k, n in enumerate(keep.tolist())])

    def refined_bound(self, tpl: Template, mbs: int, schedule: str,
                      incumbent: float = float("inf")) -> tuple[float, np.ndarray] | None:
        """A lower bound on the template's step time with the layouts that actually fit, over plans that
        could beat `incumbent` (None: none can), and the fill and sum tables for the dynamic program.

        step = T + max_j tail_j >= G[0, L] (see dp.fill_bound)."""
        got = self.least_times(tpl, mbs, schedule, incumbent)
        if got is None:
            return None
        least, owns, tails = got
        layers = self.job.model.num_layers
        if sum(len(t) for t in least) < layers:
            return None
        m = self.job.train.global_batch_size // mbs
        # Cheap first: step >= max_k own_k(layers_k) >= the least such max over splits, which (own_k being
        # non-decreasing) is the layers-th smallest own value, and at least every stage's own at one layer.
        pool = np.concatenate(owns)
        cheap = max(max(o[0] for o in owns), float(np.partition(pool, layers - 1)[layers - 1]))
        if cheap >= incumbent:
            return None
        warm = tails if schedule == "1f1b" and self.warm_bound else None
        G, S = fill_bound(least, layers, m, owns, warm, sums=True)
        value = G[0, layers]
        if not np.isfinite(value):
            return None
        return value * (1 - 1e-9), (G, S)

    def solve(self, tpl: Template, mbs: int, schedule: str, incumbent: float,
              lower: float = 0.0) -> tuple[float, PlanSpec] | None:
        """The best plan of one template, if it beats `incumbent` (`lower`: a lower bound on its step time).

        The dynamic program is exact below the value it is given, and prunes the harder the closer that
        value is to the optimum: without an incumbent it is first asked for plans within a little of `lower`,
        then within more, up to the greedy plan's value; the first answer is the optimum."""
        slots, recv = self.placement(tpl, mbs)
        p, m, layers = len(slots), self.job.train.global_batch_size // mbs, self.job.model.num_layers
        tables = [StageOptions(curve, recv[k - 1] if k else 0.0, recv[k] if k < p - 1 else 0.0)
                  for k, curve in enumerate(self.curves(slots, mbs, schedule))]
        start = greedy(tables, layers, m, schedule)
        bound = incumbent
        if start is not None and start[0] < incumbent:
            bound = start[0] * (1 + 1e-12)
        fill = self._fill.get((tpl, mbs, schedule))
        if fill is None:
            refined = self.refined_bound(tpl, mbs, schedule, bound)
            fill = refined[1] if refined else None
        found = None
        # With an incumbent, most templates cannot beat it: asking below it first would only repeat the work.
        for target in (_targets(lower, bound) if incumbent == float("inf") else [bound]):
            found = solve(tables, layers, m, schedule, target, *(fill or (None, None)))
            if found is not None:
                break
        if found is None and start is not None and start[0] < incumbent:
            found = start
        if found is None:
            return None
        value, chosen = found
        if schedule == "1f1b" and any(o.backward_s < o.forward_s for o in chosen):
            # The dynamic program minimises the 1F1B closed form, a lower bound on such a plan's makespan.
            value = pipeline_time([o.forward_s for o in chosen], [o.backward_s for o in chosen], m, schedule)
            value += max(o.tail_s for o in chosen)
            if value >= incumbent:
                return None
        stages = tuple(StageSpec(devices=g.devices, device_refs=g.refs, device_type=self.classes[c].device_type,
                                 layers=o.layers, layout=o.layout)
                       for (c, _, g), o in zip(slots, chosen))
        return value, PlanSpec(stages=stages, schedule=schedule, micro_batch_size=mbs)

    def candidates(self) -> list[tuple[float, int, str, Template]]:
        """(bound, micro-batch size, schedule, template) for every template that could hold the model."""
        out = []
        schedules = self.options.schedules
        if "1f1b" in schedules:
            # GPipe never beats 1F1B on the same stages (its closed form bounds 1F1B's from above) and holds
            # more micro-batches in flight, so it cannot give a better plan.
            schedules = ("1f1b",)
        for mbs in micro_batch_sizes(self.job, self.options):
            for tpl in templates(self.job, self.classes, mbs):
                for schedule in schedules:
                    b = self.bound(tpl, mbs, schedule)
                    if b is not None:
                        out.append((b, mbs, schedule, tpl))
        return out

    def run(self) -> SearchResult:
        """Best-first branch and bound: pop the template with the least bound; a quick bound is first
        replaced by the refined one (which prices the layouts that fit), a refined one is solved."""
        result = SearchResult()
        heap = [(b, 0, n, mbs, schedule, tpl) for n, (b, mbs, schedule, tpl) in enumerate(self.candidates())]
        heapq.heapify(heap)
        result.templates = len(heap)
        while heap:
            b, refined, n, mbs, schedule, tpl = heapq.heappop(heap)
            types = {self.classes[c].device_type for c, _ in tpl}
            single = next(iter(types)) if len(types) == 1 else None
            incumbent = max(self._incumbent(result, single), self._kth(result))
            if b >= incumbent:
                if self._done(result, b):
                    break  # every later template's bound is at least b: none can improve any incumbent
                continue
            if not refined:
                rb = self.refined_bound(tpl, mbs, schedule, incumbent)
                if rb is not None:
                    self._fill[(tpl, mbs, schedule)] = rb[1]  # valid for any smaller incumbent too
                    heapq.heappush(heap, (max(rb[0], b), 1, n, mbs, schedule, tpl))
                continue
            found = self.solve(tpl, mbs, schedule, incumbent, lower=b)
            result.solved += 1
            if found is None:
                continue
            if result.best is None or found[0] < result.best[0]:
                result.best = found
            if self.top_k > 1:
                result.top = sorted([*result.top, found], key=lambda v: v[0])[: self.top_k]
            if single is not None and (single not in result.per_type or found[0] < result.per_type[single][0]):
                result.per_type[single] = found
        return result

    def _done(self, result: SearchResult, bound: float) -> bool:
        """Whether `bound` reaches every incumbent (the best plan and the best plan of each device type)."""
        types = {c.device_type for c in self.classes}
        if result.best is None or any(t not in result.per_type for t in types):
            return False
        return bound >= max(result.best[0], self._kth(result), *(v[0] for v in result.per_type.values()))

    def _kth(self, result: SearchResult) -> float:
        """The value a template must beat to enter the `top_k` best plans (-inf when only the best is kept)."""
        if self.top_k == 1:
            return float("-inf")
        return result.top[-1][0] if len(result.top) == self.top_k else float("inf")

    @staticmethod
    def _incumbent(result: SearchResult, single: str | None) -> float:
        """The value a template must beat: the best plan, or for a one-type template the best of its type."""
        if single is None:
            return result.best[0] if result.best else float("inf")
        return result.per_type[single][0] if single in result.per_type else float("inf")


def _transfer_shift(recv: list[float], p: int) -> np.ndarray:
    """Per stage, the boundary transfers its F + B includes: the one it receives forward and the one it receives
    backward (`recv[k]`: between stages k and k + 1)."""
    shift = np.zeros(p)
    if p > 1:
        shift[1:] += recv
        shift[:-1] += recv
    return shift


TARGET_STEPS = (1.002, 1.01, 1.02, 1.035, 1.05, 1.07, 1.1, 1.13, 1.17, 1.22, 1.3, 1.4)
"""Values the dynamic program is first asked to beat, as multiples of the template's lower bound."""


def _targets(lower: float, bound: float) -> list[float]:
    """Increasing values below `bound` to search under, ending with `bound` itself."""
    if not lower > 0 or not np.isfinite(lower):
        return [bound]
    return [lower * f for f in TARGET_STEPS if lower * f < bound] + [bound]


def run_search(job: JobConfig, hardware: Hardware, options: SearchOptions, top_k: int = 1) -> SearchResult:
    """Search the template space (without baselines), keeping the `top_k` best plans."""
    result = Planner(job, hardware, options, top_k).run()
    if top_k == 1 and result.best is not None:
        result.top = [result.best]
    return result
