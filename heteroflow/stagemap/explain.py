"""Why a job fits nowhere: per device type, the memory its most frugal stage still needs, and what would help."""

from __future__ import annotations

import itertools
import math

from heteroflow.config.job import JobConfig
from heteroflow.layout import OffloadSpec
from heteroflow.stagemap.costs import StageHardware, stage_costs
from heteroflow.stagemap.hardware import Hardware
from heteroflow.layout import ParallelLayout
from heteroflow.stagemap.layout import expert_choices, tp_choices
from heteroflow.stagemap.memory import GIB
from heteroflow.stagemap.space import layout_precision, stage_precisions


def explain_infeasible(job: JobConfig, hardware: Hardware) -> list[str]:
    """One line per device type: the smallest per-device memory a one-node stage needs for its share of
    the layers (spread over every node of the cluster, micro-batch 1, 1F1B's first stage holding a
    micro-batch per stage in flight), under the best layout without and with offload, against the
    capacity, and what would make it fit. Each device type is priced at the first precision the planner
    tries on it (`stage_precisions`: `train.precision`, or the first its device type supports)."""
    lines = []
    unusable = sorted({n.device for n in job.cluster.nodes} - set(hardware.models))
    if unusable:
        lines.append(f"{', '.join(unusable)} cannot train in any precision (no bf16, fp16 or fp32 rate); give "
                     "them a tflops_ rate in cluster.device_types or remove those nodes")
    usable = [n for n in job.cluster.nodes if n.device in hardware.models]
    if not usable:
        return lines or ["no device of the cluster can train this job"]
    layers, p = job.model.num_layers, min(len(usable), job.model.num_layers)
    share = math.ceil(layers / p)
    seen = set()
    for node in usable:
        key = (node.device, node.count)
        if key in seen:
            continue
        seen.add(key)
        dev = hardware.device(node.device, stage_precisions(job, hardware, node.device)[0])
        hw = StageHardware(device=dev, num_devices=node.count, num_nodes=1, node_count=node.count)
        plain, frugal = _best_peaks(job, hardware, hw, share, p)
        cap = dev.memory_gib
        if plain is not None and plain[0] <= cap:
            continue
        line = (f"{node.device} ({node.count} per node): a stage of one node holding {share} of {layers} layers "
                f"(the model spread over all {p} usable nodes) needs at least ")
        if plain is not None:
            line += f"{plain[0]:.1f} GiB per device without offload ({plain[1].describe()})"
        if frugal is not None:
            line += f"{', and ' if plain is not None else ''}{frugal[0]:.1f} GiB with everything offloaded " \
                    f"({frugal[1].describe()})"
        line += f", but has {cap:.1f} GiB"
        if frugal is not None and frugal[0] <= cap:
            line += " -> it fits with offload; enable offload in the search or in the plan"
        else:
            need = frugal[0] if frugal is not None else float("inf")
            line += f" (short by {need - cap:.1f} GiB even fully offloaded)"
            more = _nodes_needed(job, hardware, hw)
            line += (f"; it would fit with {more} such nodes in the pipeline (more devices), a shorter "
                     "sequence or a smaller model" if more else "; even one layer per stage does not fit: "
                     "use devices with more memory or a shorter sequence")
        lines.append(line)
    if not lines:
        lines.append("every device type can hold its share of the layers, but no combination of stages "
                     "satisfies the divisibility rules (dp must divide the micro-batch, tp the heads)")
    return lines


def _best_peaks(job: JobConfig, hardware: Hardware, hw: StageHardware, layers: int, stages: int):
    """(GiB, layout) of the smallest peak over layouts without offload, and with full offload."""
    plain = frugal = None
    for tp in tp_choices(job.model, hw.num_devices, hw.node_count):
        dp = hw.num_devices // tp
        sp = tp > 1 and job.model.seq_length % tp == 0 and job.model.moe is None  # MoE refuses sp for now
        for (ep, etp), (off, slot) in itertools.product(
                expert_choices(job.model, tp=tp, num_devices=hw.num_devices),
                ((OffloadSpec(), "plain"), (OffloadSpec(optimizer="cpu", params="cpu", activations="cpu"), "frugal"))):
            lay = ParallelLayout(tp=tp, dp=dp, sp=sp, zero=3 if dp > 1 else 0, recompute="full", offload=off,
                                 precision=layout_precision(job, hw.precision), ep=ep, etp=etp)
            c = stage_costs(job.model, hw, lay, dp, hardware)
            peak = c.memory_bytes(layers, min(stages, max(1, job.train.global_batch_size // dp)), True, False) / GIB
            if slot == "plain" and (plain is None or peak < plain[0]):
                plain = (peak, lay)
            if slot == "frugal" and (frugal is None or peak < frugal[0]):
                frugal = (peak, lay)
    return plain, frugal


def _nodes_needed(job: JobConfig, hardware: Hardware, hw: StageHardware) -> int | None:
    """Smallest number of one-node stages of this type whose share of layers fits fully offloaded."""
    for p in range(1, job.model.num_layers + 1):
        _, frugal = _best_peaks(job, hardware, hw, math.ceil(job.model.num_layers / p), p)
        if frugal is not None and frugal[0] <= hw.device.memory_gib:
            return p
    return None
