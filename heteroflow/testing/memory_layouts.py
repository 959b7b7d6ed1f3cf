"""Emulated runs of many stage layouts with each rank's measured memory next to the planner's figure.

Shared by `benchmarks/bench_memory.py` and its test: every layout is a plan of micro-llama on four emulated
ranks (two stages of two), trained two steps; the last step record's `memory` key gives, per rank, the measured
bytes and the planner's components for the same rank (reserve left out). One launch of four processes runs
every layout in turn (the world stays; each run creates and destroys its own groups).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

WORLD = 4
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 4}]}
MODEL = {"preset": "micro-llama", "num_layers": 4}
TRAIN = {"global_batch_size": 16, "micro_batch_size": 4, "precision": "bf16", "steps": 2, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 1, "grad_clip": 1.0}


def _two_stages(**layout) -> dict:
    """Both stages (two devices each) with the same layout."""
    return {"schedule": "1f1b", "micro_batch_size": 4, "stages": [
        {"devices": ["gpu-0:0-1"], "layers": 2, **layout}, {"devices": ["gpu-0:2-3"], "layers": 2, **layout}]}


LAYOUTS: dict[str, dict] = {
    "tp2": _two_stages(tp=2),
    "tp2-sp": _two_stages(tp=2, sp=True),
    "dp2": _two_stages(dp=2),
    "dp2-fp32": _two_stages(dp=2, precision="fp32"),
    "dp2-zero1": _two_stages(dp=2, zero=1),
    "dp2-zero2": _two_stages(dp=2, zero=2),
    "dp2-recompute-full": _two_stages(dp=2, recompute="full"),
    "dp2-recompute-selective": _two_stages(dp=2, recompute="selective"),
    "dp2-optimizer-cpu": _two_stages(dp=2, offload={"optimizer": "cpu"}),
    "dp2-optimizer-ssd": _two_stages(dp=2, offload={"optimizer": "ssd"}),
    "dp2-params-cpu": _two_stages(dp=2, offload={"params": "cpu", "optimizer": "cpu"}),
    "dp2-activations-cpu": _two_stages(dp=2, offload={"activations": "cpu"}),
}
"""Name -> plan: tp, sp, dp, ZeRO 1 and 2, full and selective recompute, and each offload tier."""

MOE_MODEL = {**MODEL, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64, "aux_loss_coeff": 0.01}}
MOE_LAYOUTS: dict[str, dict] = {
    "moe-dp2-ep2-zero1": _two_stages(dp=2, ep=2, zero=1),
    "moe-tp2-sp-ep2-etp1": _two_stages(tp=2, sp=True, ep=2, etp=1),
}
"""Name -> plan of a mixture-of-experts micro-llama: experts split over ep (ZeRO over expert-dp), and over ep
across a tp group with whole experts (etp 1)."""
LAYOUTS.update(MOE_LAYOUTS)


def unseen_on_cpu(job, plan, stage: int) -> float:
    """Bytes of plan stage `stage`'s planned peak that exist on a device but that CPU emulation cannot count:
    a recomputed block's tensors (saved under the checkpoint's own hooks, never ours; the stage's rope tables
    too, under full recompute), the CPU activation tier's window (tensors back on the device only inside backward), and offloaded parameters' prefetched block
    (in emulation the host tier is the device: blocks are used in place, never copied ahead)."""
    from heteroflow.stagemap.memory import memory_parts

    layout = plan.stages[stage].layout
    tokens = plan.micro_batch_size / layout.dp * job.model.seq_length / layout.cp
    parts = memory_parts(job.model, tp=layout.tp, sp=layout.sp, tokens=tokens,
                         precision=layout.compute_precision(job.train.precision), capacity_gib=0.0,
                         ep=layout.ep, etp=layout.etp, cp=layout.cp)
    unseen = parts.working[layout.recompute]
    if layout.offload.activations != "device":  # the last stage's head too: its saved tensors went to the host
        unseen += parts.stored[layout.recompute] + (parts.logits if stage == len(plan.stages) - 1 else 0.0)
    if layout.offload.activations != "device" or layout.recompute == "full":
        unseen += parts.tables  # the stage's rope tables, saved only under the tier's or the checkpoint's hooks
    if layout.offload.params != "device":
        unseen += parts.p_layer * parts.wb
    return unseen


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank of one layout: measured and planned bytes by component."""

    layout: str
    rank: int
    stage: int
    measured: dict
    planned: dict
    unseen: float
    """Of the planned peak, what exists on a device but CPU emulation cannot count (`unseen_on_cpu`)."""

    @property
    def ratio(self) -> float:
        """Measured peak over the planner's figure (reserve left out)."""
        return self.measured["peak"] / self.planned["peak"]

    @property
    def seen_ratio(self) -> float:
        """Measured peak over the planner's figure less what the CPU cannot see."""
        return self.measured["peak"] / (self.planned["peak"] - self.unseen)


def _run_layouts(rank: int, world_size: int, names: list[str], work_dir: str) -> list[RankMemory]:
    from heteroflow.config import parse_job
    from heteroflow.runtime.metrics import read_step_records
    from heteroflow.runtime.worker import WorkerArgs, run_worker

    rows: list[RankMemory] = []
    for name in names:
        metrics = os.path.join(work_dir, f"{name}.jsonl")
        job = parse_job({"cluster": CLUSTER, "model": MOE_MODEL if name in MOE_LAYOUTS else MODEL, "plan": LAYOUTS[name],
                         "train": {**TRAIN, "offload_dir": os.path.join(work_dir, "swap")}})
        args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=TRAIN["steps"], show_progress=False,
                          data_dir=os.path.join(work_dir, "data"), metrics_path=metrics, timeout_s=300)
        run_worker(args)
        if rank == 0:
            last = read_step_records(metrics)[-1]["memory"]["ranks"]
            rows += [RankMemory(name, r["rank"], r["stage"], r["measured"], r["planned"],
                                unseen_on_cpu(job, job.plan, r["stage"])) for r in last]
    return rows


def measure_layouts(names: list[str], work_dir: str, *, timeout_s: float = 1200.0) -> list[RankMemory]:
    """Run each named layout in turn on four emulated ranks; every rank's figures of each."""
    from heteroflow.testing.multiproc import run_ranks

    env = {"HETEROFLOW_CPU_ADAM": "torch"}  # no DeepSpeed JIT build in a measurement of bytes
    return run_ranks(_run_layouts, WORLD, names, work_dir, timeout_s=timeout_s, env=env)[0]
