"""`TrainSpec`: batch sizes, optimizer schedule, data and checkpoint settings."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from heteroflow.config import limits
from heteroflow.config.data import DataSpec, parse_data
from heteroflow.config.device import PRECISIONS
from heteroflow.config.reader import Problems, Section


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSpec:
    """Where and how often layout-independent checkpoints are written."""

    dir: str
    """Checkpoint directory, resolved relative to the job file."""
    interval: int = 100
    """Save every `interval` optimizer steps."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """Optimization settings; AdamW with linear warmup then cosine decay to `min_lr`."""

    global_batch_size: int
    """Samples per optimizer step."""
    micro_batch_size: int = 1
    """Samples per pipeline micro-batch (a plan may override)."""
    precision: str = "bf16"
    """bf16, fp16 (autocast, fp32 master weights) or fp32."""
    steps: int = 1000
    """Optimizer steps."""
    seed: int = 1234
    """Seeds weights and data order; the plan never changes them."""
    lr: float = 3.0e-4
    """Peak learning rate."""
    min_lr: float = 3.0e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 100
    """Linear warmup steps from 0 to `lr`."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    data: DataSpec | None = None
    """Token file or Megatron datasets; None uses the built-in corpus."""
    init_from: str | None = None
    """A Hugging Face-format Llama/Qwen2 checkpoint directory to start from."""
    checkpoint: CheckpointSpec | None = None
    """Periodic checkpoints; None writes none."""
    loss_scale: str | float | None = None
    """`dynamic`, or a static scale (a number); None: dynamic when any stage computes in fp16, else no scaling."""
    initial_loss_scale: float = 2.0**32
    """Dynamic loss scaling: the scale of the first step (Megatron's default)."""
    min_loss_scale: float = 1.0
    """Dynamic loss scaling: the scale never backs off below this."""
    loss_scale_window: int = 1000
    """Dynamic loss scaling: clean steps in a row before the scale doubles."""
    hysteresis: int = 2
    """Dynamic loss scaling: overflowing steps tolerated (since the scale last grew) before it halves."""
    tensorboard_dir: str | None = None
    """Where rank 0 writes TensorBoard scalars (resolved relative to the job file; needs the `tensorboard`
    extra); None writes none. `heteroflow train --tensorboard-dir` overrides it."""
    tensorboard_log_interval: int = 1
    """Write the TensorBoard scalars of every `tensorboard_log_interval`-th step (Megatron's
    `--tensorboard-log-interval`)."""
    offload_dir: str | None = None
    """Where stages with an `ssd` offload tier keep their scratch swap files (resolved relative to the job
    file; never inside `checkpoint.dir`); None: `$HETEROFLOW_SWAP_DIR`, else the system temp directory."""
    compile: bool = False
    """Compile each decoder block with `torch.compile` (`models.compile`); the run stops with a `train.compile`
    error at start where the device's compiler is missing or this torch build cannot compile."""

    def to_dict(self) -> dict:
        """Plain data in the job YAML's schema (unset optional sections left out)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        return out if self.data is None else {**out, "data": self.data.to_dict()}


_NUMBER_LIMITS = {"lr": limits.LEARNING_RATE, "min_lr": limits.MIN_LEARNING_RATE, "weight_decay": limits.WEIGHT_DECAY,
                  "grad_clip": limits.GRAD_CLIP, "adam_beta1": limits.ADAM_BETA, "adam_beta2": limits.ADAM_BETA,
                  "adam_eps": limits.ADAM_EPS}
"""The optimizer's numbers and their allowed ranges (`heteroflow.config.limits`)."""


