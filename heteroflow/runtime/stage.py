"""Everything one rank needs to run its share of a stage: model, optimizer, boundaries, data slice."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from heteroflow.backends import ProcessGroups, RankMap, StageBoundary
from heteroflow.backends.rankmap import RankInfo
from heteroflow.config import JobConfig, PlanSpec, StageSpec
from heteroflow.devices.facade import Device
from heteroflow.models.context_parallel import all_reduce_cp_grads
from heteroflow.models.data_parallel import DataParallelAdamW, sync_tied_grads
from heteroflow.models.expert_data_parallel import ExpertDataParallelAdamW
from heteroflow.models.init import init_weights, materialize
from heteroflow.models.llama import StageModel, build_stage_model
from heteroflow.models.parallelize import parallelize_stage
from heteroflow.models.zero3 import Zero3AdamW, shard_stage_zero3
from heteroflow.offload.stage_optimizer import OffloadedAdamW, offloads_state
from heteroflow.offload.zero3 import Zero3OffloadAdamW
from heteroflow.optim import StageOptimizer
from heteroflow.runtime.memory import SavedActivationMeter
from heteroflow.runtime.offload_setup import offloaded_optimizer, zero3_offloaded_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype of each precision a stage computes (and sends its activations) in."""


@dataclass(kw_only=True)
class StageRuntime:
    """This rank's stage: its model shard, optimizer, and the boundaries to its neighbours."""

    job: JobConfig
    plan: PlanSpec
    info: RankInfo
    stage: StageSpec
    device: Device
    groups: ProcessGroups
    model: StageModel
    optimizer: StageOptimizer
    """Under ZeRO-3 `Zero3AdamW`, or `Zero3OffloadAdamW` when the stage offloads optimizer state or parameters;
    otherwise `OffloadedAdamW` when it offloads them, `ExpertDataParallelAdamW` when its experts have a layout of
    their own, else `DataParallelAdamW`."""
    prev: StageBoundary | None
    """Boundary from the previous stage (None on the first stage)."""
    next: StageBoundary | None
    """Boundary to the next stage (None on the last stage)."""
    tied_group: dist.ProcessGroup | None
    """Ranks of the first and last stage, when the embedding is tied across them."""
    meter: SavedActivationMeter
    """Counts the activations this rank's forward leaves on the device (the step record's `memory`)."""
    tied_on_host: bool = False
    """The tied embedding's sum crosses `tied_group` (gloo) through host copies of the device gradient."""

    @property
    def is_first(self) -> bool:
        return self.info.stage == 0

    @property
    def is_last(self) -> bool:
        return self.info.stage == len(self.plan.stages) - 1

    @property
    def precision(self) -> str:
        """The precision this stage computes in: its plan entry's, else `train.precision`."""
        return self.stage.layout.compute_precision(self.job.train.precision)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype this stage sends across its boundaries (activations forward, gradients backward) and
        casts what it receives to: its own precision's."""
        return DTYPES[self.precision]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Low-precision compute dtype under autocast, or None for fp32."""
        return None if self.precision == "fp32" else DTYPES[self.precision]

    def offload_report(self) -> dict | None:
        """Device budget (limit, peak) and swap directory of a stage with offloaded state; None otherwise."""
        return self.optimizer.report() if isinstance(self.optimizer, (OffloadedAdamW, Zero3OffloadAdamW)) else None

    @property
    def shards_over_cp(self) -> bool:
        """Whether the optimizer shards over cp x dp (ZeRO-3): its gradients arrive summed over cp, and each cp
        rank holds (and counts, and writes) its own part; otherwise cp ranks hold the same whole gradients."""
        return isinstance(self.optimizer, Zero3AdamW)

    def sync_tied_grads(self) -> None:
        """Sum the gradient of an embedding tied across stages with the other end's (first and last stage ranks;
        a no-op elsewhere). Call after the step's backwards, before `optimizer.reduce_grads`."""
        if self.tied_group is None:
            return
        if isinstance(self.optimizer, Zero3AdamW):
            self.optimizer.sync_tied_grads(self.tied_group, on_host=self.tied_on_host)
        else:  # cp ranks hold partial sums too: the total lands on one rank of the stage's cp x dp replicas
            sync_tied_grads(self.model, group=self.tied_group, tp_rank=self.info.tp,
                            dp_rank=self.info.dp * self.stage.layout.cp + self.info.cp, grad_of=self.optimizer.grad_of,
                            on_host=self.tied_on_host)

    def sum_cp_grads(self) -> None:
        """Sum the weights' gradients over cp (each cp rank saw only its tokens), unless the optimizer does it (ZeRO-3)
        or cp is 1. Experts with a layout of their own are summed over expert-dp by the optimizer instead."""
        if self.stage.layout.cp == 1 or self.shards_over_cp:
            return
        opt = self.optimizer
        grad_of = opt.dense_grad_of if isinstance(opt, ExpertDataParallelAdamW) else opt.grad_of
        all_reduce_cp_grads(self.model, self.groups.cp, grad_of=grad_of)

    def grad_sq_norm_share(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (fp32, where the optimizer computed it: not read, so
        the host does not wait for the device): cp ranks hold the same gradients after the cp sum, so one of them
        counts them (ZeRO-3 shards them; `ExpertDataParallelAdamW` sees to it itself)."""
        share = self.optimizer.grad_sq_norm_share().float()
        if self.info.cp != 0 and not self.shards_over_cp and not isinstance(self.optimizer, ExpertDataParallelAdamW):
            share = share * 0  # keeps a nan or inf of this rank visible to all
        return share

    def close(self) -> None:
        """Free the offload stores and delete the swap files (idempotent; call also when the step failed)."""
        if isinstance(self.optimizer, (OffloadedAdamW, Zero3OffloadAdamW)):
            self.optimizer.close()


def build_stage_runtime(job: JobConfig, plan: PlanSpec, rank_map: RankMap, groups: ProcessGroups, *,
                        device: Device, init_from: str | None = None, meta: bool = False) -> StageRuntime:
    """Build the model shard (seed-only init, then the plan's layout), optimizer and boundaries.

    `meta`: a dry run under torch's `FakeTensorMode` (tensors with shapes, dtypes and devices but no storage):
    no weights drawn or read, SSD tiers laid out on the host (`offload_setup.stage_policy`). Must run on every rank at the same point: it creates the tied-embedding
    group, a collective call.
    """
    info = rank_map.info(groups.rank)
    k = info.stage
    stage = plan.stages[k]
    first, last = plan.layer_ranges()[k]
    num_stages = len(plan.stages)
    # Built on the meta device and sharded before any storage exists: a rank allocates only its share.
    with torch.device("meta"):
        model = build_stage_model(job.model, first_layer=first, last_layer=last, is_first=k == 0,
                                  is_last=k == num_stages - 1)
    # MoE layers pool their load-balancing statistics over the ranks holding parts of one micro-batch.
    token_group = groups.stage if stage.layout.sp else groups.replicas
    parallelize_stage(model, layout=stage.layout, tp_group=groups.tp, cp_group=groups.cp, ep_group=groups.ep,
                      token_group=token_group if dist.get_world_size(token_group) > 1 else None)
    t = job.train
    precision = stage.layout.compute_precision(t.precision)
    dtype = DTYPES[precision]
    zero3_offload = stage.layout.zero == 3 and offloads_state(stage)
    fsdp_master = stage.layout.zero == 3 and not zero3_offload  # FSDP2 keeps fp32 shards as the master weights
    # Offloaded blocks go to their tier from the host: the device never holds the whole stage. A dry run (`meta`,
    # tensors without storage) makes them in the compute dtype at once: casting them would swap fake tensors.
    materialize(model, "cpu" if stage.layout.offload.params != "device" else device.torch_device,
                dtype=dtype if meta and not fsdp_master else None)
    if init_from is not None and not meta:
        from heteroflow.models.hf_checkpoint import load_hf_weights
        load_hf_weights(model, init_from, job_spec=job.model)
    elif not meta:  # a dry run has no storage to draw into
        init_weights(model, seed=job.train.seed)
    if fsdp_master:
        # FSDP2 keeps the fp32 shards as the master weights and gathers them in the stage's precision. It shards
        # over cp x dp (as Megatron's distributed optimizer under cp): its reduce-scatter sums over both at once.
        shard_stage_zero3(model, dp_group=groups.replicas, device_type=device.torch_device.type,
                          param_dtype=None if precision == "fp32" else dtype)
    elif not meta:
        # The parameters live in the stage's compute dtype (`heteroflow.layout.state_bytes`): the optimizer's fp32
        # master copy starts from these rounded values, as Megatron's does.
        model.to(dtype)
    if zero3_offload:  # ZeRO-Infinity: shards in the stage's dtype, the fp32 master in the optimizer tier
        units = shard_stage_zero3(model, dp_group=groups.replicas, device_type=device.torch_device.type,
                                  param_dtype=None, shards_on_host=stage.layout.offload.params != "device",
                                  swapped=stage.layout.offload.params == "ssd" and not meta)
        optimizer: StageOptimizer = zero3_offloaded_optimizer(model, units, job=job, stage=stage, groups=groups,
                                                              device=device, dry_run=meta)
    elif offloads_state(stage):
        optimizer = offloaded_optimizer(model, job=job, stage=stage, groups=groups, device=device, dry_run=meta)
    elif stage.layout.zero == 3:
        optimizer = Zero3AdamW(model, dp_group=groups.replicas, tp_group=groups.tp, betas=(t.adam_beta1, t.adam_beta2),
                               eps=t.adam_eps, weight_decay=t.weight_decay)
    elif stage.layout.separate_experts and job.model.moe is not None:
        optimizer = ExpertDataParallelAdamW(model, dp_group=groups.dp, tp_group=groups.tp,
                                            expert_dp_group=groups.expert_dp, etp_group=groups.etp, cp_rank=info.cp,
                                            zero=stage.layout.zero, betas=(t.adam_beta1, t.adam_beta2),
                                            eps=t.adam_eps, weight_decay=t.weight_decay)
    else:
        optimizer = DataParallelAdamW(model, dp_group=groups.dp, tp_group=groups.tp, zero=min(stage.layout.zero, 2),
                                      betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                      weight_decay=t.weight_decay)
    try:  # the boundaries and groups below are collectives that may fail: never leave swap files behind
        shape = (plan.micro_batch_size, job.model.seq_length, job.model.hidden_size)
        # Each side sends in its own precision, the receiver casts to its own: activations cross a boundary
        # in the earlier stage's dtype, gradients in the later one's.
        dtypes = [DTYPES[s.layout.compute_precision(t.precision)] for s in plan.stages]
        prev = nxt = None
        if k > 0:
            prev = StageBoundary(groups, k - 1, shape=shape, dtype=dtypes[k - 1], grad_dtype=dtypes[k],
                                 device=device.torch_device)
        if k < num_stages - 1:
            nxt = StageBoundary(groups, k, shape=shape, dtype=dtypes[k], grad_dtype=dtypes[k + 1],
                                device=device.torch_device)
        tied_group = None
        tied_backend = tied_grads_backend(rank_map, emulate=groups.emulate)
        if job.model.tie_embeddings and num_stages > 1:
            # Every rank creates the group (torch requires it); only the two end stages use it.
            ends = sorted(set(rank_map.stages[0].ranks) | set(rank_map.stages[-1].ranks))
            group = dist.new_group(ends, backend="fake" if groups.fake else groups.registered(tied_backend))
            tied_group = group if k in (0, num_stages - 1) else None
    except BaseException:
        if isinstance(optimizer, (OffloadedAdamW, Zero3OffloadAdamW)):
            optimizer.close()
        raise
    meter = SavedActivationMeter(device.torch_device)
    meter.exclude_parameters(model)
    return StageRuntime(job=job, plan=plan, info=info, stage=stage, device=device, groups=groups, model=model,
                        optimizer=optimizer, prev=prev, next=nxt, tied_group=tied_group, meter=meter,
                        tied_on_host=tied_backend == "gloo" and not groups.emulate and info.vendor != "cpu")


def tied_grads_backend(rank_map: RankMap, *, emulate: bool) -> str:
    """The backend of the group summing an embedding tied across the first and last stage: their vendor's when
    both share one (device tensors, no copies), else gloo (in emulation, always gloo), which accelerator ranks
    feed through host copies (gloo takes no NPU tensors)."""
    first, last = rank_map.stages[0], rank_map.stages[-1]
    same = first.vendor == last.vendor and first.backend == last.backend
    return first.backend if same and not emulate else "gloo"
