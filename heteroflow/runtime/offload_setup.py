"""A stage's `offload:` settings turned into offload objects on its ranks: the policy, where swap files go,
and the stage's `OffloadedAdamW` (the optimizer itself lives in `heteroflow.offload.stage_optimizer`).

The launcher checks the same swap root for room before any worker starts (`heteroflow.launcher.swap`).
"""

from __future__ import annotations

from heteroflow.backends import ProcessGroups
from heteroflow.config import JobConfig, StageSpec
from heteroflow.devices.facade import Device
from heteroflow.models.llama import StageModel
from heteroflow.offload.policy import OffloadPolicy, default_swap_root
from heteroflow.offload.stage_optimizer import OffloadedAdamW, check_offload_stage


def checkpoint_dirs(job: JobConfig) -> list[str]:
    """Directories swap files must stay out of."""
    return [job.resolve_path(job.train.checkpoint.dir)] if job.train.checkpoint else []


def swap_root(job: JobConfig) -> str:
    """The directory under which SSD-tier ranks make their swap directories."""
    return default_swap_root(job.resolve_path(job.train.offload_dir) if job.train.offload_dir else None)


def stage_policy(job: JobConfig, stage: StageSpec) -> OffloadPolicy:
    """The offload policy of every rank of `stage`: its tiers, its device budget and the swap root."""
    return OffloadPolicy.from_stage(stage, cluster=job.cluster, swap_root=swap_root(job))


def offloaded_optimizer(model: StageModel, *, job: JobConfig, stage: StageSpec, stage_index: int,
                        groups: ProcessGroups, device: Device) -> OffloadedAdamW:
    """The optimizer of this rank of plan stage `stage_index` (refuses what `check_offload_plan` refuses)."""
    check_offload_stage(stage_index, stage)
    t = job.train
    return OffloadedAdamW(model, policy=stage_policy(job, stage), device=device, dp_group=groups.dp,
                          tp_group=groups.tp, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                          weight_decay=t.weight_decay, checkpoint_dirs=checkpoint_dirs(job),
                          swap_label=swap_label(groups), zero=stage.layout.zero)


def swap_label(groups: ProcessGroups) -> str:
    """`s<stage>-dp<i>-cp<k>-tp<j>`: whose swap directory it is (every rank has its own, where a tp rank keeps
    its shards)."""
    info = groups.rank_map.info(groups.rank)
    return f"s{info.stage}-dp{info.dp}-cp{info.cp}-tp{info.tp}"
