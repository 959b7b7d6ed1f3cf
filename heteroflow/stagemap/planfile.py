"""Plan files written by `heteroflow plan -o`: the plan's schema plus what the cost model predicts."""

from __future__ import annotations

import os
from pathlib import Path

from heteroflow.config.yamlfile import dump_yaml
from heteroflow.stagemap.estimate import PlanEstimate


def plan_document(estimate: PlanEstimate) -> dict:
    """`{"plan": ...}` with layers as [first, last_exclusive] and a `predicted` mapping per stage and plan."""
    plan = estimate.plan.to_dict()
    for stage, est in zip(plan["stages"], estimate.stages):
        stage["layers"] = list(est.layers)
        stage["predicted"] = {"memory_peak_gib": round(est.memory_peak_gib, 2),
                              "memory_capacity_gib": round(est.memory_capacity_gib, 2),
                              "forward_s": float(f"{est.forward_s:.6g}"), "backward_s": float(f"{est.backward_s:.6g}")}
    plan["predicted"] = estimate.predicted()
    return {"plan": plan}


def write_plan(estimate: PlanEstimate, path: str | os.PathLike) -> None:
    """Write the plan file that `--evaluate` and `train --plan` accept unchanged."""
    text = dump_yaml(plan_document(estimate), sort_keys=False, default_flow_style=None, width=120)
    Path(path).write_text("# written by `heteroflow plan`; `predicted` is what the cost model expects\n" + text,
                          encoding="utf-8")
