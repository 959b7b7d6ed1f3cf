"""Plans of MoE models with expert parallelism: per-stage ep on a mixed cluster, the baselines with one ep, the
all-to-all as its own part of the step, and ep / etp in the plan's JSON and text."""

from __future__ import annotations

import json

import pytest

from heteroflow.config import parse_job
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.api import search_plan
from heteroflow.stagemap.breakdown import PARTS
from heteroflow.stagemap.report import format_report
from heteroflow.stagemap.space import RUNTIME_LAYOUTS, SearchOptions

MIXED = {"inter_node_gb_per_s": 25,
         "nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 8},
                   {"name": "npu-0", "device": "ascend-910b", "count": 8},
                   {"name": "dcu-0", "device": "hygon-bw1000", "count": 8},
                   {"name": "dcu-1", "device": "hygon-bw1000", "count": 8}]}


def _mixtral(plan: object = "auto", **train):
    return parse_job({"cluster": MIXED, "model": {"preset": "mixtral-8x7b", "seq_length": 4096},
                      "train": {"global_batch_size": 64, "precision": "bf16", **train}, "plan": plan})


@pytest.fixture(scope="module")
def mixtral_report():
    return search_plan(_mixtral())


def test_mixtral_on_a_mixed_cluster_searches_ep_per_stage(mixtral_report):
    stages = mixtral_report.estimate.stages
    assert all(s.fits for s in stages) and any(s.layout.ep > 1 for s in stages)
    # The search found a plan at least as fast as the best with one ep on every stage.
    for ep in (1, 2, 8):
        one = search_plan(_mixtral(), options=SearchOptions(ep=(ep,), include_megatron=False))
        if one.estimate is not None:
            assert mixtral_report.estimate.step_time_s <= one.estimate.step_time_s * (1 + 1e-9)


def test_baselines_cover_moe_with_one_ep(mixtral_report):
    uniform = mixtral_report.baselines["megatron_uniform"].estimate
    assert uniform is not None and len({(s.layout.ep, s.layout.etp) for s in uniform.stages}) == 1
    single = mixtral_report.baselines["best_single_type"].estimate
    assert single is not None and len({s.device_type for s in single.stages}) == 1
    pinned = search_plan(_mixtral(), options=SearchOptions(ep=(2,)))
    assert {s.layout.ep for s in pinned.baselines["megatron_uniform"].estimate.stages} == {2}


def test_alltoall_is_its_own_part_of_the_step():
    stages = [{"devices": ["gpu-0"], "layers": 16, "tp": 2, "dp": 4, "ep": 4},
              {"devices": ["npu-0"], "layers": 16, "tp": 2, "dp": 4}]
    job = _mixtral({"schedule": "1f1b", "micro_batch_size": 4, "stages": stages})
    est = evaluate_plan(job, job.plan)
    assert "alltoall_s" in PARTS
    with_ep, without = (s.times for s in est.stages)
    assert with_ep.alltoall_s > 0 and without.alltoall_s == 0
    for s in est.stages:
        assert sum(s.times.to_dict().values()) == pytest.approx(est.step_time_s, rel=1e-9)
    # Full recompute repeats the forward's dispatch and combine in the backward.
    again = _mixtral({"schedule": "1f1b", "micro_batch_size": 4,
                      "stages": [dict(stages[0], recompute="full"), stages[1]]})
    assert evaluate_plan(again, again.plan).stages[0].times.alltoall_s == pytest.approx(1.5 * with_ep.alltoall_s)


def test_plan_json_and_text_show_the_expert_layout(mixtral_report):
    doc = json.loads(json.dumps(mixtral_report.to_json()))
    assert [(s["ep"], s["etp"]) for s in doc["stages"]] == [
        (s.layout.ep, s.layout.expert_tp) for s in mixtral_report.estimate.stages]
    assert all("alltoall_s" in s["step_parts_s"] for s in doc["stages"])
    assert all("ep" in s and "etp" in s for s in doc["baselines"]["megatron_uniform"]["stages"])
    text = format_report(mixtral_report)
    assert any(f"ep{s.layout.ep}" in text for s in mixtral_report.estimate.stages if s.layout.ep > 1)
    assert "all-to-all" in text


def test_plan_auto_searches_expert_layouts():
    report = search_plan(_mixtral(), options=RUNTIME_LAYOUTS)  # what `train` with `plan: auto` runs
    assert any(s.layout.ep > 1 for s in report.estimate.stages)
