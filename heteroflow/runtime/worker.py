"""The per-rank entry point: join the world, build this rank's stage, train, report metrics (rank 0)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from heteroflow.config import JobConfig, PlanSpec
from heteroflow.errors import UserError
from heteroflow.models.compile import compile_blocks
from heteroflow.optim.loss_scale import LossScaler
from heteroflow.runtime.grad_faults import inject_grad_fault
from heteroflow.runtime.memory import measured_memory, memory_record, reset_measurement
from heteroflow.runtime.metrics import MetricsWriter, ProgressBar, StepRecord, header_record
from heteroflow.runtime.nodes import assigned_rank, join_node_world, node_view, restarted_anywhere
from heteroflow.runtime.progress import world_progress_board
from heteroflow.runtime.stage_table import stage_table
from heteroflow.runtime.stage_times import gather_step_figures, rank_figures, stage_records
from heteroflow.runtime.stop import StopRequest, agreed_signal
from heteroflow.runtime.tensorboard import TensorBoardWriter
from heteroflow.runtime.user_errors import TrainingDiverged, clear_user_error, record_user_error
from heteroflow.runtime.watchdog import StepWatchdog, collective_timeout_s

MAX_STUCK_OVERFLOWS = 20
"""Overflowing steps in a row at the minimum (or a static) loss scale that count as divergence."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerArgs:
    """Everything a worker needs; pickled to each spawned process."""

    job: JobConfig
    plan: PlanSpec
    emulate: bool
    steps: int
    """Train steps [0, steps)."""
    data_dir: str
    """Where the built-in corpus token file is written when the job names no data."""
    metrics_path: str | None = None
    tensorboard_dir: str | None = None
    """Where rank 0 writes TensorBoard scalars (`runtime.tensorboard`), or None."""
    predicted_step_time_s: float | None = None
    predicted_stages: tuple[dict[str, float], ...] | None = None
    """Per stage, the cost model's seconds per step by part and `step_s` (`stagemap.breakdown`), or None."""
    timeout_s: float = 600.0
    """Step limit (the watchdog reports a rank stuck in one step); collectives time out a little later."""
    return_state: bool = False
    """Return this rank's parameter shards (for equivalence tests)."""
    show_progress: bool = True
    resume: bool = False
    """Continue from the newest complete checkpoint in `train.checkpoint.dir` (also done after an elastic restart)."""


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """What a rank hands back: the per-step losses (rank 0) and optionally its parameter shards."""

    losses: tuple[float, ...]
    state: dict | None
    first_step: int = 0
    """The step `losses[0]` belongs to (the checkpoint's step when resumed)."""
    offload: dict | None = None
    """This rank's offload report (device budget limit and peak, swap directory), if its stage offloads."""
    stopped_by: int = 0
    """The signal (SIGTERM, SIGINT) that stopped the run before its last step, the same on every rank; 0: ran to
    the end."""
    saved: str | None = None
    """The checkpoint written when the run stopped on a signal (None without `train.checkpoint`)."""


def run_worker(args: WorkerArgs) -> WorkerResult:
    """Train on this rank; every rank of the plan runs it at once. A `UserError` is also left for the launcher
    (`runtime.user_errors`), which shows it as one message instead of the workers' tracebacks."""
    rank = assigned_rank()
    rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    clear_user_error(rank)
    stop = StopRequest.install()  # from the start: a signal during start-up stops the run after its first step
    try:
        return _run_worker(args, stop)
    except UserError as error:
        record_user_error(error, rank)
        raise
    finally:
        stop.close()


