"""`search_top_plans`: the K best plans (one per template and micro-batch size), exact against a search that
keeps every template's best plan, consistent with `search_plan` and `evaluate_plan`."""

from __future__ import annotations

import random

import pytest

from heteroflow.config import parse_job
from heteroflow.layout import OffloadSpec
from heteroflow.stagemap import SearchOptions, evaluate_plan, search_plan, search_top_plans
from heteroflow.stagemap.estimate import job_hardware
from heteroflow.stagemap.search import run_search

TINY_OPTIONS = SearchOptions(zero=(0, 1), recompute=("none", "full"), sp=(False,),
                             offload=(OffloadSpec(), OffloadSpec(optimizer="cpu")))

EVERY = 100_000
"""A `top_k` no search reaches: nothing is pruned for the top list, every template's best plan is kept."""


def _random_job(rng: random.Random):
    """2 device types on 2-3 small nodes, memory tight enough that layouts and splits matter."""
    types = {f"chip{i}": {"vendor": rng.choice(("nvidia", "amd", "ascend")),
                          "memory_gib": round(rng.uniform(1.25, 2.2), 2), "tflops_bf16": round(rng.uniform(40, 500)),
                          "intra_node_gb_per_s": rng.choice([16, 64, 200])} for i in range(2)}
    nodes = [{"name": f"node{i}", "device": f"chip{i % 2}", "count": rng.choice([1, 2])}
             for i in range(rng.randint(2, 3))]
    return parse_job({
        "cluster": {"inter_node_gb_per_s": rng.choice([5, 25]), "device_types": types, "nodes": nodes},
        "model": {"num_layers": rng.randint(2, 4), "hidden_size": 1024, "ffn_hidden_size": 2816,
                  "num_attention_heads": 16, "num_kv_heads": 4, "vocab_size": 8000, "seq_length": 1024},
        "train": {"global_batch_size": rng.choice([2, 4]), "precision": "bf16"},
    })


def test_top_plans_are_the_best_of_every_template_best_first():
    rng = random.Random(99)
    checked = 0
    while checked < 6:
        job = _random_job(rng)
        every = run_search(job, job_hardware(job, None), TINY_OPTIONS, top_k=EVERY).top
        if len(every) < 3:
            continue
        checked += 1
        for k in (1, 2, 3):
            top = run_search(job, job_hardware(job, None), TINY_OPTIONS, top_k=k).top
            assert [v for v, _ in top] == pytest.approx([v for v, _ in every[:k]], rel=1e-9)
        found = search_top_plans(job, 3, options=TINY_OPTIONS)
        best = search_plan(job, options=TINY_OPTIONS)
        assert found[0].step_time_s == pytest.approx(best.estimate.step_time_s, rel=1e-9)
        assert [e.step_time_s for e in found] == sorted(e.step_time_s for e in found)
        assert len({str(e.plan.to_dict()) for e in found}) == len(found)
        for e in found:  # each figure is the cost model's for that plan
            assert evaluate_plan(job, e.plan).step_time_s == pytest.approx(e.step_time_s, rel=1e-12)
