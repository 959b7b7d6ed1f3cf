"""`evaluate_plan`: price one explicit plan with the cost model; `PlanEstimate`: the figures per stage.

Each stage is priced at its own precision: its `precision`, else the job's `train.precision`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from heteroflow.config.job import JobConfig
from heteroflow.config.plan import PlanSpec, StageSpec
from heteroflow.layout import GRAD_REDUCE_BYTES, OffloadSpec
from heteroflow.errors import UserError
from heteroflow.config.catalog import CATALOG
from heteroflow.stagemap.calibration import Calibration, load_calibration
from heteroflow.stagemap.comm import boundary_s, tied_sync_s
from heteroflow.stagemap.compute import model_flops_per_sample
from heteroflow.stagemap.costs import StageCosts, StageHardware, stage_costs
from heteroflow.layout import ParallelLayout
from heteroflow.stagemap.emulation import boundary_cpu_s, build_hardware
from heteroflow.stagemap.hardware import Hardware
from heteroflow.stagemap.memory import GIB, dtype_bytes
from heteroflow.stagemap.breakdown import StageTimes, step_breakdown
from heteroflow.stagemap.pipeline import in_flight
from heteroflow.stagemap.profile import Profile, load_profile


@dataclass(frozen=True, kw_only=True, slots=True)
class StageEstimate:
    """Predicted figures of one stage (times per micro-batch, memory per device)."""

    index: int
    devices: tuple[str, ...]
    device_type: str
    num_devices: int
    layers: tuple[int, int]
    """[first, last_exclusive)."""
    layout: ParallelLayout
    precision: str
    """The precision the stage computes in (its layout's, else `train.precision`)."""
    forward_s: float
    """Forward of one micro-batch, including receiving its input from the previous stage."""
    backward_s: float
    """Backward of one micro-batch, including receiving the gradient from the next stage."""
    recv_forward_s: float
    recv_backward_s: float
    tail_s: float
    """Gradient reduction, parameter gather and optimizer step after the flush."""
    in_flight: int
    memory_peak_gib: float
    memory_capacity_gib: float
    memory_gib: dict[str, float] = field(hash=False)
    times: StageTimes | None = None
    """This stage's share of the step time by part (`breakdown.step_breakdown`); set by `assemble`."""

    @property
    def fits(self) -> bool:
        return self.memory_peak_gib <= self.memory_capacity_gib

    def to_json(self) -> dict:
        """Contract keys plus the layout and per-micro-batch times."""
        lay = self.layout
        return {"devices": list(self.devices), "device_type": self.device_type, "num_devices": self.num_devices,
                "layers": list(self.layers), "tp": lay.tp, "dp": lay.dp, "cp": lay.cp, "sp": lay.sp,
                "zero": lay.zero, "recompute": lay.recompute, "offload": lay.offload.to_dict(),
                "precision": self.precision, "ep": lay.ep, "etp": lay.expert_tp,
                "memory_peak_gib": round(self.memory_peak_gib, 3),
                "memory_capacity_gib": round(self.memory_capacity_gib, 3),
                "memory_gib": {k: round(v, 3) for k, v in self.memory_gib.items()},
                "forward_s": self.forward_s, "backward_s": self.backward_s,
                "recv_forward_s": self.recv_forward_s, "recv_backward_s": self.recv_backward_s,
                "tail_s": self.tail_s, "in_flight": self.in_flight, "fits": self.fits,
                **({"step_parts_s": self.times.to_dict()} if self.times is not None else {})}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEstimate:
    """What the cost model predicts for one plan."""

    plan: PlanSpec
    stages: tuple[StageEstimate, ...]
    num_micro_batches: int
    pipeline_time_s: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    problems: tuple[str, ...] = ()
    emulate: bool = False
    calibration: dict | None = field(default=None, hash=False)
    """`Calibration.note` of the calibration the estimate was asked to use (None: uncalibrated)."""

    @property
    def feasible(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        """The plan JSON of the CLI contract (without search fields)."""
        out = {"feasible": self.feasible, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
               "mfu": self.mfu, "bubble_fraction": self.bubble_fraction, "pipeline_time_s": self.pipeline_time_s,
               "schedule": self.plan.schedule, "micro_batch_size": self.plan.micro_batch_size,
               "num_micro_batches": self.num_micro_batches, "num_devices": self.plan.num_devices,
               "stages": [s.to_json() for s in self.stages]}
        if self.problems:
            out["problems"] = list(self.problems)
        if self.emulate:
            out["emulate"] = True
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        return out

    def predicted(self) -> dict:
        """The `predicted` mapping written next to a plan by `plan -o`."""
        return {"step_time_s": float(f"{self.step_time_s:.6g}"), "tokens_per_s": float(f"{self.tokens_per_s:.6g}"),
                "mfu": round(self.mfu, 4), "bubble_fraction": round(self.bubble_fraction, 4),
                "memory_peak_gib": [round(s.memory_peak_gib, 2) for s in self.stages]}


def resolve_profile(job: JobConfig, profile: Profile | None) -> Profile | None:
    """`profile` if given, else the job's `cluster.profile` file (relative to the job file), else None."""
    if profile is not None or not job.cluster.profile:
        return profile
    return load_profile(job.resolve_path(job.cluster.profile))


def resolve_calibration(job: JobConfig, calibration: Calibration | None) -> Calibration | None:
    """`calibration` if given, else the job's `cluster.calibration` file (relative to the job file), else None.
    A calibration with no runs (`UNCALIBRATED`) means none, whatever the job names."""
    if calibration is None and job.cluster.calibration:
        calibration = load_calibration(job.resolve_path(job.cluster.calibration),
                                       device_types=[*job.cluster.device_types, *CATALOG])
    return calibration if calibration is not None and calibration.num_runs > 0 else None


UNCALIBRATED = Calibration(factors={}, num_runs=0)
"""Pass as `calibration=` to price with the uncalibrated model even when the job names a calibration."""


def job_hardware(job: JobConfig, profile: Profile | None, *, emulate: bool = False, num_ranks: int = 1,
                 calibration: Calibration | None = None, busy_per_core: float | None = None) -> Hardware:
    """Device models of the job's cluster, per precision (emulated: `num_ranks` processes on the profiled
    host, or on this machine when there is no profile, their transfers waiting as at `busy_per_core`
    computing processes per core), scaled by `calibration` (already resolved)."""
    cores = profile.host.cpu_cores if profile is not None else (os.cpu_count() or 1)
    return build_hardware(job.cluster.device_types, job.cluster.inter_node_gb_per_s,
                          profile=profile, emulate=emulate, num_ranks=num_ranks, cores=cores,
                          calibration=calibration, busy_per_core=busy_per_core)


def stage_hardware(job: JobConfig, hardware: Hardware, stage: StageSpec) -> tuple[StageHardware, frozenset[str]]:
    """The shape of an explicit stage's devices (modelled in the stage's precision), and the nodes they are on."""
    precision = stage.layout.compute_precision(job.train.precision)
    device = hardware.device(stage.device_type, precision)
    if device is None:
        raise UserError(f"device type {stage.device_type!r} cannot train in {precision}")
    nodes = frozenset(r.node for r in stage.device_refs)
    ordinal = {n: k for k, n in enumerate(dict.fromkeys(r.node for r in stage.device_refs))}
    return StageHardware(device=device, num_devices=stage.num_devices, num_nodes=len(nodes),
                         node_count=max(job.cluster.node(n).count for n in nodes),
                         placement=tuple((ordinal[r.node], r.index) for r in stage.device_refs)), nodes


def evaluate_plan(job: JobConfig, plan: PlanSpec, *, profile: Profile | None = None,
                  emulate: bool = False, calibration: Calibration | None = None) -> PlanEstimate:
    """Estimate `plan` for `job`. Stages that do not fit in memory are reported in `problems`.

    `emulate=True` prices the run `heteroflow train --emulate` would do: every rank a local CPU process
    (priced from the profile's `cpu_thread`, else the profiled local device or the catalog `cpu` entry), all
    ranks sharing the host's cores.
    `calibration` (default: the job's `cluster.calibration`; `UNCALIBRATED`: none) scales the device rates
    when it was fitted in the same mode (emulated or not); the estimate says which calibration it was given.
    """
    profile = resolve_profile(job, profile)
    calibration = resolve_calibration(job, calibration)
    estimate, hardware = _priced(job, plan, profile, emulate, calibration, None)
    if emulate and profile is not None and profile.emulation is not None and len(profile.emulation.busy_latency_s) > 1:
        # A blocked transfer waits longer the more processes compute on each core, which the step's own
        # timeline says: price again with the waits at its mean computing load until that settles.
        for _ in range(LOAD_ITERATIONS):
            load = computing_per_core(estimate, hardware.cores, hardware.threads_per_rank)
            previous = estimate
            estimate, hardware = _priced(job, plan, profile, emulate, calibration, load)
            if abs(estimate.step_time_s - previous.step_time_s) <= 1e-3 * previous.step_time_s:
                break
    return replace(estimate, calibration=calibration.note(emulate=emulate) if calibration is not None else None)


LOAD_ITERATIONS = 4
"""Re-pricings of an emulated plan at its own computing load (it settles in two or three)."""


def computing_per_core(estimate: PlanEstimate, cores: int, threads_per_rank: int) -> float:
    """Threads computing per core, averaged over an emulated step: each stage's ranks' threads times the share
    of the step they compute (forward, backward, optimizer), over the host's cores."""
    threads = sum(st.num_devices * threads_per_rank * (st.times.forward_s + st.times.backward_s + st.times.optimizer_s)
                  for st in estimate.stages)
    return threads / (estimate.step_time_s * cores) if estimate.step_time_s > 0 else 0.0


def _priced(job: JobConfig, plan: PlanSpec, profile: Profile | None, emulate: bool,
            calibration: Calibration | None, busy_per_core: float | None) -> tuple[PlanEstimate, Hardware]:
    """The plan priced on the job's hardware (emulated ranks' transfers waiting as at `busy_per_core`), and that
    hardware."""
    hardware = job_hardware(job, profile, emulate=emulate, num_ranks=plan.num_devices, calibration=calibration,
                            busy_per_core=busy_per_core)
    placed = [stage_hardware(job, hardware, s) for s in plan.stages]
    hws = [hw for hw, _ in placed]
    costs = [stage_costs(job.model, hw, s.layout, plan.micro_batch_size, hardware) for hw, s in zip(hws, plan.stages)]
    recv = boundary_times(job, hardware, placed, plan.micro_batch_size)
    tied = (tied_sync_s(job.model.vocab_size * job.model.hidden_size * GRAD_REDUCE_BYTES, hardware,
                        first=hws[0].device, last=hws[-1].device, ranks=hws[0].num_devices + hws[-1].num_devices)
            if job.model.tie_embeddings and len(hws) > 1 else 0.0)
    estimate = assemble(job, plan, hws, costs, recv, emulate=emulate, cores=hardware.cores,
                        threads_per_rank=hardware.threads_per_rank, oversubscribed=hardware.oversubscribed_slowdown,
                        tied_s=tied, transfer_cpu_s=hardware.transfer_cpu_s)
    return estimate, hardware


def boundary_times(job: JobConfig, hardware: Hardware, placed: list[tuple[StageHardware, frozenset[str]]],
                   micro_batch_size: int) -> list[float]:
    """One-way transfer time between each pair of neighbouring stages (stage shape, nodes). Between stages of
    different precisions both directions are priced at the element size of the sender of the hidden states
    (the earlier stage), assuming the later stage converts them to its precision on arrival, so that the
    gradient of its input goes back in the dtype the input came in."""
    size = job.model.seq_length * job.model.hidden_size * micro_batch_size
    return [boundary_s(size * dtype_bytes(a.precision), hardware, sender=a.device, receiver=b.device,
                       sender_devices=a.num_devices, receiver_devices=b.num_devices, sender_nodes=na,
                       receiver_nodes=nb)
            for (a, na), (b, nb) in zip(placed, placed[1:])]


def assemble(job: JobConfig, plan: PlanSpec, hws: list[StageHardware], costs: list[StageCosts],
             recv: list[float], *, emulate: bool = False, cores: int = 1, threads_per_rank: int = 1,
             oversubscribed: tuple[tuple[float, float], ...] = (), tied_s: float = 0.0,
             transfer_cpu_s: float = 0.0) -> PlanEstimate:
    """Combine per-stage costs into pipeline, step and memory figures. Emulated, the stages' threads
    (`threads_per_rank` per device) share `cores` cores, slowed by the host's measured `oversubscribed`
    slowdown (`pipeline.sharing_speed`). `tied_s`: the sum of an embedding's gradient tied across the first and
    last stage (`comm.tied_sync_s`), part of both stages' dp reduction (the runtime times it there).
    `transfer_cpu_s`: emulated, the core seconds of one end of a boundary transfer (`emulation.boundary_cpu_s`)."""
    p, m = len(plan.stages), plan.num_micro_batches(job.train)
    stages, problems, parts, recv_fwd, recv_bwd = [], [], [], [], []
    for k, ((first_layer, last_layer), stage, hw, c) in enumerate(zip(plan.layer_ranges(), plan.stages, hws, costs)):
        first, last, layers = k == 0, k == p - 1, stage.layers
        recv_fwd.append(recv[k - 1] if k > 0 else 0.0)
        recv_bwd.append(recv[k] if k < p - 1 else 0.0)
        tied = tied_s if first or last else 0.0
        ends = boundary_cpu_s(transfer_cpu_s, k, p)  # emulated: the transfers' core time, shared like computing
        own = c.parts(layers, first, last)
        parts.append(replace(own, forward_s=own.forward_s + ends, backward_s=own.backward_s + ends,
                             dp_s=own.dp_s + tied))
        f = in_flight(plan.schedule, p, k, m)
        peak = c.memory_bytes(layers, f, first, last) / GIB
        est = StageEstimate(index=k, devices=stage.devices, device_type=stage.device_type,
                            num_devices=stage.num_devices, layers=(first_layer, last_layer), layout=stage.layout,
                            precision=hw.precision,
                            forward_s=c.forward_s(layers, first, last) + ends + recv_fwd[-1],
                            backward_s=c.backward_s(layers, first, last) + ends + recv_bwd[-1],
                            recv_forward_s=recv_fwd[-1], recv_backward_s=recv_bwd[-1],
                            tail_s=c.tail_s(layers, first, last) + tied, in_flight=f, memory_peak_gib=peak,
                            memory_capacity_gib=hw.device.memory_gib,
                            memory_gib=c.memory.components(layers, f, first, last))
        stages.append(est)
        if not est.fits:
            problems.append(memory_problem(job, est, hw, plan, first, last))
    # The step time is the breakdown's: each stage's predicted parts sum to it.
    threads = [hw.num_devices * threads_per_rank for hw in hws]
    breakdown = step_breakdown(parts, recv_fwd, recv_bwd, m, plan.schedule,
                               shared=(threads, cores, oversubscribed) if emulate else None)
    pipe, step = breakdown.pipeline_s, breakdown.step_s
    stages = [replace(est, times=times) for est, times in zip(stages, breakdown.stages)]
    if emulate:
        thread_peak = hws[0].device.peak_tflops * hws[0].device.share / threads_per_rank
        peak_flops = thread_peak * min(cores, sum(threads)) * 1e12
    else:
        peak_flops = sum(hw.device.peak_tflops * hw.device.share * hw.num_devices for hw in hws) * 1e12
    tokens = job.train.global_batch_size * job.model.seq_length
    mfu = model_flops_per_sample(job.model) * job.train.global_batch_size / (step * peak_flops)
    busy = sum(m * (s.forward_s + s.backward_s) for s in stages)
    return PlanEstimate(plan=plan, stages=tuple(stages), num_micro_batches=m, pipeline_time_s=pipe,
                        step_time_s=step, tokens_per_s=tokens / step, mfu=mfu,
                        bubble_fraction=max(0.0, 1.0 - busy / (p * pipe)), problems=tuple(problems), emulate=emulate)


def memory_problem(job: JobConfig, est: StageEstimate, hw: StageHardware, plan: PlanSpec, first: bool,
                   last: bool) -> str:
    """One line: which stage lacks how much memory, where it goes, and which knobs would help."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in est.memory_gib.items())
    short = est.memory_peak_gib - est.memory_capacity_gib
    line = (f"stage {est.index} ({est.num_devices} x {est.device_type}, layers {est.layers[0]}-{est.layers[1] - 1}, "
            f"{est.layout.describe()}): needs {est.memory_peak_gib:.1f} GiB per device but has "
            f"{est.memory_capacity_gib:.1f} GiB (short by {short:.1f} GiB; {parts} GiB)")
    hints = fit_hints(job, est, hw, plan, first, last)
    return line + ("; " + "; ".join(hints) if hints else "")


def fit_hints(job: JobConfig, est: StageEstimate, hw: StageHardware, plan: PlanSpec, first: bool, last: bool) -> list[str]:
    """Single changes of the stage's layout that lower its peak, with the resulting peak."""
    lay = est.layout
    options = []
    if lay.dp > 1 and lay.zero < 3:
        options.append(("zero 3", replace(lay, zero=3)))
    if lay.recompute != "full":
        options.append(("recompute full", replace(lay, recompute="full")))
    if lay.tp > 1 and not lay.sp and job.model.seq_length % lay.tp == 0:
        options.append(("sp", replace(lay, sp=True)))
    if lay.offload.optimizer == "device":
        options.append(("offload optimizer to cpu", replace(lay, offload=replace(lay.offload, optimizer="cpu"))))
    if lay.offload.activations == "device":
        options.append(("offload activations to cpu", replace(lay, offload=replace(lay.offload, activations="cpu"))))
    frugal = replace(lay, zero=3 if lay.dp > 1 else lay.zero, recompute="full", sp=lay.tp > 1 and job.model.seq_length % lay.tp == 0,
                     offload=OffloadSpec(optimizer="cpu", params="cpu", activations="cpu"))
    options.append(("all of these with parameters offloaded too", frugal))
    hardware = Hardware(models={}, inter_node_gb_per_s=job.cluster.inter_node_gb_per_s)
    layers = est.layers[1] - est.layers[0]
    hints = []
    for name, alt in options:
        c = stage_costs(job.model, hw, alt, plan.micro_batch_size, hardware)
        peak = c.memory_bytes(layers, est.in_flight, first, last) / GIB
        if peak < est.memory_peak_gib - 0.05:
            hints.append(f"{name}: {peak:.1f} GiB{' (fits)' if peak <= est.memory_capacity_gib else ''}")
    if not any("(fits)" in h for h in hints):
        per_layer = (est.memory_peak_gib - est.memory_gib["reserve"]) / max(layers, 1)
        if per_layer > 0:
            hints.append("or give it fewer layers (more stages / devices)")
    return hints
