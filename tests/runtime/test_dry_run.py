"""Dry runs (`heteroflow train --dry-run`): one rank of a plan built in a fake world, nothing computed.

Every rank of small plans of many layouts: its groups are the plan's for that rank, one `new_group` call each;
its state is the planner's figure (to the byte where it stays on the device, as a real run's measurement is in
`test_memory_truth`; within 10% with offloaded state; under ZeRO-3 or with offloaded parameters the optimizer
state and tiers, as the blocks a step gathers or fetches exist only inside it), its action list holds what the
planner prices. Then the full-size plans under configs/
(Llama-3 70B on 1,024 and 4,096 devices of three vendors): the first, a middle and the last rank each in
under a minute, state within 10% of the planner's figure.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.backends import RankMap
from heteroflow.backends.groups import plan_groups
from heteroflow.config import load_job, parse_job
from heteroflow.launcher.dry_run import default_ranks, dry_run_job
from heteroflow.launcher.prepare import choose_plan
from heteroflow.runtime.dry_run import STATE_KEYS, dry_run_rank, format_report
from heteroflow.testing.memory_layouts import CLUSTER, LAYOUTS, MODEL, TRAIN, _two_stages

SMALL = {**LAYOUTS, "dp2-zero3": _two_stages(dp=2, zero=3), "tp2-zero3-optimizer-cpu": _two_stages(
    tp=2, zero=3, offload={"optimizer": "cpu"})}


def small_job(name: str):
    model = {**MODEL, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64}} if name.startswith("moe") \
        else MODEL
    return parse_job({"cluster": CLUSTER, "model": model, "train": TRAIN, "plan": SMALL[name]})


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_rank_of_a_small_plan_builds_what_the_plan_says(name):
    job = small_job(name)
    rank_map = RankMap.from_plan(job.plan, job.cluster)
    order = plan_groups(rank_map)
    offloads = job.plan.stages[0].layout.offload.moves_state
    for rank in range(rank_map.world_size):
        report = dry_run_rank(job, job.plan, rank)
        where = format_report(report)
        own = [spec for spec in order if rank in spec.ranks]
        assert {g.ranks for g in report.groups} == {spec.ranks for spec in own}, where
        assert {g.backend for g in report.groups} == {"nccl"}, where  # an NVIDIA cluster, not emulated
        tied = 1 if job.model.tie_embeddings else 0  # every rank creates the tied-embedding group too
        assert report.num_created == len(own) + tied and report.num_plan_groups == len(order), where
        if report.step_windows:  # gathered (ZeRO-3) or fetched (offloaded) blocks exist only inside a step
            assert report.measured["optimizer"] == pytest.approx(report.planned["optimizer"], rel=0.10), where
            assert report.measured["offload"] == pytest.approx(report.planned["offload"], rel=0.10), where
            assert 0 < report.measured["params"] <= report.planned["params"], where
        elif offloads:
            assert report.state_ratio() == pytest.approx(1.0, abs=0.10), where
        else:  # on the device, byte for byte
            assert [report.measured[k] for k in STATE_KEYS] == [report.planned[k] for k in STATE_KEYS], where
        assert report.measured["shard"] > 0
        assert report.walk.in_flight == report.walk.planned_in_flight, where
        num_micro_batches = job.plan.num_micro_batches(job.train)
        assert report.walk.actions.count("F") == report.walk.actions.count("B") == num_micro_batches
        first, last = report.stage == 0, report.stage == len(job.plan.stages) - 1
        assert (report.walk.recv_messages > 0) == (report.walk.send_messages > 0) == (first or last)


def test_default_ranks_are_the_first_a_middle_and_the_last():
    assert default_ranks(4096) == [0, 2048, 4095]
    assert default_ranks(2) == [0, 1] and default_ranks(1) == [0]


def heteroflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_cli_dry_run_of_chosen_ranks_and_its_errors():
    job = "configs/jobs/emulated-three-vendor.yaml"
    result = heteroflow("train", job, "--dry-run", "--rank", "1", "--rank", "7")
    assert result.returncode == 0, result.stderr
    assert "rank 1 of 8: stage" in result.stdout and "rank 7 of 8: stage" in result.stdout
    assert "memory (" in result.stdout and "one step (" in result.stdout
    bad = heteroflow("train", job, "--dry-run", "--rank", "8")
    assert bad.returncode == 2 and "--rank: 8 not in this plan's ranks 0..7" in bad.stderr
    alone = heteroflow("train", job, "--rank", "1")
    assert alone.returncode == 2 and "--rank applies to dry runs: add --dry-run" in alone.stderr


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1024, 4096])
def test_full_size_plans_dry_run_in_under_a_minute_per_rank(devices):
    job = load_job(REPO / f"configs/jobs/llama3-70b-three-vendor-{devices}.yaml")
    plan_path = str(REPO / f"configs/plans/llama3-70b-three-vendor-{devices}.yaml")
    assert choose_plan(job, plan_path).num_devices == devices
    vendors = {job.cluster.device_types[s.device_type].vendor for s in choose_plan(job, plan_path).stages}
    assert vendors == {"nvidia", "amd", "ascend"}
    results = dry_run_job(job, plan_path=plan_path, ranks=None, print_report=lambda text: None)
    assert [r.rank for r, _ in results] == [0, devices // 2, devices - 1]
    for report, wall_s in results:
        where = format_report(report, wall_s=wall_s)
        assert wall_s < 60, where
        assert report.state_ratio() == pytest.approx(1.0, abs=0.10), where
        assert len(report.groups) <= 8 < report.num_plan_groups, where
