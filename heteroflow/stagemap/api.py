"""`search_plan`: the planner's entry point, with baselines and explanations."""

from __future__ import annotations

from time import perf_counter

from heteroflow.config.job import JobConfig
from heteroflow.stagemap.baselines import megatron_uniform
from heteroflow.stagemap.estimate import evaluate_plan, job_hardware, resolve_profile
from heteroflow.stagemap.explain import explain_infeasible
from heteroflow.stagemap.profile import Profile
from heteroflow.stagemap.report import Baseline, PlanReport
from heteroflow.stagemap.search import run_search
from heteroflow.stagemap.space import SearchOptions


def search_plan(job: JobConfig, *, profile: Profile | None = None, options: SearchOptions | None = None) -> PlanReport:
    """Find the plan with the highest predicted throughput for `job` (its `plan:` section is ignored).

    The result holds the best plan's estimate, the `megatron_uniform` and `best_single_type` baselines and
    the search time; when nothing fits, `problems` explains which device type lacks how much memory.
    """
    options = options or SearchOptions()
    start = perf_counter()
    profile = resolve_profile(job, profile)
    hardware = job_hardware(job, profile)
    result = run_search(job, hardware, options)
    uniform = megatron_uniform(job, hardware, options)
    best = result.best
    if options.include_megatron and not isinstance(uniform, str) and (best is None or uniform[0] < best[0]):
        best = uniform  # the uniform plan can lie outside the template space (stages spanning node parts)
    single = min(result.per_type.values(), key=lambda v: v[0], default=None)
    elapsed = perf_counter() - start
    estimate = evaluate_plan(job, best[1], profile=profile) if best is not None else None
    baselines = {
        "megatron_uniform": Baseline(name="megatron_uniform", reason=uniform if isinstance(uniform, str) else "",
                                     estimate=None if isinstance(uniform, str) else evaluate_plan(job, uniform[1], profile=profile)),
        "best_single_type": Baseline(name="best_single_type", reason="" if single else "no single device type fits",
                                     estimate=evaluate_plan(job, single[1], profile=profile) if single else None),
    }
    problems = () if estimate is not None else tuple(explain_infeasible(job, hardware))
    stats = {"templates": result.templates, "templates_solved": result.solved}
    return PlanReport(estimate=estimate, baselines=baselines, search_time_s=elapsed, problems=problems, stats=stats)
