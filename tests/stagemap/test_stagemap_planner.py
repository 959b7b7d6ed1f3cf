"""The planner: exact on enumerable instances, never worse than the baselines, explains infeasible jobs."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from conftest import REPO
from heteroflow.config import load_job, parse_job
from heteroflow.layout import OffloadSpec
from heteroflow.stagemap import SearchOptions, evaluate_plan, search_plan
from heteroflow.stagemap.exhaustive import exhaustive_search

EXAMPLE_JOBS = sorted((REPO / "configs" / "jobs").glob("*.yaml"))
VENDORS = ("nvidia", "amd", "hygon", "ascend")
TINY_OPTIONS = SearchOptions(zero=(0, 3), recompute=("none", "full"), sp=(False,),
                             offload=(OffloadSpec(), OffloadSpec(optimizer="cpu")))


def _random_job(rng: random.Random):
    """2 or 3 device types on 2-3 small nodes, memory tight enough that layouts and splits matter."""
    kinds = rng.randint(2, 3)
    types = {f"chip{i}": {"vendor": rng.choice(VENDORS), "memory_gib": round(rng.uniform(1.25, 2.2), 2),
                          "tflops_bf16": round(rng.uniform(40, 500)), "intra_node_gb_per_s": rng.choice([16, 64, 200]),
                          "hbm_gb_per_s": rng.choice([800, 1600, 3000]), "host_link_gb_per_s": rng.choice([16, 32])}
             for i in range(kinds)}
    nodes = [{"name": f"node{i}", "device": f"chip{i % kinds}", "count": rng.choice([1, 2])} for i in range(rng.randint(kinds, 3))]
    return parse_job({
        "cluster": {"inter_node_gb_per_s": rng.choice([5, 25]), "device_types": types, "nodes": nodes},
        "model": {"num_layers": rng.randint(2, 4), "hidden_size": 1024, "ffn_hidden_size": 2816,
                  "num_attention_heads": 16, "num_kv_heads": 4, "vocab_size": 8000, "seq_length": 1024},
        "train": {"global_batch_size": rng.choice([2, 4]), "precision": "bf16"},
    })


def test_planner_finds_the_exhaustive_optimum_on_random_small_clusters():
    rng = random.Random(1234)
    checked = feasible = 0
    while checked < 8:
        job = _random_job(rng)
        report = search_plan(job, options=TINY_OPTIONS)
        best, plan, priced = exhaustive_search(job, options=TINY_OPTIONS)
        checked += 1
        if plan is None:
            assert not report.feasible and report.problems
            continue
        feasible += 1
        assert report.feasible
        assert report.estimate.step_time_s == pytest.approx(best, rel=1e-9), (job.cluster, priced)
    assert feasible >= 5


@pytest.mark.parametrize("path", EXAMPLE_JOBS, ids=lambda p: p.name)
def test_planner_is_never_worse_than_the_baselines_on_the_examples(path):
    report = search_plan(load_job(path))
    assert report.feasible
    for name in ("megatron_uniform", "best_single_type"):
        baseline = report.baselines[name]
        if baseline.estimate is not None:
            assert report.estimate.tokens_per_s >= baseline.estimate.tokens_per_s * (1 - 1e-12), name
    # the answer is self-consistent: re-estimating the plan gives the same figures
    again = evaluate_plan(load_job(path), report.plan)
    assert again.step_time_s == pytest.approx(report.estimate.step_time_s, rel=1e-12)


def test_planner_is_clearly_better_when_device_types_differ_strongly():
    job = parse_job({
        "cluster": {"inter_node_gb_per_s": 25, "nodes": [{"name": "h100", "device": "nvidia-h100-sxm", "count": 8},
                                                          {"name": "dcu", "device": "hygon-k100-ai", "count": 8}]},
        "model": "llama2-13b", "train": {"global_batch_size": 256, "precision": "bf16"}})
    report = search_plan(job)
    uniform = report.baselines["megatron_uniform"].estimate
    single = report.baselines["best_single_type"].estimate
    assert report.estimate.tokens_per_s > 1.5 * uniform.tokens_per_s  # even layers waste the fast chips
    assert report.estimate.tokens_per_s > 1.03 * single.tokens_per_s  # and the slow chips still help
    types = {s.device_type for s in report.estimate.stages}
    assert types == {"nvidia-h100-sxm", "hygon-k100-ai"}
    fast = sum(s.layers[1] - s.layers[0] for s in report.estimate.stages if s.device_type == "nvidia-h100-sxm")
    assert fast > job.model.num_layers / 2  # the faster chips carry more layers


def test_a_job_that_fits_nowhere_is_explained():
    job = parse_job({
        "cluster": {"device_types": {"edge-gpu": {"vendor": "nvidia", "memory_gib": 2, "tflops_bf16": 100,
                                                  "intra_node_gb_per_s": 50},
                                     "edge-npu": {"vendor": "ascend", "memory_gib": 3, "tflops_bf16": 100,
                                                  "intra_node_gb_per_s": 50}},
                    "nodes": [{"name": "a", "device": "edge-gpu", "count": 2},
                              {"name": "b", "device": "edge-npu", "count": 2}]},
        "model": {"preset": "llama2-7b", "seq_length": 32768}, "train": {"global_batch_size": 8, "precision": "bf16"}})
    report = search_plan(job)
    assert not report.feasible and report.estimate is None
    text = "\n".join(report.problems)
    assert "edge-gpu" in text and "edge-npu" in text
    # how much memory each type lacks (fully offloaded: the embedding's bf16 weights stay on the device, and the
    # activations the blocks save; both types need the same 5.8 GiB)
    assert "short by 3.8 GiB" in text and "short by 2.8 GiB" in text
    assert "offload" in text and "shorter sequence" in text  # and what was tried / would help
    data = report.to_json()
    assert data["feasible"] is False and data["problems"] and "baselines" in data


def test_an_explicit_plan_that_does_not_fit_reports_the_stage_and_its_numbers():
    from dataclasses import replace
    job = load_job(REPO / "configs" / "jobs" / "qwen2.5-7b-dcu.yaml")
    plan = replace(job.plan, micro_batch_size=64)  # 16x the activations of the shipped plan
    estimate = evaluate_plan(job, plan)
    assert not estimate.feasible
    assert len(estimate.problems) == 1  # the second stage recomputes and offloads: it still fits
    line = estimate.problems[0]
    assert line.startswith("stage 0 (16 x hygon-bw1000, layers 0-17, tp4 dp4 sp zero1)")
    assert "needs" in line and "GiB per device but has 64.0 GiB" in line and "short by" in line
    assert "recompute full" in line  # what would make it fit
    assert estimate.to_json()["problems"] == list(estimate.problems)


def test_branch_and_bound_keeps_the_best_template_and_the_best_of_each_type():
    from heteroflow.stagemap.estimate import job_hardware
    from heteroflow.stagemap.search import Planner
    from heteroflow.stagemap.space import micro_batch_sizes, templates
    job = load_job(REPO / "configs" / "jobs" / "emulated-three-vendor.yaml")
    hardware = job_hardware(job, None)
    result = Planner(job, hardware, SearchOptions()).run()
    every = Planner(job, hardware, SearchOptions())  # no bounds: each template's exact optimum
    best, per_type = float("inf"), {}
    for mbs in micro_batch_sizes(job, SearchOptions()):
        for tpl in templates(job, every.classes, mbs):
            found = every.solve(tpl, mbs, "1f1b", float("inf"))
            if found:
                best = min(best, found[0])
                types = {every.classes[c].device_type for c, _ in tpl}
                if len(types) == 1:
                    kind = types.pop()
                    per_type[kind] = min(per_type.get(kind, float("inf")), found[0])
    assert result.best[0] == pytest.approx(best, rel=1e-12)
    assert {k: v[0] for k, v in result.per_type.items()} == pytest.approx(per_type, rel=1e-12)
    assert result.solved < result.templates / 10  # the bounds prune most templates


def test_the_layout_skyline_keeps_exactly_the_rows_no_other_row_beats():
    from heteroflow.stagemap.options import _skyline
    rng = np.random.default_rng(4)
    for _ in range(200):
        rows = rng.integers(0, 3, size=(int(rng.integers(0, 150)), int(rng.integers(1, 6)))).astype(float)
        # of equal rows the first stays; any other row <= everywhere and smaller somewhere beats a row
        expected = [i for i, r in enumerate(rows)
                    if not any((rows[j] <= r).all() and ((rows[j] < r).any() or j < i) for j in range(len(rows)) if j != i)]
        assert _skyline(rows) == expected


def test_least_curve_over_its_narrowed_layouts_gives_the_same_floats_as_over_all_of_them():
    from heteroflow.stagemap import options
    from heteroflow.stagemap.estimate import job_hardware
    from heteroflow.stagemap.search import Planner
    job = load_job(REPO / "configs" / "jobs" / "emulated-three-vendor.yaml")
    planner = Planner(job, job_hardware(job, None), SearchOptions())
    layers, checked = job.model.num_layers, 0
    for c, cls in enumerate(planner.classes):
        for size in (1, 2, cls.num_devices):
            for mbs in (1, 2, 4):
                if not planner.layouts(c, size, mbs):
                    continue
                table = planner.table(c, size, mbs)
                k = table.coef
                for first, last, in_flight, m in itertools.product((False, True), (False, True), (1, 3, 8), (1, 8)):
                    got = options.least_curve(table, first=first, last=last, in_flight=in_flight,
                                              max_layers=layers, micro_batches=m)
                    # every layout of the table, as the curve was priced before it was narrowed
                    f0 = (k[:, options._FF] * first + k[:, options._FL] * last + k[:, options._BF] * first
                          + k[:, options._BL] * last)
                    t0 = (k[:, options._TC] + k[:, options._TF] * first + k[:, options._TLA] * last
                          + k[:, options._TB] * (first and last))
                    m0 = (k[:, options._MC] + k[:, options._MF] * first + k[:, options._MLA] * last
                          + k[:, options._MB] * (first and last))
                    n = np.arange(1, layers + 1, dtype=float)[:, None]
                    fits = m0[None, :] + (k[:, options._ML] + in_flight * k[:, options._MI])[None, :] * n \
                        <= table.capacity_bytes
                    time = (k[:, options._F] + k[:, options._B])[None, :] * n + f0[None, :]
                    tail = k[:, options._TL][None, :] * n + t0[None, :]
                    want = (np.where(fits, time, np.inf).min(axis=1), np.where(fits, m * time + tail, np.inf).min(axis=1),
                            np.where(fits, tail, np.inf).min(axis=1))
                    assert all(np.array_equal(a, b) for a, b in zip(got, want))
                    checked += 1
    assert checked >= 24


def _slot_curve_over_every_row(table, *, first, last, in_flight, max_layers):
    """`slot_curve` as it was before its rows were narrowed per position: the skyline over every table row."""
    from heteroflow.stagemap import options as o
    c, both = table.coef, first and last
    f0, b0 = c[:, o._FF] * first + c[:, o._FL] * last, c[:, o._BF] * first + c[:, o._BL] * last
    t0 = c[:, o._TC] + c[:, o._TF] * first + c[:, o._TLA] * last + c[:, o._TB] * both
    m0 = c[:, o._MC] + c[:, o._MF] * first + c[:, o._MLA] * last + c[:, o._MB] * both
    mslope, room = c[:, o._ML] + in_flight * c[:, o._MI], table.capacity_bytes - m0
    with np.errstate(divide="ignore", invalid="ignore"):
        lmax = np.where(mslope > 0, np.floor(room / np.where(mslope > 0, mslope, 1.0)),
                        np.where(room >= 0, max_layers, -1))
    lmax = np.minimum(lmax, max_layers)
    rows = np.stack([c[:, o._F], f0, c[:, o._B], b0, c[:, o._TL], t0, -lmax], axis=1)
    live = [i for i in o._skyline(rows) if lmax[i] >= 1]
    layers = np.arange(1, max_layers + 1, dtype=float)[:, None]
    return ([table.layouts[i] for i in live], c[live, o._F][None, :] * layers + f0[live][None, :],
            c[live, o._B][None, :] * layers + b0[live][None, :], c[live, o._TL][None, :] * layers + t0[live][None, :],
            lmax[live][None, :] >= layers)


def test_slot_curve_keeps_the_layouts_and_floats_of_the_skyline_over_every_row():
    from heteroflow.stagemap.options import LayoutTable, slot_curve
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(0, 60))
        # small integers: many ties, so the tie rule (the first row stays) is exercised
        coef = rng.integers(0, 4, size=(n, 17)).astype(float)
        table = LayoutTable([f"layout {i}" for i in range(n)], [None] * n, coef, float(rng.integers(4, 40)))
        for first, last, in_flight in itertools.product((False, True), (False, True), (1, 2, 5)):
            curve = slot_curve(table, first=first, last=last, in_flight=in_flight, max_layers=6)
            layouts, fwd, bwd, tail, fits = _slot_curve_over_every_row(table, first=first, last=last,
                                                                        in_flight=in_flight, max_layers=6)
            assert curve.layouts == layouts
            for got, want in ((curve.forward, fwd), (curve.backward, bwd), (curve.tail, tail), (curve.fits, fits)):
                assert got.shape[1] == want.shape[1] and (not want.size or np.array_equal(got, want))
