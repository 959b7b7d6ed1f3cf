"""Human-readable summaries of a validated job."""

from __future__ import annotations

from heteroflow.config.job import JobConfig


def human_count(n: float) -> str:
    """1.2e9 -> '1.20 B', 3.4e6 -> '3.40 M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return str(int(n))


def summarize_job(job: JobConfig) -> str:
    """A few lines: the cluster by device type, the model size, the batch and the plan."""
    by_type: dict[str, int] = {}
    for node in job.cluster.nodes:
        by_type[node.device] = by_type.get(node.device, 0) + node.count
    devices = ", ".join(f"{n} x {t} ({job.cluster.device_types[t].vendor})" for t, n in by_type.items())
    m, t = job.model, job.train
    lines = [
        f"  cluster: {len(job.cluster.nodes)} nodes, {job.cluster.num_devices} devices: {devices}",
        f"  model:   {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.num_kv_heads} kv), seq {m.seq_length}, {human_count(m.num_params())} parameters",
        f"  train:   global batch {t.global_batch_size}, {t.precision}, {t.steps} steps, lr {t.lr:g}"
        + (f", loss scale {t.loss_scale if isinstance(t.loss_scale, str) else format(t.loss_scale, 'g')}"
           if t.loss_scale is not None else ""),
    ]
    if job.plan is None:
        lines.append("  plan:    auto (run `heteroflow plan` to see it)")
    else:
        lines.append(f"  plan:    {len(job.plan.stages)} stages, {job.plan.schedule}, micro-batch "
                     f"{job.plan.micro_batch_size}, {job.plan.num_devices} of {job.cluster.num_devices} devices")
        for k, (stage, (first, last)) in enumerate(zip(job.plan.stages, job.plan.layer_ranges())):
            lines.append(f"    stage {k}: {stage.num_devices} x {stage.device_type}, layers {first}-{last - 1}, "
                         f"tp {stage.layout.tp} dp {stage.layout.dp}" + (" sp" if stage.layout.sp else "")
                         + (f" zero{stage.layout.zero}" if stage.layout.zero else "")
                         + (f" recompute={stage.layout.recompute}" if stage.layout.recompute != "none" else "")
                         + (f" offload={stage.layout.offload.to_dict()}" if stage.layout.offload.any else "")
                         + (f" {stage.layout.precision}" if stage.layout.precision else ""))
    return "\n".join(lines)
