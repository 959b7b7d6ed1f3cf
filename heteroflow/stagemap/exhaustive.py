"""Exhaustive search of the planner's space, for checking the planner on instances small enough to
enumerate: every template, micro-batch size, schedule, layer split and per-stage layout, each priced with
`evaluate_plan` (independently of the planner's bounds, tables and dynamic program)."""

from __future__ import annotations

import itertools
from time import perf_counter

from heteroflow.config.job import JobConfig
from heteroflow.config.plan import PlanSpec, StageSpec
from heteroflow.stagemap.baselines import megatron_uniform
from heteroflow.stagemap.estimate import evaluate_plan, job_hardware, resolve_profile
from heteroflow.stagemap.profile import Profile
from heteroflow.stagemap.space import SearchOptions, device_classes, groups, layouts_for, micro_batch_sizes, templates


class Timeout(Exception):
    """The enumeration ran past its deadline."""


def compositions(total: int, parts: int):
    """Ordered ways to write `total` as `parts` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def exhaustive_search(job: JobConfig, *, profile: Profile | None = None, options: SearchOptions | None = None,
                      deadline_s: float | None = None) -> tuple[float, PlanSpec | None, int]:
    """(best step time, its plan, plans priced); the step time is inf when nothing fits."""
    options = options or SearchOptions()
    start = perf_counter()
    profile = resolve_profile(job, profile)
    hardware = job_hardware(job, profile)
    classes = device_classes(job, hardware, options.device_types)
    best: tuple[float, PlanSpec | None] = (float("inf"), None)
    priced = 0
    layers = job.model.num_layers
    for mbs in micro_batch_sizes(job, options):
        for tpl in templates(job, classes, mbs):
            slots = [(classes[c], size, g) for c, size in tpl for g in groups(classes[c], size)]
            choices = [layouts_for(job, cls, size, mbs, options) for cls, size, _ in slots]
            if any(not c for c in choices):
                continue
            for schedule in options.schedules:
                for split in compositions(layers, len(slots)):
                    for lays in itertools.product(*choices):
                        if deadline_s is not None and perf_counter() - start > deadline_s:
                            raise Timeout(f"exhaustive search passed {deadline_s} s after {priced} plans")
                        stages = tuple(StageSpec(devices=g.devices, device_refs=g.refs, device_type=cls.device_type,
                                                 layers=n, layout=lay)
                                       for (cls, _, g), n, lay in zip(slots, split, lays))
                        plan = PlanSpec(stages=stages, schedule=schedule, micro_batch_size=mbs)
                        est = evaluate_plan(job, plan, profile=profile)
                        priced += 1
                        if est.feasible and est.step_time_s < best[0]:
                            best = (est.step_time_s, plan)
    if options.include_megatron:
        uniform = megatron_uniform(job, hardware, options)
        if not isinstance(uniform, str):
            est = evaluate_plan(job, uniform[1], profile=profile)
            priced += 1
            if est.feasible and est.step_time_s < best[0]:
                best = (est.step_time_s, uniform[1])
    return best[0], best[1], priced


def space_size(job: JobConfig, *, options: SearchOptions | None = None) -> int:
    """How many plans `exhaustive_search` would price (without pricing them)."""
    import math
    options = options or SearchOptions()
    hardware = job_hardware(job, resolve_profile(job, None))
    classes = device_classes(job, hardware, options.device_types)
    total = 0
    for mbs in micro_batch_sizes(job, options):
        counts = {}
        for tpl in templates(job, classes, mbs):
            ways, stages = len(options.schedules), 0
            for c, size in tpl:
                if (c, size) not in counts:
                    counts[(c, size)] = (len(groups(classes[c], size)),
                                         len(layouts_for(job, classes[c], size, mbs, options)))
                q, n = counts[(c, size)]
                ways *= n ** q
                stages += q
            total += ways * math.comb(job.model.num_layers - 1, stages - 1)
    return total
