"""Pricing a job's devices, emulated or not: `build_hardware`, and the emulated CPU rank.

Emulation (`emulate=True`): every device is priced as one local CPU process with the threads the launcher
gives it (`threads_per_process`: the host's cores split between the ranks, at least one each), as if it ran
alone. With the profile's `cpu_thread`: one thread's GEMM and attention rates and elementwise rate, times
what that many threads measured on the real block (`emulation.thread_speedup`; else the thread count),
divided by `in_block_slowdown` (how much slower the measured real block ran than those rates predict), plus
the measured per-block overhead. Without it: the measured or catalog whole-machine
rates, split evenly between the cores. The ranks then share the cores: the pipeline is timed by
`pipeline.simulate_shared` (processor sharing, slowed by the profile's measured oversubscription), not by the
closed form. With a profile each rank gets 1/num_ranks of the host memory; every link is the measured local
link, and each collective's ring step and each stage boundary transfer waits what the profile's `emulation`
section measured between busy processes at the step's mean computing processes per core (`estimate.evaluate_plan`
prices an emulated plan again at the load its own timeline shows), not the idle link's latency. Each end of a
stage boundary transfer also takes core time (`boundary_cpu_s`: gloo's threads, system calls and wake-ups,
measured at the plan's processes per core), priced as computing in the stage's forward and backward.
"""

from __future__ import annotations

from dataclasses import replace

from heteroflow.config.catalog import CATALOG
from heteroflow.config.device import DeviceSpec
from heteroflow.config.model import ModelSpec
from heteroflow.layout import PRECISIONS
from heteroflow.layout.shards import layer_params_per_rank
from heteroflow.stagemap.calibration import Calibration, apply_factors
from heteroflow.stagemap.compute import grad_accumulate_s, layer_forward
from heteroflow.stagemap.hardware import DeviceModel, Hardware, apply_measurements, device_model, threads_per_process
from heteroflow.stagemap.memory import dtype_bytes
from heteroflow.stagemap.profile import (REFERENCE_SHAPE_KEYS, DeviceProfile, Profile, ThreadProfile, per_core_value,
                                         thread_speedup)


def build_hardware(device_types: dict[str, DeviceSpec], inter_node_gb_per_s: float, *,
                   profile: Profile | None = None, emulate: bool = False, num_ranks: int = 1,
                   cores: int = 1, calibration: Calibration | None = None,
                   busy_per_core: float | None = None) -> Hardware:
    """Device models for every device type of a cluster, one per precision it can train in
    (`DeviceSpec.supports`; a stage is priced at its own precision). Emulated: `num_ranks` local processes on a
    host with `cores` cores, each device type priced as the local CPU computing in that precision, its
    transfers waiting as at `busy_per_core` computing processes per core (default: the ranks per core). A
    `calibration` fitted in the same mode (emulated or not) scales each device type's rates."""
    models: dict[str, dict[str, DeviceModel]] = {}
    if calibration is not None and not calibration.applies(emulate=emulate):
        calibration = None
    if not emulate:
        for name, spec in device_types.items():
            found = {p: m for p in PRECISIONS if spec.supports(p) and (m := device_model(spec, p, profile)) is not None}
            if found:
                models[name] = _calibrated(found, name, calibration)
        return Hardware(models=models, inter_node_gb_per_s=inter_node_gb_per_s)
    threads = threads_per_process(cores, num_ranks)
    local: dict[str, DeviceModel] = {}
    for name, spec in device_types.items():
        for p in PRECISIONS:
            if spec.supports(p):
                if p not in local:
                    local[p] = emulated_device(p, profile=profile, num_ranks=num_ranks, cores=cores,
                                               busy_per_core=busy_per_core)
                models.setdefault(name, {})[p] = replace(local[p], name=name, vendor=spec.vendor)
    models = {name: _calibrated(found, name, calibration) for name, found in models.items()}
    link = local.get("fp32") or emulated_device("fp32", profile=profile, num_ranks=num_ranks, cores=cores,
                                                busy_per_core=busy_per_core)
    measured = profile.emulation if profile is not None else None
    transfer_cpu = (per_core_value(measured.transfer_cpu_s, max(1, num_ranks) * threads / max(1, cores))
                    if measured is not None and measured.transfer_cpu_s else 0.0)
    return Hardware(models=models, inter_node_gb_per_s=link.intra_node_gb_per_s,
                    inter_latency_s=link.intra_latency_s, emulate=True, cores=max(1, cores),
                    threads_per_rank=threads,
                    oversubscribed_slowdown=measured.oversubscribed_slowdown if measured is not None else (),
                    transfer_cpu_s=transfer_cpu)


def boundary_cpu_s(transfer_cpu_s: float, stage: int, num_stages: int) -> float:
    """Core seconds each forward (and each backward) of emulated stage `stage` spends in its boundary transfers:
    a receive from the stage before and a send to the one after (the other way round backward), each end
    `transfer_cpu_s` (`Hardware.transfer_cpu_s`; 0 unless emulated). The waits' wall time is priced apart; this
    is the part of them that occupies a core the ranks share (`pipeline.run_shared` shares it like computing)."""
    ends = (stage > 0) + (stage < num_stages - 1)
    return ends * transfer_cpu_s