def parse_train(data: object, problems: Problems, path: str = "train") -> TrainSpec | None:
    """Build a `TrainSpec` from the job's `train:` section."""
    sec = Section(data, path, problems)
    d = TrainSpec.__dataclass_fields__
    values = {
        "global_batch_size": sec.integer("global_batch_size", limit=limits.GLOBAL_BATCH_SIZE),
        "micro_batch_size": sec.integer("micro_batch_size", d["micro_batch_size"].default,
                                        limit=limits.MICRO_BATCH_SIZE),
        "precision": sec.string("precision", d["precision"].default, choices=PRECISIONS),
        "steps": sec.integer("steps", d["steps"].default, limit=limits.STEPS),
        "seed": sec.integer("seed", d["seed"].default, limit=limits.SEED),
        "warmup_steps": sec.integer("warmup_steps", d["warmup_steps"].default, limit=limits.WARMUP_STEPS),
        "init_from": sec.string("init_from", None),
        "offload_dir": sec.string("offload_dir", None),
        "tensorboard_dir": sec.string("tensorboard_dir", None),
        "tensorboard_log_interval": sec.integer("tensorboard_log_interval", d["tensorboard_log_interval"].default,
                                                limit=limits.STEPS),
        "compile": sec.boolean("compile", d["compile"].default),
    }
    for name, limit in _NUMBER_LIMITS.items():
        values[name] = sec.number(name, d[name].default, limit=limit)
    values.update(_loss_scale_settings(sec, problems))
    data_sec = sec.mapping("data", None)
    values["data"] = None
    if data_sec is not None:
        values["data"] = parse_data(data_sec, problems)
    ckpt_sec = sec.mapping("checkpoint", None)
    values["checkpoint"] = None
    if ckpt_sec is not None:
        values["checkpoint"] = _build(CheckpointSpec, ckpt_sec, dir=ckpt_sec.string("dir"),
                                      interval=ckpt_sec.integer("interval", 100, limit=limits.STEPS),
                                      keep=ckpt_sec.integer("keep", 3, limit=limits.CHECKPOINTS_KEPT))
    sec.finish()
    lr, min_lr = values["lr"], values["min_lr"]
    if lr is not None and min_lr is not None and min_lr > lr:
        problems.add(sec.at("min_lr"), f"{min_lr:g} is above lr {lr:g}; min_lr must not exceed lr")
        return None
    gbs, mbs = values["global_batch_size"], values["micro_batch_size"]
    if gbs is not None and mbs is not None and gbs % mbs:
        problems.add(sec.at("global_batch_size"), f"{gbs} is not divisible by micro_batch_size {mbs}")
        return None
    offload_dir, ckpt = values["offload_dir"], values["checkpoint"]
    if offload_dir is not None and ckpt is not None and _inside(offload_dir, ckpt.dir):
        problems.add(sec.at("offload_dir"), f"{offload_dir!r} is inside train.checkpoint.dir {ckpt.dir!r}; swap files "
                     "are scratch and must never mix with checkpoints: choose a directory outside it")
        return None
    optional = ("init_from", "data", "checkpoint", "offload_dir", "loss_scale", "tensorboard_dir")
    if not sec.valid or any(v is None for k, v in values.items() if k not in optional):
        return None
    if (data_sec is not None and values["data"] is None) or (ckpt_sec is not None and values["checkpoint"] is None):
        return None
    return TrainSpec(**values)


def _loss_scale_settings(sec: Section, problems: Problems) -> dict:
    """`loss_scale` (`dynamic` or a finite positive number) and the dynamic scaler's settings (finite and
    positive; the window and hysteresis integers); dynamic settings next to a static scale are refused."""
    d = TrainSpec.__dataclass_fields__
    values: dict = {"loss_scale": None}
    raw = sec.raw("loss_scale", None)
    if isinstance(raw, str):
        values["loss_scale"] = sec.string("loss_scale", None, choices=("dynamic",))
    elif raw is not None:
        values["loss_scale"] = sec.number("loss_scale", None, limit=limits.LOSS_SCALE)
    for name in ("initial_loss_scale", "min_loss_scale"):
        values[name] = sec.number(name, d[name].default, limit=limits.LOSS_SCALE)
    values["loss_scale_window"] = sec.integer("loss_scale_window", d["loss_scale_window"].default,
                                              limit=limits.LOSS_SCALE_WINDOW)
    values["hysteresis"] = sec.integer("hysteresis", d["hysteresis"].default, limit=limits.HYSTERESIS)
    initial, minimum = values["initial_loss_scale"], values["min_loss_scale"]
    if initial is not None and minimum is not None and minimum > initial:
        problems.add(sec.at("min_loss_scale"), f"{minimum:g} is above initial_loss_scale {initial:g}; "
                     "min_loss_scale must not exceed it")
        values["min_loss_scale"] = None
    if isinstance(values["loss_scale"], float):
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
            if sec.has(name):
                problems.add(sec.at(name), f"applies to dynamic loss scaling only, but loss_scale is the static "
                             f"{values['loss_scale']:g}; remove it, or set loss_scale: dynamic")
                values[name] = None
    return values


def _inside(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or below it, as written (both relative to the job file, or both absolute)."""
    path, directory = os.path.normpath(os.path.expanduser(path)), os.path.normpath(os.path.expanduser(directory))
    if os.path.isabs(path) != os.path.isabs(directory):
        return False  # decided when the run resolves both against the job file (offload.swap.SwapDir)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep) or directory == "."


def _build(cls, sec: Section, **values):
    """`cls(**values)` after reporting unknown keys, or None when any value was bad."""
    sec.finish()
    if not sec.valid or any(v is None for v in values.values()):
        return None
    return cls(**values)
