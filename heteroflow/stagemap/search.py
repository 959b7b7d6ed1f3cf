"""`search_plan`: the planner. Branch and bound over templates (space.py) ordered by a lower bound, with
the exact dynamic program of dp.py for each template's layer split and layouts.

Template lower bound: every stage k satisfies step >= m * (F_k + B_k) >= m * layers_k * r_k, where r_k is
the least per-layer time of any layout of that stage shape; so step >= m * tau, tau the smallest bottleneck
that lets the stages hold all layers (each at most the layers its most frugal layouts could fit). A
template whose bound reaches the best plan found so far is skipped. The best plan on one device type is
tracked separately (its own incumbent) because it is reported as a baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import heapq
from time import perf_counter

import numpy as np

from heteroflow.config.job import JobConfig
from heteroflow.config.plan import PlanSpec, StageSpec
from heteroflow.stagemap.costs import StageHardware
from heteroflow.stagemap.dp import Option, fill_bound, greedy, shifted, solve
from heteroflow.stagemap.estimate import boundary_times
from heteroflow.stagemap.hardware import Hardware
from heteroflow.stagemap.options import (LayoutTable, QuickStats, SlotCurve, layout_table, least_curve, quick_stats,
                                         slot_curve, slot_options)
from heteroflow.stagemap.pipeline import in_flight
from heteroflow.stagemap.space import (DeviceClass, Group, SearchOptions, device_classes, groups, layouts_for,
                                       micro_batch_sizes, templates)

Template = tuple[tuple[int, int], ...]


@dataclass(slots=True)
class SearchResult:
    """Best plans found: overall and per device type, with counters."""

    best: tuple[float, PlanSpec] | None = None
    per_type: dict[str, tuple[float, PlanSpec]] = field(default_factory=dict)
    templates: int = 0
    solved: int = 0


class Planner:
    """Holds the caches of one search (layout tables, option tables, bounds)."""

    def __init__(self, job: JobConfig, hardware: Hardware, options: SearchOptions):
        self.job, self.hardware, self.options = job, hardware, options
        self.classes = device_classes(job, set(hardware.devices), options.device_types)
        self._tables: dict[tuple, LayoutTable] = {}
        self._stats: dict[tuple, QuickStats] = {}
        self._slots: dict[tuple, dict[int, list[Option]]] = {}
        self._curves: dict[tuple, SlotCurve] = {}
        self._least: dict[tuple, tuple[np.ndarray, float]] = {}
        self._placements: dict[tuple, tuple] = {}
        self._layouts: dict[tuple, list] = {}

    def shape(self, c: int, size: int) -> StageHardware:
        cls = self.classes[c]
        return StageHardware(device=self.hardware.devices[cls.device_type], num_devices=size,
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
            slots = [(c, size, g) for c, size in tpl for g in groups(self.classes[c], size)]
            placed = [(self.shape(c, size), g.nodes) for c, size, g in slots]
            self._placements[key] = slots, boundary_times(self.job, self.hardware, placed, mbs)
        return self._placements[key]

    def bound(self, tpl: Template, mbs: int, schedule: str) -> float | None:
        """A lower bound on the template's step time, or None when it cannot hold the model.

        Every stage k satisfies step >= sum_{l<k} t_l + m t_k with t = F + B (the first micro-batch reaches
        stage k, which then works m micro-batches, and the last gradient leaves it), hence (i) step >= m *
        max_k t_k and (ii) a weighted mean of these inequalities with equal coefficient c on every t_l:
        step >= c sum_l t_l, c = 1 / (1 - (1 - 1/m)^p). t_k >= layers_k * rate + transfers + extras, and
        layers_k is bounded by memory."""
        m = self.job.train.global_batch_size // mbs
        slots, recv = self.placement(tpl, mbs)
        p, layers = len(slots), self.job.model.num_layers
        parts = []
        for k, (c, size, _) in enumerate(slots):
            st = self.stats(c, size, mbs)
            if st is None:
                return None
            most = st.max_layers(in_flight(schedule, p, k, m), layers - p + 1)
            if most < 1:
                return None
            extra = (recv[k - 1] if k else 0.0) + (recv[k] if k < p - 1 else 0.0)
            extra += st.first_s * (k == 0) + st.last_s * (k == p - 1)
            parts.append((st.rate_s, extra, most))
        rate, extra, most = (np.array(x, dtype=float) for x in zip(*parts))
        if most.sum() < layers:
            return None
        lo, hi = float(np.max(rate + extra)), float(np.max(rate * most + extra))
        for _ in range(40):
            mid = (lo + hi) / 2
            if np.minimum(most, np.floor((mid - extra) / rate + 1e-9)).sum() >= layers:
                hi = mid
            else:
                lo = mid
        coeff = 1.0 / (1.0 - (1.0 - 1.0 / m) ** p)
        fill = coeff * (float(np.sum(rate + extra)) + (layers - p) * float(np.min(rate)))
        return max(m * lo * (1 - 1e-9), fill)

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

    def least_times(self, tpl: Template, mbs: int, schedule: str) -> tuple[list[np.ndarray], list[float]] | None:
        """Per stage: least F + B over the layouts that fit, by layer count (transfers included); least tails."""
        slots, recv = self.placement(tpl, mbs)
        p, m, layers = len(slots), self.job.train.global_batch_size // mbs, self.job.model.num_layers
        least, tails = [], []
        for k, (c, size, _) in enumerate(slots):
            key = (c, size, mbs, k == 0, k == p - 1, in_flight(schedule, p, k, m), layers - p + 1)
            if key not in self._least:
                self._least[key] = least_curve(self.table(c, size, mbs), first=key[3], last=key[4],
                                               in_flight=key[5], max_layers=key[6])
            curve, tail = self._least[key]
            if not np.isfinite(curve[0]):
                return None
            least.append(curve + (recv[k - 1] if k else 0.0) + (recv[k] if k < p - 1 else 0.0))
            tails.append(tail)
        return least, tails

    def refined_bound(self, tpl: Template, mbs: int, schedule: str) -> tuple[float, np.ndarray] | None:
        """step >= G[0, L] + max tail (see dp.fill_bound), with the layouts that actually fit."""
        got = self.least_times(tpl, mbs, schedule)
        if got is None:
            return None
        least, tails = got
        m = self.job.train.global_batch_size // mbs
        G = fill_bound(least, self.job.model.num_layers, m)
        value = G[0, self.job.model.num_layers]
        if not np.isfinite(value):
            return None
        return value * (1 - 1e-9) + max(tails), G

    def solve(self, tpl: Template, mbs: int, schedule: str, incumbent: float) -> tuple[float, PlanSpec] | None:
        """The best plan of one template, if it beats `incumbent`."""
        slots, recv = self.placement(tpl, mbs)
        p, m, layers = len(slots), self.job.train.global_batch_size // mbs, self.job.model.num_layers
        base = []
        for k, ((c, size, _), curve) in enumerate(zip(slots, self.curves(slots, mbs, schedule))):
            key = (c, size, mbs, k == 0, k == p - 1, in_flight(schedule, p, k, m), layers - p + 1)
            if key not in self._slots:
                self._slots[key] = slot_options(curve, recv_in=0.0, recv_out=0.0)
            base.append(self._slots[key])
        if any(not o for o in base):
            return None
        opts = shifted(base, [recv[k - 1] if k else 0.0 for k in range(p)],
                       [recv[k] if k < p - 1 else 0.0 for k in range(p)])
        start = greedy(opts, layers, m, schedule)
        bound = incumbent
        if start is not None and start[0] < incumbent:
            bound = start[0] * (1 + 1e-12)
        refined = self.refined_bound(tpl, mbs, schedule)
        found = solve(opts, layers, m, schedule, bound, refined[1] if refined else None)
        if found is None and start is not None and start[0] < incumbent:
            found = start
        if found is None:
            return None
        value, chosen = found
        stages = tuple(StageSpec(devices=g.devices, device_refs=g.refs, device_type=self.classes[c].device_type,
                                 layers=o.layers, **o.layout.stage_fields())
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
            incumbent = self._incumbent(result, single)
            if b >= incumbent:
                if single is None and all(t in result.per_type for t in self._types()):
                    break  # every later template is bounded by at least b: nothing left can win
                continue
            if not refined:
                rb = self.refined_bound(tpl, mbs, schedule)
                if rb is not None:
                    heapq.heappush(heap, (max(rb[0], b), 1, n, mbs, schedule, tpl))
                continue
            found = self.solve(tpl, mbs, schedule, incumbent)
            result.solved += 1
            if found is None:
                continue
            if result.best is None or found[0] < result.best[0]:
                result.best = found
            if single is not None and (single not in result.per_type or found[0] < result.per_type[single][0]):
                result.per_type[single] = found
        return result

    def _types(self) -> set[str]:
        return {c.device_type for c in self.classes}

    @staticmethod
    def _incumbent(result: SearchResult, single: str | None) -> float:
        """The value a template must beat: the best plan, or for a one-type template the best of its type."""
        if single is None:
            return result.best[0] if result.best else float("inf")
        return result.per_type[single][0] if single in result.per_type else float("inf")


def run_search(job: JobConfig, hardware: Hardware, options: SearchOptions) -> SearchResult:
    """Search the template space (without baselines)."""
    return Planner(job, hardware, options).run()