def _run_worker(args: WorkerArgs, stop: StopRequest) -> WorkerResult:
    from heteroflow.backends import RankMap, build_process_groups, init_world
    from heteroflow.devices.facade import Device
    from heteroflow.runtime.stage import build_stage_runtime
    from heteroflow.testing.strict import standins_requested

    job, plan, train = args.job, args.plan, args.job.train
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    rank_map = node_view(RankMap.from_plan(plan, job.cluster))
    owns_world = not dist.is_initialized()  # a test harness may have joined the world for us
    join_node_world(rank_map, timeout_s=collective_timeout_s(args.timeout_s))  # multi-node: under the plan's rank
    rank = init_world(rank_map, timeout_s=collective_timeout_s(args.timeout_s))
    info = rank_map.info(rank)
    # Tests only: HETEROFLOW_STRICT_BACKENDS=1 runs this real path on CPU with vendor-faithful stand-in backends.
    standins = None if args.emulate else standins_requested(rank_map.stages[info.stage].backend)
    device = Device.for_vendor(info.vendor, info.local_device, emulate=args.emulate or standins is not None)
    device.set_current()
    device.manual_seed(train.seed)
    groups = build_process_groups(rank_map, emulate=args.emulate, timeout_s=collective_timeout_s(args.timeout_s),
                                  backend_names=standins.backend_names if standins is not None else None)
    if not args.resume and restarted_anywhere(groups.world):  # an elastic restart goes on from the last checkpoint
        args = replace(args, resume=True)
    init_from = job.resolve_path(train.init_from) if train.init_from else None
    rt = build_stage_runtime(job, plan, rank_map, groups, device=device, init_from=init_from)
    if train.compile:  # after the layout and the optimizer: the compiled blocks see the final modules
        compile_blocks(rt.model, device_type=device.torch_device.type)
    if rt.offload_report() is not None and info.dp == 0 and info.tp == 0:  # once per stage: which paths run
        print(f"heteroflow: stage {info.stage} {rt.optimizer.describe()}", flush=True)
    try:  # an offloaded stage's swap files go when this rank ends, also when it fails
        first_step, losses, stopped_by, saved = _train_steps(args, rt, rank, stop)
        state = None
        if args.return_state:
            from heteroflow.models.shard import shard_of
            params = dict(rt.model.named_parameters())  # offloaded blocks are placeholders: values come from their tier
            state = {name: (value.detach().cpu().clone(), shard_of(params[name]))
                     for name, value in rt.optimizer.named_weights()}
        offload = rt.offload_report()
    finally:
        rt.close()
    dist.barrier(group=groups.world)
    if owns_world:
        dist.destroy_process_group()
    else:
        # The world stays (a harness may run more), this run's groups go: each holds gloo threads that
        # keep waking up, which slowed every later run in the same processes.
        for group in groups.member_groups() + ([rt.tied_group] if rt.tied_group is not None else []):
            dist.destroy_process_group(group)
    return WorkerResult(losses=tuple(losses), state=state, first_step=first_step, offload=offload,
                        stopped_by=stopped_by, saved=saved)