def _calibrated(models: dict[str, DeviceModel], name: str,
                calibration: Calibration | None) -> dict[str, DeviceModel]:
    if calibration is None:
        return models
    return {p: apply_factors(m, calibration.for_device(name)) for p, m in models.items()}


def emulated_device(precision: str, *, profile: Profile | None, num_ranks: int, cores: int,
                    busy_per_core: float | None = None) -> DeviceModel:
    """One of `num_ranks` local CPU processes on a `cores`-core host, as if it ran alone with its threads
    (sharing the cores with the other ranks is left to the pipeline simulation); its transfers wait as the
    profile measured at `busy_per_core` computing processes per core (default: `num_ranks / cores`)."""
    base = device_model(CATALOG["cpu"], precision)
    assert base is not None
    ranks, cores = max(1, num_ranks), max(1, cores)
    threads = threads_per_process(cores, ranks)
    memory_gib = base.memory_gib
    base = replace(base, host_memory_gb_per_s=base.hbm_gb_per_s)  # CPU Adam runs on the same cores
    if profile is not None and profile.devices:
        measured = profile.device("cpu") or profile.devices[0]
        base = apply_measurements(replace(base, measured=measured), measured, profile)
    if profile is not None and profile.host.memory_gib:
        memory_gib = profile.host.memory_gib / ranks  # the ranks share the host's memory
    busy = profile.emulation if profile is not None else None
    if busy is not None and busy.busy_latency_s:  # blocking transfers wait as a training step meets them
        gb_per_s, _ = base.collective_link()
        latency = per_core_value(busy.busy_latency_s, ranks / cores if busy_per_core is None else busy_per_core)
        base = replace(base, collective_gb_per_s=gb_per_s, collective_latency_s=latency, intra_latency_s=latency)
    thread = profile.cpu_thread if profile is not None else None
    if thread is not None and thread.gemm_tflops.get(precision) and thread.elementwise_gb_per_s > 0:
        gemm = thread.gemm_tflops[precision]
        overhead = ((thread.block_forward_overhead_s, thread.block_backward_overhead_s)
                    if thread.block_forward_overhead_s > 0 and thread.block_backward_overhead_s > 0 else None)
        tp_overhead = busy.tp_block_overhead_s if busy is not None and busy.tp_block_overhead_s else (0.0, 0.0)
        one = replace(base, memory_gib=memory_gib, share=1.0, tp_block_overhead_s=tp_overhead,
                      measured=DeviceProfile(device_type="cpu", vendor="cpu", gemm_tflops={precision: gemm}),
                      peak_tflops=max(r for _, r in gemm), hbm_gb_per_s=thread.elementwise_gb_per_s,
                      attention_tflops=thread.attention_tflops.get(precision, ()), block_overhead_s=overhead)
        # One thread's rates times what the rank's threads measured on the real block, at the in-block level.
        speed = thread_speedup(busy, threads) / in_block_slowdown(one, thread, precision)
        bandwidth = thread.elementwise_gb_per_s * speed
        return replace(one, share=speed, hbm_gb_per_s=bandwidth, host_link_gb_per_s=bandwidth,
                       host_memory_gb_per_s=bandwidth)
    # Whole-machine rates (measured, or the catalog's): each thread gets 1/cores of them.
    fraction = threads / cores
    return replace(base, memory_gib=memory_gib, share=fraction,
                   hbm_gb_per_s=base.hbm_gb_per_s * fraction, host_link_gb_per_s=base.hbm_gb_per_s * fraction,
                   host_memory_gb_per_s=base.host_memory_gb_per_s * fraction)


def in_block_slowdown(one_thread: DeviceModel, thread: ThreadProfile, precision: str) -> float:
    """How much slower the kernels of heteroflow's real block ran than `one_thread`'s rates (from the curves)
    predict, at the profile's reference shape: measured block time less the fixed per-block overhead, over
    the predicted GEMM, attention, elementwise and gradient-accumulation time. Kernels timed alone reuse warm
    buffers; inside a training step they also touch fresh activations and miss caches. 1.0 when the profile has
    no reference."""
    measured = thread.reference_block_s.get(precision)
    shape = dict(thread.reference_block_shape)
    if not measured or len(shape) != len(REFERENCE_SHAPE_KEYS):
        return 1.0
    batch = shape.pop("micro_batch_size")
    spec = ModelSpec(num_layers=1, vocab_size=16, **shape)
    lc = layer_forward(spec, one_thread, tokens=batch * spec.seq_length, tp=1, sp=False,
                       dtype_bytes=dtype_bytes(precision))
    # The reference block's parameters are fp32 (autocast computes in the lower precision) and its backward
    # adds their gradients into a `DataParallelAdamW`'s buffer, as the runtime's does.
    predicted = (3 * lc.gemm_s + lc.attention_s + lc.attention_backward_s + 3 * lc.elementwise_s
                 + grad_accumulate_s(layer_params_per_rank(spec, 1), one_thread, weight_bytes=4))
    kernels = sum(measured) - lc.overhead_s - lc.overhead_backward_s
    return kernels / predicted if kernels > 0 and predicted > 0 else 1.0
