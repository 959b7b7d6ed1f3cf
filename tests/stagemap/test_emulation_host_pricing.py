"""What emulated ranks pay beyond the measured rates (a profile's `emulation` section): blocking transfers wait
the measured busy latency at the step's computing load and take no core, more threads than cores run slower
than processor sharing by the measured slowdown, and a rank's threads give the measured speedup."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import parse_job
from heteroflow.errors import ConfigError
from heteroflow.stagemap import evaluate_plan, load_profile, save_profile
from heteroflow.stagemap.calibration import DeviceFactors, apply_factors
from heteroflow.stagemap.compute import layer_forward
from heteroflow.stagemap.emulation import boundary_cpu_s, emulated_device
from heteroflow.stagemap.pipeline import run_shared, sharing_speed
from heteroflow.stagemap.estimate import computing_per_core
from heteroflow.stagemap.profile import (DeviceProfile, EmulationProfile, HostProfile, LinkProfile, Profile,
                                         ThreadProfile, per_core_value, thread_speedup)

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


def _round_trip_then_corrupt(tmp_path, emulation: EmulationProfile, written: str, corrupted: str) -> str:
    """Save a profile with `emulation`, check it loads back equal and its file holds `written`; then load the
    file with `written` replaced by `corrupted` and return the error it must raise."""
    save_profile(_profile(emulation), tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").emulation == emulation
    text = (tmp_path / "p.yaml").read_text()
    assert written in text
    (tmp_path / "bad.yaml").write_text(text.replace(written, corrupted))
    with pytest.raises(ConfigError) as error:
        load_profile(tmp_path / "bad.yaml")
    return str(error.value)


def test_the_emulation_section_round_trips_and_is_checked(tmp_path):
    error = _round_trip_then_corrupt(tmp_path, BUSY, "- [2.0, 1.2]", "- [0.5, 1.2]")
    assert "profile.emulation.oversubscribed_slowdown: expected a list of [processes per core (at least 1)" in error


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


def test_a_wait_takes_no_core_and_is_not_slowed():
    """Two one-thread stages on one core: stage 0's forward computes 1 s, then blocks 1 s in a collective; stage 1
    then has the core to itself."""
    plain = run_shared([2.0, 1.0], [1.0, 1.0], 1, "gpipe", threads=[1, 1], cores=1)
    waiting = run_shared([2.0, 1.0], [1.0, 1.0], 1, "gpipe", threads=[1, 1], cores=1, waits=([1.0, 0.0], [0.0, 0.0]))
    assert plain.makespan_s == pytest.approx(5.0)  # one stage busy at a time: the sum of the operations
    assert waiting.makespan_s == pytest.approx(5.0)
    assert waiting.forward_wall_s == pytest.approx((1.0, 1.0))  # computing only: the wait is not in it
    # both computing at once: stage 0's last forward and stage 1's wait overlap the other's computing
    both = run_shared([2.0, 2.0], [1.0, 1.0], 2, "1f1b", threads=[1, 1], cores=1, waits=([1.0, 1.0], [0.0, 0.0]))
    unblocked = run_shared([2.0, 2.0], [1.0, 1.0], 2, "1f1b", threads=[1, 1], cores=1)
    assert both.makespan_s < unblocked.makespan_s  # a blocked stage leaves its core to the other


def test_the_waits_are_priced_at_the_steps_own_computing_load():
    """The busy latency is read at the mean computing threads per core of the step, not at ranks per core."""
    curve = replace(BUSY, busy_latency_s=((1.0, 1e-3), (2.0, 3e-3), (4.0, 7e-3)), oversubscribed_slowdown=())
    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "cpu", "count": 8}]},
                     "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 16, "precision": "fp32"},
                     "plan": {"micro_batch_size": 4, "stages": [{"devices": ["n:0-3"], "layers": 4, "tp": 4},
                                                                {"devices": ["n:4-7"], "layers": 4, "tp": 4}]}})
    est = evaluate_plan(job, job.plan, profile=_profile(curve), emulate=True)
    load = computing_per_core(est, 2, 1)
    assert 0 < load < 8 / 2  # the ranks block part of the step: fewer compute at once than there are
    at_load = emulated_device("fp32", profile=_profile(curve), num_ranks=8, cores=2, busy_per_core=load)
    at_ranks = emulated_device("fp32", profile=_profile(curve), num_ranks=8, cores=2)
    assert at_ranks.intra_latency_s == pytest.approx(7e-3)  # 4 ranks a core, without the step's timeline
    assert at_load.intra_latency_s == pytest.approx(per_core_value(curve.busy_latency_s, load))
    # the estimate settled: priced again at its own load, it is the same
    again = computing_per_core(est, 2, 1)
    assert again == pytest.approx(load)
    one_point = evaluate_plan(job, job.plan, profile=_profile(replace(curve, busy_latency_s=((1.0, 7e-3),))),
                              emulate=True)
    assert one_point.step_time_s > est.step_time_s  # waits at 7 ms throughout cost more than at the load


def test_a_ranks_threads_give_the_measured_speedup():
    measured = replace(BUSY, thread_speedup=((2.0, 1.25),))
    assert thread_speedup(measured, 2) == 1.25 and thread_speedup(measured, 1) == 1.0
    assert thread_speedup(measured, 8) == 1.25  # the profiled host had no more cores
    assert thread_speedup(BUSY, 2) == 2.0 and thread_speedup(None, 3) == 3.0  # not measured: one thread's rate each
    one_rank = {"micro_batch_size": 4, "stages": [{"devices": ["n:0"], "layers": 8}]}
    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "cpu", "count": 1}]},
                     "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 16, "precision": "fp32"},
                     "plan": one_rank})
    scaled = evaluate_plan(job, job.plan, profile=_profile(BUSY), emulate=True)
    slower = evaluate_plan(job, job.plan, profile=_profile(measured), emulate=True)
    compute = lambda est: est.stages[0].times.forward_s + est.stages[0].times.backward_s  # noqa: E731
    # the kernels run 2 / 1.25 times as long; the per-block host cost (4 micro-batches x 8 blocks) does not scale
    host = 4 * 8 * (4e-4 + 6e-4)
    assert compute(slower) - host == pytest.approx((compute(scaled) - host) * 2.0 / 1.25, rel=1e-6)


def test_the_thread_speedup_round_trips_and_is_checked(tmp_path):
    measured = replace(BUSY, thread_speedup=((2.0, 1.25),))
    error = _round_trip_then_corrupt(tmp_path, measured, "- [2.0, 1.25]", "- [1.0, 1.25]")
    assert "profile.emulation.thread_speedup: expected a list of [torch threads (at least 2), value]" in error


def test_the_tp_block_overhead_round_trips_and_is_checked(tmp_path):
    measured = replace(BUSY, tp_block_overhead_s=(3e-4, 2e-4))
    error = _round_trip_then_corrupt(tmp_path, measured, "tp_block_overhead_s: [0.0003, 0.0002]",
                                     "tp_block_overhead_s: [0.0003, -1]")
    assert "profile.emulation.tp_block_overhead_s: expected [forward, backward] seconds, each" in error


def test_a_tp_block_pays_the_measured_tp_overhead_and_the_calibration_scales_it():
    measured = replace(BUSY, tp_block_overhead_s=(3e-4, 2e-4))
    spec = parse_job({"cluster": {"nodes": [{"name": "n", "device": "cpu", "count": 2}]},
                      "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 4}}).model
    plain, with_tp = (emulated_device("fp32", profile=_profile(p), num_ranks=2, cores=2) for p in (BUSY, measured))

    def host(dev, tp):
        lc = layer_forward(spec, dev, tokens=128, tp=tp, sp=False, dtype_bytes=4)
        return lc.overhead_s, lc.overhead_backward_s

    assert host(with_tp, 1) == host(plain, 1) == (4e-4, 6e-4)  # tp 1 runs no tp functions
    assert host(with_tp, 2) == pytest.approx((4e-4 + 3e-4, 6e-4 + 2e-4))
    assert host(plain, 2) == (4e-4, 6e-4)  # not measured: nothing added
    slow = apply_factors(with_tp, DeviceFactors(overhead=2.0))
    assert host(slow, 2) == pytest.approx((2 * (4e-4 + 3e-4), 2 * (6e-4 + 2e-4)))


def test_the_transfer_cpu_round_trips_and_is_checked(tmp_path):
    measured = replace(BUSY, transfer_cpu_s=((1.0, 4e-4), (2.0, 1e-3)))
    error = _round_trip_then_corrupt(tmp_path, measured, "- [2.0, 0.001]", "- [2.0, -0.001]")
    assert "profile.emulation.transfer_cpu_s: expected a list of [processes per core (at least 1)" in error


def test_each_end_of_a_boundary_transfer_takes_the_measured_core_time():
    """Four one-thread stages on two cores (2 processes a core): a middle stage's forward and backward each
    receive once and send once, the end stages one of the two; that core time is shared like computing, so the
    step grows by more than the busiest stage's own share would add on cores of its own."""
    assert [boundary_cpu_s(1e-3, k, 4) for k in range(4)] == [1e-3, 2e-3, 2e-3, 1e-3]
    assert boundary_cpu_s(1e-3, 0, 1) == 0.0  # one stage: no boundary
    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "cpu", "count": 4}]},
                     "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 16, "precision": "fp32"},
                     "plan": {"micro_batch_size": 2, "stages": [{"devices": [f"n:{i}"], "layers": 2}
                                                                for i in range(4)]}})
    plain = replace(BUSY, oversubscribed_slowdown=())
    spending = replace(plain, transfer_cpu_s=((1.0, 1e-4), (2.0, 2e-3), (4.0, 3e-3)))
    before = evaluate_plan(job, job.plan, profile=_profile(plain), emulate=True)
    after = evaluate_plan(job, job.plan, profile=_profile(spending), emulate=True)
    m = 8  # micro-batches
    for k, (a, b) in enumerate(zip(before.stages, after.stages)):
        ends = 1 if k in (0, 3) else 2  # read at the plan's 4 ranks / 2 cores = 2 processes a core
        assert b.forward_s - a.forward_s == pytest.approx(ends * 2e-3)
        assert b.backward_s - a.backward_s == pytest.approx(ends * 2e-3)
    added = sum(2 * m * boundary_cpu_s(2e-3, k, 4) for k in range(4))  # core seconds the step's transfers take
    assert after.step_time_s - before.step_time_s >= 0.9 * added / 2  # on 2 cores, about half of it at least
    two = parse_job({"cluster": {"nodes": [{"name": "n", "device": "cpu", "count": 2}]},
                     "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 16, "precision": "fp32"},
                     "plan": {"micro_batch_size": 2, "stages": [{"devices": ["n:0"], "layers": 4},
                                                                {"devices": ["n:1"], "layers": 4}]}})
    one_a_core = evaluate_plan(two, two.plan, profile=_profile(spending), emulate=True)
    unmeasured = evaluate_plan(two, two.plan, profile=_profile(plain), emulate=True)
    assert one_a_core.stages[0].forward_s - unmeasured.stages[0].forward_s == pytest.approx(1e-4)  # 1 a core
