"""Pricing of `train --emulate`: the profile's `cpu_thread` and all-reduce figures, ranks sharing the cores,
and the counts of heteroflow's own elementwise and optimizer traffic."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import PRESETS, parse_job
from heteroflow.config.model import ModelSpec
from heteroflow.errors import ConfigError
from heteroflow.launcher.launch import threads_per_process as launcher_threads
from heteroflow.stagemap import evaluate_plan, load_profile, save_profile
from heteroflow.stagemap.compute import elementwise_elements, grad_accumulate_s, layer_forward
from heteroflow.stagemap.costs import (DEVICE_ADAM_BYTES_PER_PARAM, FLAT_BUFFER_BYTES_PER_PARAM, StageHardware,
                                       stage_costs)
from heteroflow.layout import ParallelLayout
from heteroflow.layout.shards import layer_params_per_rank
from heteroflow.stagemap.emulation import emulated_device, in_block_slowdown
from heteroflow.stagemap.hardware import Hardware, threads_per_process
from heteroflow.stagemap.profile import (PROFILE_VERSION, DeviceProfile, HostProfile, LinkProfile, Profile,
                                         ThreadProfile, curve_rate)

TINY = PRESETS["tiny-llama"]
REFERENCE = {"hidden_size": 192, "ffn_hidden_size": 512, "num_attention_heads": 6, "num_kv_heads": 2,
             "seq_length": 128, "micro_batch_size": 3}


def _thread(**changes) -> ThreadProfile:
    thread = ThreadProfile(gemm_tflops={"fp32": ((16, 0.004), (128, 0.12), (1024, 0.15))},
                           attention_tflops={"fp32": ((16, 0.02, 0.01), (64, 0.05, 0.02))},
                           elementwise_gb_per_s=20.0, block_forward_overhead_s=4e-4, block_backward_overhead_s=6e-4)
    return replace(thread, **changes)


def _profile(cores: int = 2, thread: ThreadProfile | None = None, link: LinkProfile | None = None) -> Profile:
    return Profile(host=HostProfile(name="box", cpu_cores=cores, memory_gib=16.0, memory_gb_per_s=10.0),
                   devices=(DeviceProfile(device_type="cpu", vendor="cpu", memory_gb_per_s=10.0,
                                          gemm_tflops={"fp32": ((128, 0.1), (1024, 0.2))}),),
                   link=link or LinkProfile(backend="gloo", gb_per_s=2.0, latency_s=5e-5),
                   cpu_thread=thread if thread is not None else _thread())


def _job(stages: list[dict], schedule: str = "1f1b"):
    return parse_job({
        "cluster": {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 4},
                              {"name": "npu-0", "device": "ascend-910b2", "count": 4}]},
        "model": {"preset": "tiny-llama"},
        "train": {"global_batch_size": 16, "micro_batch_size": 4, "precision": "fp32"},
        "plan": {"schedule": schedule, "micro_batch_size": 4, "stages": stages}})


def test_a_profile_with_cpu_thread_and_all_reduce_figures_round_trips(tmp_path):
    thread = _thread(reference_block_shape=dict(REFERENCE), reference_block_s={"fp32": (0.004, 0.009)})
    link = LinkProfile(backend="gloo", gb_per_s=2.0, latency_s=5e-5, allreduce_gb_per_s=1.3, allreduce_latency_s=3e-5)
    profile = _profile(thread=thread, link=link)
    save_profile(profile, tmp_path / "p.yaml")
    loaded = load_profile(tmp_path / "p.yaml")
    assert loaded.cpu_thread == thread and loaded.cpu_thread.gemm_tflops == thread.gemm_tflops
    assert loaded.cpu_thread.attention_tflops == thread.attention_tflops
    assert loaded.cpu_thread.reference_block_s == {"fp32": (0.004, 0.009)}
    assert loaded.cpu_thread.reference_block_shape == REFERENCE
    assert loaded.link == link and loaded.version == PROFILE_VERSION and loaded.emulation is None


def test_version_1_profiles_still_read_and_newer_ones_are_refused(tmp_path):
    old = tmp_path / "v1.yaml"
    old.write_text("profile:\n  version: 1\n  host: {name: box, cpu_cores: 2, memory_gib: 8.0, memory_gb_per_s: 9.0}\n"
                   "  devices:\n  - {device_type: cpu, vendor: cpu, memory_gb_per_s: 9.0, "
                   "gemm_tflops: {fp32: [[256, 0.1]]}}\n"
                   "  link: {backend: gloo, gb_per_s: 1.5, latency_s: 4.0e-05}\n")
    loaded = load_profile(old)
    assert loaded.version == 1 and loaded.cpu_thread is None and loaded.link.allreduce_gb_per_s == 0.0
    assert emulated_device("fp32", profile=loaded, num_ranks=2, cores=2).block_overhead_s is None  # old pricing
    newer = tmp_path / "newer.yaml"
    newer.write_text(old.read_text().replace("version: 1", f"version: {PROFILE_VERSION + 1}"))
    with pytest.raises(ConfigError, match="newer than this heteroflow"):
        load_profile(newer)


def test_a_malformed_cpu_thread_curve_names_its_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("profile:\n  version: 2\n  cpu_thread:\n    attention_tflops: {fp32: [[16, 0.02]]}\n")
    with pytest.raises(ConfigError) as error:
        load_profile(bad)
    assert "profile.cpu_thread.attention_tflops.fp32" in str(error.value)
    assert "[head_dim, forward, backward]" in str(error.value)


def test_curves_interpolate_in_log_size_and_fall_off_below_the_smallest():
    curve = ((16, 1.0, 10.0), (64, 3.0, 30.0))
    assert curve_rate(curve, 32) == pytest.approx(2.0)  # halfway in log(size)
    assert curve_rate(curve, 32, 2) == pytest.approx(20.0)
    assert curve_rate(curve, 8) == pytest.approx(0.5)  # fixed costs dominate small sizes
    assert curve_rate(curve, 1000) == pytest.approx(3.0)


def test_elementwise_traffic_counts_heteroflow_kernels_by_hand():
    # tiny-llama: h 128, 8 heads of 16 (q 128), 4 kv heads (kv 64), SwiGLU f 344, RMSNorm, RoPE.
    # norms 2 x 7h, adds 2 x 3h, contiguous attention output 2q, RoPE 10 (q + kv), act 5f; the fused attention
    # kernel groups query heads over the kv heads without copying them.
    full, act = elementwise_elements(TINY, tp=1, sp=False)
    assert act == 5 * 344
    assert full == 20 * 128 + 2 * 128 + 10 * 192 + 5 * 344 == 6456
    assert elementwise_elements(TINY, tp=2, sp=True)[0] == pytest.approx(full / 2)  # every term splits over tp
    assert elementwise_elements(TINY, tp=2, sp=False)[0] == pytest.approx(full / 2 + 20 * 128 / 2)  # norms, adds whole
    gpt = ModelSpec(num_layers=1, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_kv_heads=4,
                    vocab_size=100, seq_length=16, activation="gelu", normalization="layernorm",
                    position_embedding="learned")
    assert elementwise_elements(gpt, tp=1, sp=False) == (2 * 2 * 64 + 6 * 64 + 2 * 64 + 2 * 256, 2 * 256)


def test_the_emulated_thread_count_is_the_launchers():
    assert launcher_threads is threads_per_process  # one rule: the launcher uses the planner's


def test_an_emulated_rank_gets_its_threads_times_one_thread_rates():
    alone = emulated_device("fp32", profile=_profile(cores=8), num_ranks=2, cores=8)  # 4 threads each
    crowded = emulated_device("fp32", profile=_profile(cores=8), num_ranks=16, cores=8)  # 1 thread each
    assert alone.share == 4.0 and crowded.share == 1.0  # no reference block: rates as measured alone
    assert alone.gemm_tflops(1024) == pytest.approx(4 * 0.15)
    assert crowded.hbm_gb_per_s == pytest.approx(20.0) and alone.hbm_gb_per_s == pytest.approx(80.0)
    assert crowded.attention_rates(16) == pytest.approx((0.02, 0.01))
    layer = layer_forward(TINY, crowded, tokens=512, tp=1, sp=False, dtype_bytes=4)
    assert (layer.overhead_s, layer.overhead_backward_s) == (4e-4, 6e-4)  # measured, not per-kernel guesses
    attn_flops = 2.0 * 512 * 128 * 8 * 16
    assert layer.attention_s == pytest.approx(attn_flops / 0.02e12)
    assert layer.attention_backward_s == pytest.approx(attn_flops / 0.01e12)


def test_the_reference_block_scales_the_rates_to_what_a_real_block_ran():
    one = emulated_device("fp32", profile=_profile(), num_ranks=2, cores=2)  # no reference: slowdown 1
    spec = ModelSpec(num_layers=1, vocab_size=16, **{k: v for k, v in REFERENCE.items() if k != "micro_batch_size"})
    lc = layer_forward(spec, one, tokens=3 * 128, tp=1, sp=False, dtype_bytes=4)
    kernels_f = lc.gemm_s + lc.attention_s + lc.elementwise_s
    # Its backward also adds the fp32 parameters' gradients into the runtime's fp32 buffer.
    accumulate = grad_accumulate_s(layer_params_per_rank(spec, 1), one, weight_bytes=4)
    kernels_b = 2 * lc.gemm_s + lc.attention_backward_s + 2 * lc.elementwise_s + accumulate
    # The real block took twice the kernels' predicted time, plus the fixed overhead.
    measured = (2 * kernels_f + lc.overhead_s, 2 * kernels_b + lc.overhead_backward_s)
    thread = _thread(reference_block_shape=dict(REFERENCE), reference_block_s={"fp32": measured})
    assert in_block_slowdown(one, thread, "fp32") == pytest.approx(2.0)
    slowed = emulated_device("fp32", profile=_profile(thread=thread), num_ranks=2, cores=2)
    assert slowed.share == pytest.approx(0.5) and slowed.hbm_gb_per_s == pytest.approx(10.0)
    again = layer_forward(spec, slowed, tokens=3 * 128, tp=1, sp=False, dtype_bytes=4)
    assert again.gemm_s + again.attention_s + again.elementwise_s == pytest.approx(2 * kernels_f)
    assert in_block_slowdown(one, _thread(), "fp32") == 1.0


def test_without_cpu_thread_each_thread_gets_its_share_of_the_whole_machine():
    profile = replace(_profile(cores=2), cpu_thread=None)
    alone = emulated_device("fp32", profile=profile, num_ranks=1, cores=2)  # 2 threads: the whole machine
    crowded = emulated_device("fp32", profile=profile, num_ranks=8, cores=2)  # 1 thread: half of it
    assert alone.gemm_tflops(1024) == pytest.approx(0.2)
    assert crowded.gemm_tflops(1024) == pytest.approx(0.1)
    assert crowded.vendor == "cpu"


def test_ranks_beyond_the_cores_share_them():
    two = _job([{"devices": ["gpu-0:0"], "layers": 4}, {"devices": ["npu-0:0"], "layers": 4}])
    eight = _job([{"devices": ["gpu-0"], "layers": 4, "tp": 4}, {"devices": ["npu-0"], "layers": 4, "dp": 4}])
    for job in (two, eight):
        small = evaluate_plan(job, job.plan, profile=_profile(cores=2), emulate=True)
        big = evaluate_plan(job, job.plan, profile=_profile(cores=64), emulate=True)
        m = small.num_micro_batches
        # the computing of every rank's thread, done by two cores (transfers and collectives block without one)
        work = sum(s.num_devices * (m * (s.forward_s + s.backward_s - s.recv_forward_s - s.recv_backward_s)
                                    - s.times.collective_s - s.times.alltoall_s) for s in small.stages)
        assert small.pipeline_time_s >= work / 2 * (1 - 1e-9)
        assert small.step_time_s >= big.step_time_s
    # 2 ranks on 2 cores: nothing to share, the closed form's pipeline
    alone = evaluate_plan(two, two.plan, profile=_profile(cores=2), emulate=True)
    from heteroflow.stagemap.pipeline import pipeline_time
    assert alone.pipeline_time_s == pytest.approx(pipeline_time([s.forward_s for s in alone.stages],
                                                                [s.backward_s for s in alone.stages], 4, "1f1b"))


def test_measured_all_reduces_price_the_collectives_and_only_them():
    p2p_only = LinkProfile(backend="gloo", gb_per_s=2.0, latency_s=5e-5)
    measured = replace(p2p_only, allreduce_gb_per_s=0.5, allreduce_latency_s=2e-4)  # slower than point to point
    costs = {}
    for name, link in (("p2p", p2p_only), ("allreduce", measured)):
        dev = emulated_device("fp32", profile=_profile(link=link), num_ranks=4, cores=2)
        hardware = Hardware(models={}, inter_node_gb_per_s=dev.intra_node_gb_per_s, emulate=True)
        hw = StageHardware(device=dev, num_devices=2, num_nodes=1, node_count=2)
        costs[name] = {tp: stage_costs(TINY, hw, ParallelLayout(tp=tp, dp=2 // tp), 4, hardware) for tp in (1, 2)}
        assert dev.collective_link() == ((0.5, 2e-4) if name == "allreduce" else (2.0, 5e-5))
    assert costs["allreduce"][2].fwd_layer_s > costs["p2p"][2].fwd_layer_s  # tp all-reduces cost more
    assert costs["allreduce"][1].fwd_layer_s == costs["p2p"][1].fwd_layer_s  # no collective in a tp1 layer
    assert costs["allreduce"][1].tail_s(4, False, False) > costs["p2p"][1].tail_s(4, False, False)  # dp reduction


def test_the_device_optimizer_streams_heteroflows_adamw_traffic():
    dev = emulated_device("fp32", profile=_profile(), num_ranks=1, cores=1)
    hardware = Hardware(models={}, inter_node_gb_per_s=dev.intra_node_gb_per_s, emulate=True)
    hw = StageHardware(device=dev, num_devices=1, num_nodes=1, node_count=1)
    c = stage_costs(TINY, hw, ParallelLayout(), 4, hardware)
    assert c.tail_per_param_s == pytest.approx((FLAT_BUFFER_BYTES_PER_PARAM + DEVICE_ADAM_BYTES_PER_PARAM)
                                               / (dev.hbm_gb_per_s * 1e9))
    assert FLAT_BUFFER_BYTES_PER_PARAM + DEVICE_ADAM_BYTES_PER_PARAM == 124  # vs 28 for a fused AdamW
