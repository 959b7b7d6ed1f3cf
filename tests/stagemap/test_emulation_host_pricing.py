"""What emulated ranks pay beyond the measured rates (a profile's `emulation` section): blocking transfers wait
the measured busy latency, and more threads than cores run slower than processor sharing by the measured
slowdown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import parse_job
from heteroflow.errors import ConfigError
from heteroflow.stagemap import evaluate_plan, load_profile, save_profile
from heteroflow.stagemap.emulation import emulated_device
from heteroflow.stagemap.pipeline import run_shared, sharing_speed
from heteroflow.stagemap.profile import (DeviceProfile, EmulationProfile, HostProfile, LinkProfile, Profile,
                                         ThreadProfile, per_core_value)

BUSY = EmulationProfile(busy_latency_s=((1.0, 1e-3),), oversubscribed_slowdown=((2.0, 1.2), (4.0, 1.5)))


def _profile(emulation: EmulationProfile | None = BUSY) -> Profile:
    thread = ThreadProfile(gemm_tflops={"fp32": ((16, 0.004), (128, 0.12), (1024, 0.15))},
                           attention_tflops={"fp32": ((16, 0.02, 0.01), (64, 0.05, 0.02))},
                           elementwise_gb_per_s=20.0, block_forward_overhead_s=4e-4, block_backward_overhead_s=6e-4)
    return Profile(host=HostProfile(name="box", cpu_cores=2, memory_gib=16.0, memory_gb_per_s=10.0),
                   devices=(DeviceProfile(device_type="cpu", vendor="cpu", memory_gb_per_s=10.0,
                                          gemm_tflops={"fp32": ((128, 0.1), (1024, 0.2))}),),
                   link=LinkProfile(backend="gloo", gb_per_s=2.0, latency_s=5e-5, allreduce_gb_per_s=1.0,
                                    allreduce_latency_s=6e-5),
                   cpu_thread=thread, emulation=emulation)


def test_the_emulation_section_round_trips_and_is_checked(tmp_path):
    save_profile(_profile(), tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").emulation == BUSY
    text = (tmp_path / "p.yaml").read_text()
    assert "- [2.0, 1.2]" in text
    (tmp_path / "bad.yaml").write_text(text.replace("- [2.0, 1.2]", "- [0.5, 1.2]"))
    with pytest.raises(ConfigError) as error:
        load_profile(tmp_path / "bad.yaml")
    assert "profile.emulation.oversubscribed_slowdown: expected a list of [processes per core (at least 1)" in str(
        error.value)


def test_more_threads_than_cores_run_slower_than_processor_sharing_by_the_measured_slowdown():
    curve = BUSY.oversubscribed_slowdown
    assert sharing_speed(2, 2, curve) == 1.0 and sharing_speed(1, 2, curve) == 1.0
    assert sharing_speed(4, 2, ()) == 0.5  # processor sharing alone
    assert sharing_speed(4, 2, curve) == pytest.approx(0.5 / 1.2)
    assert sharing_speed(3, 2, curve) == pytest.approx((2 / 3) / 1.1)  # halfway from (1, 1.0) to (2, 1.2)
    assert sharing_speed(6, 2, curve) == pytest.approx((1 / 3) / 1.35)
    assert sharing_speed(16, 2, curve) == pytest.approx((1 / 8) / 1.5)  # the last point beyond
    assert per_core_value(((1.0, 2e-3),), 3.0) == 2e-3
    # four one-thread stages on two cores, all busy at once: every operation takes 1.2 x twice its time
    alone = run_shared([1.0] * 4, [1.0] * 4, 1, "gpipe", threads=[1] * 4, cores=2)
    slowed = run_shared([1.0] * 4, [1.0] * 4, 1, "gpipe", threads=[1] * 4, cores=2, oversubscribed=curve)
    assert slowed.makespan_s == pytest.approx(alone.makespan_s)  # one stage busy at a time: no sharing
    wide = run_shared([1.0], [1.0], 1, "gpipe", threads=[4], cores=2, oversubscribed=curve)
    assert wide.makespan_s == pytest.approx(2 * 2 * 1.2)


def test_blocking_transfers_wait_the_measured_busy_latency():
    plain = emulated_device("fp32", profile=_profile(None), num_ranks=2, cores=2)
    busy = emulated_device("fp32", profile=_profile(), num_ranks=2, cores=2)
    assert plain.collective_link() == (1.0, 6e-5)  # the idle all-reduce's figures
    assert busy.collective_link() == (1.0, 1e-3) and busy.intra_latency_s == 1e-3  # same bandwidth, busy wait
    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "cpu", "count": 4}]},
                     "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 8, "precision": "fp32"},
                     "plan": {"micro_batch_size": 4, "stages": [{"devices": ["n:0-1"], "layers": 4, "tp": 2},
                                                                {"devices": ["n:2-3"], "layers": 4, "tp": 2}]}})
    idle = evaluate_plan(job, job.plan, profile=_profile(None), emulate=True)
    waited = evaluate_plan(job, job.plan, profile=_profile(replace(BUSY, oversubscribed_slowdown=())), emulate=True)
    for a, b in zip(idle.stages, waited.stages):
        assert b.times.collective_s > a.times.collective_s + 0.9 * 2 * 8 * 1e-3  # >= 8 all-reduces of 2 steps
        assert b.recv_forward_s >= a.recv_forward_s
    assert waited.stages[1].recv_forward_s == pytest.approx(idle.stages[1].recv_forward_s - 5e-5 + 1e-3)
