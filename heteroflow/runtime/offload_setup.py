"""A stage's `offload:` settings turned into offload objects on its ranks: the policy, where swap files go,
and the stage's `OffloadedAdamW` or, under ZeRO-3, `Zero3OffloadAdamW` (the optimizers live in
`heteroflow.offload.stage_optimizer` and `heteroflow.offload.zero3`).

The launcher checks the same swap root for room before any worker starts (`heteroflow.launcher.swap`).
"""

from __future__ import annotations

from dataclasses import replace

from heteroflow.backends import ProcessGroups
from heteroflow.config import JobConfig, StageSpec
from heteroflow.devices.facade import Device
from heteroflow.models.llama import StageModel
from heteroflow.offload.policy import OffloadPolicy, default_swap_root
from heteroflow.offload.stage_optimizer import OffloadedAdamW
from heteroflow.offload.zero3 import Zero3OffloadAdamW


def checkpoint_dirs(job: JobConfig) -> list[str]:
    """Directories swap files must stay out of."""
    return [job.resolve_path(job.train.checkpoint.dir)] if job.train.checkpoint else []


def swap_root(job: JobConfig) -> str:
    """The directory under which SSD-tier ranks make their swap directories."""
    return default_swap_root(job.resolve_path(job.train.offload_dir) if job.train.offload_dir else None)


def stage_policy(job: JobConfig, stage: StageSpec, *, dry_run: bool = False) -> OffloadPolicy:
    """The offload policy of every rank of `stage`: its tiers, its device budget and the swap root. A dry run
    (tensors without storage, nothing to write) lays an SSD tier out on the host instead: the same chunks and
    bytes, no swap files."""
    policy = OffloadPolicy.from_stage(stage, cluster=job.cluster, swap_root=swap_root(job))
    if not dry_run:
        return policy
    return replace(policy, **{tier: "cpu" for tier in ("optimizer", "params") if getattr(policy, tier) == "ssd"})


def offloaded_optimizer(model: StageModel, *, job: JobConfig, stage: StageSpec, groups: ProcessGroups,
                        device: Device, dry_run: bool = False) -> OffloadedAdamW:
    """The optimizer of this rank of a ZeRO 0-2 stage with offloaded optimizer state or parameters."""
    t = job.train
    return OffloadedAdamW(model, policy=stage_policy(job, stage, dry_run=dry_run), device=device, dp_group=groups.dp,
                          tp_group=groups.tp, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                          weight_decay=t.weight_decay, checkpoint_dirs=checkpoint_dirs(job),
                          swap_label=swap_label(groups), zero=stage.layout.zero)


def zero3_offloaded_optimizer(model: StageModel, units: list, *, job: JobConfig, stage: StageSpec,
                              groups: ProcessGroups, device: Device, dry_run: bool = False) -> Zero3OffloadAdamW:
    """The optimizer of this rank of a ZeRO-3 stage with offloaded optimizer state or parameters (ZeRO-Infinity);
    `units` as `shard_stage_zero3` returned them."""
    t = job.train
    return Zero3OffloadAdamW(model, units=units, policy=stage_policy(job, stage, dry_run=dry_run), device=device,
                             dp_group=groups.replicas, tp_group=groups.tp, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_eps, weight_decay=t.weight_decay, checkpoint_dirs=checkpoint_dirs(job),
                             swap_label=swap_label(groups))


def swap_label(groups: ProcessGroups) -> str:
    """`s<stage>-dp<i>-cp<k>-tp<j>`: whose swap directory it is (every rank has its own, where a tp rank keeps
    its shards)."""
    info = groups.rank_map.info(groups.rank)
    return f"s{info.stage}-dp{info.dp}-cp{info.cp}-tp{info.tp}"
