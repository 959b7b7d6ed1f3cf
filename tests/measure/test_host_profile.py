"""Emulated runs of a job without `cluster.profile` are priced from this host's quick profile, measured once and
cached under heteroflow's cache directory (`heteroflow/measure/host.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import REPO
from heteroflow.config import load_job
from heteroflow.errors import UserError
from heteroflow.launcher.prepare import predicted_times
from heteroflow.measure import host, machine
from heteroflow.stagemap import evaluate_plan, load_profile, search_plan

EMULATED = REPO / "configs" / "jobs" / "emulated-three-vendor.yaml"
MEASURED = REPO / "benchmarks" / "results" / "bench_calibration.profile.yaml"  # a profile of the development host


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The host measured as the committed profile (the real measurement takes tens of seconds); counts calls."""
    calls = []

    def measure_profile(*, quick: bool = False, **_):
        calls.append(quick)
        return load_profile(MEASURED)

    monkeypatch.setattr(machine, "measure_profile", measure_profile)
    monkeypatch.setenv("HETEROFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(host.ENV, raising=False)
    return calls


def test_the_host_is_measured_once_then_read_from_the_cache(measured, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = host.host_profile(cache)
    path = host.host_profile_path(cache)
    assert measured == [True] and path.is_file() and path.parent == cache / "host-profile"
    again = host.host_profile(cache)
    assert measured == [True]  # read, not measured again
    assert again.to_dict() == first.to_dict() == load_profile(MEASURED).to_dict()
    monkeypatch.setenv(host.ENV, "refresh")
    host.host_profile(cache)
    assert measured == [True, True]
    monkeypatch.setenv(host.ENV, "off")
    assert host.host_profile(cache) is None
    monkeypatch.setenv(host.ENV, "sometimes")
    with pytest.raises(UserError, match="HETEROFLOW_HOST_PROFILE=sometimes: expected refresh or off"):
        host.host_profile(cache)


def test_the_cache_is_keyed_by_the_host(tmp_path):
    facts = host.host_facts()
    assert host.host_profile_path(tmp_path, facts) == host.host_profile_path(tmp_path)
    assert host.host_profile_path(tmp_path, {**facts, "cores": "1024"}) != host.host_profile_path(tmp_path, facts)


def test_train_emulate_prices_from_the_host_profile_unless_the_job_names_one(measured, tmp_path):
    job = load_job(EMULATED)
    assert not job.cluster.profile
    plan = search_plan(job).plan
    step, stages = predicted_times(job, plan, emulate=True)
    assert measured == [True]
    expected = evaluate_plan(job, plan, emulate=True, profile=load_profile(MEASURED))
    assert step == expected.step_time_s and step != evaluate_plan(job, plan, emulate=True).step_time_s
    assert [s["forward_s"] for s in stages] == [s.times.forward_s for s in expected.stages]
    named = replace(job, cluster=replace(job.cluster, profile=str(MEASURED)))
    assert host.emulation_profile(named, tmp_path / "cache") is None  # the job's own profile is read as before
    assert measured == [True]


def test_tune_emulate_names_the_host_profile_in_its_job(measured, tmp_path):
    job = load_job(EMULATED)
    tuned = host.emulation_job(job, tmp_path / "cache")
    assert tuned.cluster.profile == str(host.host_profile_path(tmp_path / "cache")) and measured == [True]
    assert load_profile(tuned.resolve_path(tuned.cluster.profile)).to_dict() == load_profile(MEASURED).to_dict()
    assert host.emulation_job(tuned, tmp_path / "cache") is tuned  # a job's own profile wins
    assert not list((tmp_path / "cache" / "host-profile").glob("*.partial.yaml"))