def _train_steps(args: WorkerArgs, rt, rank: int, stop: StopRequest) -> tuple[int, list[float], int, str | None]:
    """Resume if asked, run steps [first step, args.steps), save checkpoints; returns the first step, the losses,
    and when a signal stopped the run early (`runtime.stop`), the signal and the checkpoint written then."""
    from heteroflow.checkpoint.files import step_dir_name
    from heteroflow.data.builtin import open_train_data
    from heteroflow.data.tokens import micro_batch_indices
    from heteroflow.devices.timing import PartTimer
    from heteroflow.models.moe import set_aux_loss_scale, take_aux_losses
    from heteroflow.models.tp_ops import timing_collectives
    from heteroflow.runtime.checkpoint import TrainCheckpoints
    from heteroflow.runtime.lr import learning_rate
    from heteroflow.runtime.pipeline import MicroBatch, run_pipeline_step
    from heteroflow.models.context_parallel import split_sequence

    job, plan, train, info, groups, device = args.job, args.plan, args.job.train, rt.info, rt.groups, rt.device
    scaler = LossScaler.for_job(train, [stage.layout.compute_precision(train.precision) for stage in plan.stages])
    checkpoints = TrainCheckpoints(args, rt, groups, scaler=scaler)
    first_step = checkpoints.resume()
    data = open_train_data(job, work_dir=args.data_dir, steps=args.steps)
    order = data.order
    num_micro_batches = plan.num_micro_batches(train)
    global_tokens = train.global_batch_size * job.model.seq_length
    counts_loss = rt.is_last and info.tp == 0  # every cp rank's loss is that of its own tokens
    cp = rt.stage.layout.cp
    # Each rank's aux value is its tokens' part of its micro-batch's (`Router.pool`): without sp every tp rank
    # holds the same tokens and one of them counts; under sp each holds its own.
    counts_aux = info.tp == 0 or rt.stage.layout.sp
    moe_layers_total = sum(job.model.is_moe_layer(i) for i in range(job.model.num_layers))
    header = header_record(job=job.to_dict(), plan=plan.to_dict(), emulate=args.emulate,
                           predicted_step_time_s=args.predicted_step_time_s)
    writer = MetricsWriter(args.metrics_path, header=header) if rank == 0 else None
    board = TensorBoardWriter(args.tensorboard_dir, interval=train.tensorboard_log_interval) \
        if rank == 0 and args.tensorboard_dir else None
    progress = ProgressBar(args.steps, first_step=first_step) if rank == 0 and args.show_progress else None
    losses: list[float] = []
    stopped_by, saved = 0, None
    records: list[dict] = []  # rank 0: what it wrote, for the stage table at the end
    timer = PartTimer(device.new_event)
    tp_group = groups.tp if rt.stage.layout.tp > 1 else None
    ep_group = groups.ep if groups.ep is not None and groups.ep is not tp_group else None
    device_types = [stage.device_type for stage in plan.stages]
    stage_of_rank = [k for k, stage in enumerate(plan.stages) for _ in range(stage.num_devices)]  # RankMap's order
    where = f"stage {info.stage}, dp {info.dp} cp {info.cp} tp {info.tp}, node {info.node}"
    # Every rank's step and heartbeat in the store: a rank waiting past the limit names those it waits for.
    watchdog = StepWatchdog(limit_s=args.timeout_s, rank=rank, where=where,
                            progress=world_progress_board(rank=rank, where=where))
    # The step before, its figures read once the device has run it: at this step's one sync (or at the end).
    ended: _EndedStep | None = None

    def report(ended: _EndedStep) -> None:
        """Every rank's figures of `ended` to rank 0, which writes its record (the device must have run it)."""
        step_time = ended.start.elapsed_time(ended.end) / 1000.0
        figures = rank_figures(PartTimer.seconds(ended.parts), step_s=step_time)
        # One small world collective: every rank's part times and memory to rank 0.
        gathered = gather_step_figures(figures, ended.memory, rank_map=groups.rank_map, group=groups.world,
                                       rank=rank)
        if rank == 0:
            assert gathered is not None
            measured, memory_measured = gathered
            record = StepRecord(**ended.fields, tokens_per_s=global_tokens / step_time, step_time_s=step_time,
                                stages=stage_records(measured, args.predicted_stages, device_types),
                                memory=memory_record(job, plan, memory_measured, stage_of_rank))
            writer.write(record)
            if board is not None:
                board.write(record)
            records.append({"step": ended.fields["step"], "stages": record.stages})
            if progress is not None:
                progress.update(record)

    try:
        for step in range(first_step, args.steps):
            watchdog.begin(step)
            reset_measurement(rt.meter, device)
            start = device.new_event(enable_timing=True)  # the step's time: from this event to its last
            start.record()
            indices = order.global_batch(step)
            micro_batches = []
            for m in range(num_micro_batches):
                share = micro_batch_indices(indices, micro_batch_size=plan.micro_batch_size, micro_batch=m,
                                            dp=rt.stage.layout.dp, dp_rank=info.dp)
                tokens, labels = data.batch(share)
                micro_batches.append(MicroBatch(split_sequence(tokens, cp=cp, cp_rank=info.cp),
                                                split_sequence(labels, cp=cp, cp_rank=info.cp)))
            scale = scaler.scale if scaler is not None else 1.0
            set_aux_loss_scale(rt.model, step_tokens=global_tokens, grad_scale=scale)
            # the ep group's all-to-alls are timed as `alltoall` (when ep shares the tp group, by its timer)
            with timing_collectives(tp_group, timer), timing_collectives(ep_group, timer):
                loss_sum = run_pipeline_step(rt, micro_batches, global_tokens=global_tokens, loss_scale=scale,
                                             timer=timer)
            inject_grad_fault(rt.model, rank, step, rt.optimizer.grad_of)
            with timer.part("dp"):
                rt.sync_tied_grads()
                rt.sum_cp_grads()  # weights saw only this rank's tokens: sum over cp, then dp
                rt.optimizer.reduce_grads()
            with timer.part("optimizer"):  # the norm share is the clipping's, priced with the optimizer step
                norm_share = rt.grad_sq_norm_share()
            # One world all-reduce carries both the squared-norm shares and the loss: an inf or nan in any
            # gradient of any rank makes the norm non-finite on every rank, so all skip (or stop) together.
            aux_share = take_aux_losses(rt.model)
            # ... and the ranks asked to stop (a signal): all see the same count, so all stop after this step
            totals = _to_host([norm_share, loss_sum if counts_loss else torch.zeros(()),
                               aux_share if counts_aux else torch.zeros(()),
                               torch.ones(()) if stop.requested() else torch.zeros(())], device)
            if ended is not None:  # the read above waited for the device: the step before has run
                report(ended)
                ended = None
            with timer.part("sync"):
                dist.all_reduce(totals, group=groups.world)
            grad_norm = math.sqrt(float(totals[0])) / scale  # of the unscaled gradients
            loss = float(totals[1]) / global_tokens
            # Mean over MoE layers of each layer's token-weighted aux loss (unscaled by the coefficient).
            aux_loss = float(totals[2]) / moe_layers_total if moe_layers_total else None
            skipped = not math.isfinite(grad_norm)
            if not math.isfinite(loss) or (skipped and scaler is None):
                raise TrainingDiverged(_divergence_message(step, first_step, loss=loss, grad_norm=grad_norm))
            # As in Megatron, the schedule follows the updates applied: a skipped step does not advance it.
            lr = learning_rate(rt.optimizer.steps, train)
            with timer.part("optimizer"):
                if not skipped:
                    clip = min(1.0, train.grad_clip / (grad_norm + 1e-6)) if train.grad_clip > 0 else 1.0
                    rt.optimizer.step(lr=lr, grad_scale=clip / scale)
                rt.optimizer.zero_grad()
            if scaler is not None:
                scaler.update(skipped)
                if scaler.stuck_overflows >= MAX_STUCK_OVERFLOWS:
                    raise TrainingDiverged(_overflow_message(step, scaler))
            end = device.new_event(enable_timing=True)
            end.record()
            # Read at the next step's sync: no wait for the device here (the memory figures are the host's counts).
            ended = _EndedStep(parts=timer.take(), start=start, end=end,
                               memory=measured_memory(rt.optimizer, rt.meter, device),
                               fields={"step": step, "loss": loss, "aux_loss": aux_loss, "lr": lr,
                                       "grad_norm": grad_norm, "predicted_step_time_s": args.predicted_step_time_s,
                                       "loss_scale": scale if scaler is not None else None,
                                       "skipped": skipped if scaler is not None else None})
            losses.append(loss)
            checkpoints.after_step(step)
            if float(totals[3]) > 0 and step + 1 < args.steps:
                stopped_by = agreed_signal(stop.requested(), groups.world)
                if checkpoints.spec is not None:  # whatever the interval (after_step may have saved it already)
                    saved = str(checkpoints.save(step + 1) if checkpoints.last_saved != step + 1
                                else checkpoints.root / step_dir_name(step + 1))
                break
        if ended is not None:  # the last step: its figures once the device has run it
            device.synchronize()
            report(ended)
    finally:
        watchdog.stop()
        if writer is not None:
            writer.close()
        if board is not None:
            board.close()
    table = stage_table(records) if progress is not None else None
    if table is not None:
        print(table, flush=True)
    return first_step, losses, stopped_by, saved


