"""Sanity of the cost model's parts: FLOPs, efficiency, memory, communication, profiles, emulation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.layout import OffloadSpec, ParallelLayout
from heteroflow.stagemap.comm import all_gather_s, all_reduce_s
from heteroflow.stagemap.compute import layer_forward, model_flops_per_sample
from heteroflow.stagemap.costs import StageHardware, stage_costs, stage_costs_many
from heteroflow.stagemap.emulation import build_hardware
from heteroflow.stagemap.hardware import Hardware, device_model
from heteroflow.stagemap.layout import search_layouts
from heteroflow.stagemap.memory import GIB, activation_bytes, memory_model
from heteroflow.stagemap.profile import DeviceProfile, LinkProfile, Profile

MODEL = PRESETS["llama2-7b"]
A100 = device_model(CATALOG["nvidia-a100-80g"], "bf16")


def _mem(layout: ParallelLayout, layers: int = 8, in_flight: int = 4, tokens: float = 4096.0) -> dict[str, float]:
    return memory_model(MODEL, layout, tokens=tokens, precision="bf16", capacity_gib=80).components(
        layers, in_flight, False, False)


def test_model_flops_match_the_6n_rule_plus_attention():
    n_params = MODEL.num_params()
    per_token = model_flops_per_sample(MODEL) / MODEL.seq_length
    # 6 N for the weights (embedding lookup has no FLOPs, so a bit under), plus 6 * L * s * h for causal attention.
    attention = 6 * MODEL.num_layers * MODEL.seq_length * MODEL.hidden_size
    assert per_token == pytest.approx(6 * (n_params - MODEL.vocab_size * MODEL.hidden_size) + attention, rel=0.01)


def test_small_gemms_run_less_efficiently():
    big = layer_forward(MODEL, A100, tokens=8192, tp=1, sp=False, dtype_bytes=2)
    split = layer_forward(MODEL, A100, tokens=8192, tp=8, sp=False, dtype_bytes=2)
    assert split.gemm_s * 8 > big.gemm_s  # tp 8 slices the matrices: less efficient per FLOP
    assert A100.gemm_tflops(64) < A100.gemm_tflops(512) < A100.gemm_tflops(8192) < A100.peak_tflops


def test_zero_stages_and_tp_divide_training_state():
    base = _mem(ParallelLayout(dp=8))
    z1, z2, z3 = (_mem(ParallelLayout(dp=8, zero=z)) for z in (1, 2, 3))
    assert z1["optimizer"] == pytest.approx(base["optimizer"] / 8)
    # ZeRO 2 keeps the whole fp32 gradient buffer (it accumulates the micro-batches before the reduce-scatter)
    assert z1["gradients"] == z2["gradients"] == base["gradients"]
    # ZeRO-3 as models.zero3 runs it: 16 bytes per parameter over the 8 ranks (the fp32 shard is the master,
    # moments alone are optimizer state), plus the gathered window of two blocks.
    state = ("weights", "gradients", "optimizer")
    assert z3["optimizer"] == pytest.approx(base["optimizer"] * 8 / 12 / 8)
    assert sum(z3[k] for k in state) < sum(base[k] for k in state) / 4
    tp4 = _mem(ParallelLayout(tp=4, dp=2))
    assert tp4["weights"] == pytest.approx(base["weights"] / 4, rel=0.01)
    assert base["optimizer"] == pytest.approx(6 * base["weights"])  # 12 bytes vs 2 per parameter


def test_recompute_and_sequence_parallelism_cut_activations():
    none = activation_bytes(MODEL, tokens=4096, tp=4, sp=False, recompute="none", dtype_bytes=2)
    selective = activation_bytes(MODEL, tokens=4096, tp=4, sp=False, recompute="selective", dtype_bytes=2)
    full = activation_bytes(MODEL, tokens=4096, tp=4, sp=False, recompute="full", dtype_bytes=2)
    with_sp = activation_bytes(MODEL, tokens=4096, tp=4, sp=True, recompute="none", dtype_bytes=2)
    assert full < selective < none
    assert full == 4096 * MODEL.hidden_size * 2
    assert with_sp < none
    # every micro-batch in flight holds its blocks' activations; the rope tables are held once per stage
    one, two, four = (_mem(ParallelLayout(), in_flight=n)["activations"] for n in (1, 2, 4))
    assert four - two == pytest.approx(2 * (two - one))
    assert 2 * one - two == pytest.approx(2 * MODEL.seq_length * MODEL.kv_channels * 2 / GIB)


def test_offload_moves_state_off_the_device():
    base = _mem(ParallelLayout(dp=4, zero=3))
    opt = _mem(ParallelLayout(dp=4, zero=3, offload=OffloadSpec(optimizer="cpu")))
    params = _mem(ParallelLayout(dp=4, zero=3, offload=OffloadSpec(optimizer="ssd", params="ssd")))
    acts = _mem(ParallelLayout(dp=4, zero=3, offload=OffloadSpec(activations="cpu")), in_flight=8)
    assert opt["optimizer"] == 0 and opt["weights"] < base["weights"]  # on the device the fp32 shard is the master
    assert params["weights"] < base["weights"]
    assert acts["activations"] < _mem(ParallelLayout(dp=4, zero=3), in_flight=8)["activations"]


def test_offload_and_recompute_cost_time():
    hw = StageHardware(device=A100, num_devices=8, num_nodes=1, node_count=8)
    hardware = Hardware(models={}, inter_node_gb_per_s=25)
    plain = stage_costs(MODEL, hw, ParallelLayout(dp=8, zero=1), 8, hardware)
    rc = stage_costs(MODEL, hw, ParallelLayout(dp=8, zero=1, recompute="full"), 8, hardware)
    cpu = stage_costs(MODEL, hw, ParallelLayout(dp=8, zero=1, offload=OffloadSpec(optimizer="cpu")), 8, hardware)
    ssd = stage_costs(MODEL, hw, ParallelLayout(dp=8, zero=1, offload=OffloadSpec(optimizer="ssd")), 8, hardware)
    assert rc.backward_s(8, False, False) > plain.backward_s(8, False, False)
    assert rc.forward_s(8, False, False) == plain.forward_s(8, False, False)
    assert plain.tail_s(8, False, False) < cpu.tail_s(8, False, False) < ssd.tail_s(8, False, False)


def test_memory_components_add_up_and_batched_costing_agrees():
    hw = StageHardware(device=A100, num_devices=8, num_nodes=2, node_count=4)
    hardware = Hardware(models={}, inter_node_gb_per_s=25)
    layouts = search_layouts(MODEL, num_devices=8, node_count=4, micro_batch_size=8)
    for lay, batched in zip(layouts, stage_costs_many(MODEL, hw, layouts, 8, hardware)):
        single = stage_costs(MODEL, hw, lay, 8, hardware)
        assert batched.memory_bytes(5, 3, True, False) == pytest.approx(single.memory_bytes(5, 3, True, False))
        assert sum(single.memory.components(5, 3, True, False).values()) * GIB == pytest.approx(
            single.memory_bytes(5, 3, True, False))
        assert batched.backward_s(5, False, True) == pytest.approx(single.backward_s(5, False, True))


def test_collectives_follow_the_ring_formulas():
    assert all_reduce_s(1e9, 1, 100, 1e-5) == 0.0
    assert all_reduce_s(1e9, 4, 100, 0.0) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9)
    assert all_gather_s(1e9, 8, 50, 0.0) == pytest.approx(7 / 8 * 1e9 / 50e9)


def test_a_profile_replaces_catalog_figures():
    measured = DeviceProfile(device_type="nvidia-a100-80g", vendor="nvidia", memory_gb_per_s=1000,
                             gemm_tflops={"bf16": ((512, 100.0), (4096, 200.0))})
    profile = Profile(devices=(measured,), link=LinkProfile(backend="nccl", gb_per_s=42.0, latency_s=2e-5))
    dev = device_model(CATALOG["nvidia-a100-80g"], "bf16", profile)
    assert dev.gemm_tflops(4096) == pytest.approx(200.0)
    assert dev.gemm_tflops(8192) == pytest.approx(200.0)  # clamped at the largest measured size
    assert 100.0 < dev.gemm_tflops(1024) < 200.0  # interpolated in log(size)
    assert dev.hbm_gb_per_s == 1000 and dev.intra_node_gb_per_s == 42.0
    other = device_model(CATALOG["ascend-910b2"], "bf16", profile)  # not profiled: catalog figures
    assert other.intra_node_gb_per_s == CATALOG["ascend-910b2"].intra_node_gb_per_s


def test_emulation_prices_every_rank_as_its_threads_share_of_the_host():
    types = {name: CATALOG[name] for name in ("nvidia-a100-80g", "ascend-910b2")}
    alone = build_hardware(types, 25.0, emulate=True, num_ranks=1, cores=2)
    eight = build_hardware(types, 25.0, emulate=True, num_ranks=8, cores=2)
    a, b = alone.device("nvidia-a100-80g", "fp32"), eight.device("ascend-910b2", "fp32")
    assert a.peak_tflops == b.peak_tflops == CATALOG["cpu"].tflops_fp32
    # One rank runs both threads; eight get one thread each (the pipeline simulation shares the two cores).
    assert (alone.threads_per_rank, eight.threads_per_rank, eight.cores) == (2, 1, 2)
    assert b.gemm_tflops(1024) == pytest.approx(a.gemm_tflops(1024) / 2)
    assert b.vendor == "ascend"  # vendor labels still choose the boundary transport in the runtime
    assert replace(b, share=1.0).gemm_tflops(1024) == pytest.approx(a.gemm_tflops(1024))


def test_the_fast_memory_total_equals_the_sum_of_components():
    from heteroflow.stagemap.memory import memory_from_parts, memory_parts, memory_total_from_parts
    for name in ("llama2-7b", "qwen2.5-7b", "gpt3-175b", "tiny-llama"):
        model = PRESETS[name]
        for precision in ("bf16", "fp32"):
            for lay in search_layouts(model, num_devices=8, node_count=8, micro_batch_size=8):
                parts = memory_parts(model, tp=lay.tp, sp=lay.sp, tokens=1234.0, precision=precision, capacity_gib=64)
                assert tuple(memory_total_from_parts(parts, lay)) == pytest.approx(
                    tuple(memory_from_parts(parts, lay).total()))
