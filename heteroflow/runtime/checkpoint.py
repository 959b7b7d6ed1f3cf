"""Checkpoints in the training loop: save every `train.checkpoint.interval` steps and at the end, and
resume from the newest complete checkpoint under any plan.

    ckpt = TrainCheckpoints(args, rt, groups)     # every rank, after build_stage_runtime
    first_step = ckpt.resume()                   # 0, or the saved step when resuming
    for step in range(first_step, args.steps):
        ...one optimizer step...
        ckpt.after_step(step)                    # collective: every rank calls it

Resuming is asked for by `WorkerArgs.resume` (`heteroflow train --resume`) or happens by itself after an
elastic restart (`TORCHELASTIC_RESTART_COUNT` > 0). Without a complete checkpoint it starts at step 0,
with a note. A checkpoint whose model spec differs from the job's is refused (before launch already:
`heteroflow.launcher.prepare.prepare_resume`).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import torch
import torch.distributed as dist

from heteroflow.checkpoint.files import clean_incomplete, complete_checkpoints, inside_root, step_dir_name
from heteroflow.checkpoint.meta import check_model, read_metadata, restore_rng, rng_state, train_differences
from heteroflow.checkpoint.pieces import CheckpointReader
from heteroflow.checkpoint.save import save_checkpoint
from heteroflow.checkpoint.stage_state import load_stage, stage_pieces
from heteroflow.checkpoint.verify import NoIntactCheckpoint, newest_intact
from heteroflow.config import JobConfig


def restart_count() -> int:
    """How many times the elastic agent restarted the workers (0 outside torchrun / on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def checkpoint_root(job: JobConfig) -> Path | None:
    """The job's checkpoint directory (absolute), or None when it writes none."""
    spec = job.train.checkpoint
    return Path(job.resolve_path(spec.dir)) if spec is not None else None


class TrainCheckpoints:
    """One rank's view of the job's checkpoints; a no-op when the job has no `train.checkpoint`."""

    def __init__(self, args, rt, groups, *, scaler=None):
        self.job, self.plan, self.rt, self.group = args.job, args.plan, rt, groups.world
        self.scaler = scaler
        """The job's `LossScaler` (None without loss scaling): its state is saved and restored with the run's."""
        self.end_step = args.steps
        self.requested = bool(args.resume) or restart_count() > 0
        self.spec = self.job.train.checkpoint
        self.root = checkpoint_root(self.job)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.last_saved: int | None = None
        self.scratch_id = "0"
        if self.spec is not None:  # one id for this run's temporary directories, the same on every rank
            pick = torch.tensor([secrets.randbits(40) if self.rank == 0 else 0], dtype=torch.int64)
            dist.broadcast(pick, src=dist.get_global_rank(self.group, 0), group=self.group)
            self.scratch_id = format(int(pick), "x")

    def _note(self, message: str) -> None:
        if self.rank == 0:
            print(f"heteroflow: checkpoint: {message}", flush=True)

    def resume(self) -> int:
        """Load the newest complete checkpoint when resuming; returns the first step to run."""
        if not self.requested:
            return 0
        if restart_count() > 0 and self.rank == 0:  # the agent restarted every worker after a failure: say so
            limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            then = "from the newest checkpoint" if self.spec is not None else \
                "from step 0 (the job has no train.checkpoint)"
            print(f"heteroflow: restart {restart_count()} of {limit} (--max-restarts): a rank failed and every "
                  f"worker was started again; continuing {then}; the failed attempt's logs are in the log directory",
                  flush=True)
        if self.spec is None:
            self._note("resume asked for, but the job has no train.checkpoint: starting at step 0")
            return 0
        # Rank 0 decides (and deletes partial saves); every rank then opens the same directory.
        choice = torch.tensor([-1], dtype=torch.int64)
        if self.rank == 0:  # verified again here: an elastic restart has no check before launch
            found = complete_checkpoints(self.root)
            intact = newest_intact(self.root, report=self._note)
            clean_incomplete(self.root)
            choice[0] = int(intact.name.split("-")[1]) if intact is not None else -2 if found else -1
        dist.broadcast(choice, src=dist.get_global_rank(self.group, 0), group=self.group)
        step = int(choice)
        if step == -2:
            raise NoIntactCheckpoint(self.root)
        if step < 0:
            self._note(f"no complete checkpoint in {self.root}: starting at step 0")
            return 0
        step_dir = inside_root(self.root / step_dir_name(step), self.root)
        meta = read_metadata(step_dir)
        check_model(step_dir, meta, self.job.model.to_dict())
        for line in train_differences(meta, self.job.train.to_dict()):
            self._note(f"note: {line}")
        started = time.perf_counter()
        with CheckpointReader(step_dir) as reader:
            load_stage(self.rt.model, self.rt.optimizer, reader, optimizer_steps=meta["optimizer_steps"])
        if isinstance(meta.get("rng"), dict):
            restore_rng(meta["rng"])
        self._restore_scaler(meta)
        self.last_saved = step
        dist.barrier(group=self.group)
        self._note(f"resumed from {step_dir} at step {step} ({time.perf_counter() - started:.2f} s)")
        if step >= self.end_step:
            self._note(f"the checkpoint is at step {step}, the run ends at step {self.end_step}: nothing to train")
        return step

    def _restore_scaler(self, meta: dict) -> None:
        """Continue the loss scale where the checkpoint left it (the same on every rank, whatever the plan)."""
        if self.scaler is None:
            return
        state = meta.get("loss_scaler")
        if isinstance(state, dict):
            self.scaler.load_state_dict(state)
        else:
            self._note(f"the checkpoint has no loss scale (written without loss scaling): starting at "
                       f"{self.scaler.scale:g}")

    def after_step(self, step: int) -> None:
        """After optimizer step `step`: save when an interval ends or the run does (every rank calls this)."""
        done = step + 1
        if self.spec is None or done == self.last_saved:
            return
        if done % self.spec.interval == 0 or done == self.end_step:
            self.save(done)

    def save(self, step: int) -> Path:
        """Write checkpoint `step` (the next step to run) from every rank; collective."""
        started = time.perf_counter()
        info = self.rt.info
        # cp ranks hold the same weights and optimizer state (cp splits only the sequence): cp rank 0 writes,
        # unless ZeRO-3 shards them over cp x dp: then each rank writes its own range. Experts with a layout of
        # their own are written by expert-dp rank 0 (whatever its cp index).
        writes = info.cp == 0 or self.rt.shards_over_cp
        pieces = stage_pieces(self.rt.model, self.rt.optimizer, tp_rank=info.tp, dp_rank=info.dp, writes_dense=writes,
                              expert_ranks=(info.etp, info.expert_dp))
        gbs = self.job.train.global_batch_size
        metadata = {"model": self.job.model.to_dict(), "train": self.job.train.to_dict(),
                    "plan": self.plan.to_dict(), "cluster": self.job.cluster.to_dict(),
                    "data_position": {"step": step, "samples_consumed": step * gbs, "global_batch_size": gbs},
                    "optimizer_steps": self.rt.optimizer.steps, "rng": rng_state()}
        if self.scaler is not None:
            metadata["loss_scaler"] = self.scaler.state_dict()
        final = save_checkpoint(self.root, step, pieces, metadata, rank=self.rank, world_size=self.world_size,
                                barrier=lambda: dist.barrier(group=self.group), scratch_id=self.scratch_id,
                                keep=self.spec.keep)
        self.last_saved = step
        self._note(f"saved {final} ({time.perf_counter() - started:.2f} s)")
        return final