@dataclass(frozen=True, slots=True)
class _EndedStep:
    """A step whose work the device may still be running: what its record needs, read once it has run."""

    parts: list
    """`PartTimer.take()` at the step's end."""
    start: object
    end: object
    """The device events at the step's start and end."""
    memory: dict[str, int]
    fields: dict
    """The `StepRecord` fields known on the host at the step's end."""


def _to_host(values: list[torch.Tensor], device) -> torch.Tensor:
    """The fp32 scalars `values` (on the device or the host) stacked on the host with one device-to-host copy: the
    step's one read of the device (it waits for the work computing them), instead of one per value."""
    on_device = torch.stack([v.to(device.torch_device, non_blocking=True) for v in values])
    return on_device.cpu()


def _divergence_message(step: int, first_step: int, *, loss: float, grad_norm: float) -> str:
    """Why training stopped at `step`, and what to look at: before any update of this run the learning rate
    cannot be the cause, so the message points at the model, the weights and the data instead."""
    what = f"the loss is {loss} and the gradient norm {grad_norm} at step {step}"
    if step == first_step:
        cause = ("before any update of this run, so the learning rate is not the cause: check the model settings "
                 "(rope_theta, norm_eps, sizes), the weights it starts from (train.init_from or the checkpoint) "
                 "and the training data")
    else:
        cause = "lower train.lr, raise train.warmup_steps or set train.grad_clip"
    return (f"training diverged: {what}; that step was not applied and no checkpoint was written after it. "
            f"Cause: {cause}.")


def _overflow_message(step: int, scaler: LossScaler) -> str:
    """Why a loss-scaled run stopped: its gradients overflow even at the lowest scale it may use."""
    where = "its static loss scale" if not scaler.dynamic else "train.min_loss_scale"
    return (f"training diverged: the gradients held an inf or nan in {scaler.stuck_overflows} steps in a row up "
            f"to step {step}, at {where} {scaler.scale:g}; those steps were skipped. Cause: lower train.lr or "
            f"{'train.loss_scale' if not scaler.dynamic else 'train.min_loss_scale'}, or train this model in "
            "bf16 or fp32.")
