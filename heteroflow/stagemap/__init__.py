"""stagemap: the heterogeneous cost model and the planner (no torch needed).

Public API:
- `evaluate_plan(job, plan, *, profile=None, emulate=False, calibration=None) -> PlanEstimate`
- `search_plan(job, *, profile=None, options=None, calibration=None) -> PlanReport` (`RUNTIME_LAYOUTS`: what
  `train` runs); `calibration` (`stagemap.calibration`, fitted by `heteroflow calibrate`) defaults to the job's
  `cluster.calibration`
- `search_top_plans(job, top_k, ...) -> list[PlanEstimate]`: the `top_k` best plans (for `heteroflow tune`)
- `Profile`, `load_profile`, `save_profile` (measurements written by `heteroflow profile`)
"""

from heteroflow.stagemap.api import search_plan, search_top_plans
from heteroflow.stagemap.estimate import PlanEstimate, StageEstimate, evaluate_plan
from heteroflow.stagemap.profile import Profile, load_profile, save_profile
from heteroflow.stagemap.report import Baseline, PlanReport
from heteroflow.stagemap.space import RUNTIME_LAYOUTS, SearchOptions

__all__ = ["RUNTIME_LAYOUTS", "Baseline", "PlanEstimate", "PlanReport", "Profile", "SearchOptions", "StageEstimate", "evaluate_plan",
           "load_profile", "save_profile", "search_plan", "search_top_plans"]
