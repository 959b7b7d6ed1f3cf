"""Megatron arguments -> heteroflow's `train:` section: batches, steps, the learning-rate schedule, Adam,
precision and data, with Megatron's defaults and rules."""

from __future__ import annotations

import re

from heteroflow.config.data import DEFAULT_SPLIT, MID_LEVEL_SURPLUS
from heteroflow.megatron.context import Context
from heteroflow.megatron.layout import MegatronLayout


def map_train(ctx: Context, layout: MegatronLayout) -> dict:
    """The `train:` section."""
    gbs = layout.global_batch_size
    precision = _precision(ctx)
    steps = _steps(ctx, gbs)
    lr = ctx.required("lr", "Megatron has no default learning rate")
    min_lr = ctx.value("min_lr")
    if lr is not None and min_lr is not None and min_lr > lr:
        ctx.error(f"min-lr {min_lr:g} must not exceed lr {lr:g} (Megatron asserts args.min_lr <= args.lr)")
    ctx.mark("lr", "mapped", f"train.lr = {lr:g}" if lr is not None else "")
    min_lr = _schedule(ctx, lr, min_lr, steps, gbs)
    warmup = _warmup(ctx, steps, gbs)
    wd = _weight_decay(ctx)
    values = {}
    for dest, field, heteroflow_default in (("adam_beta1", "adam_beta1", 0.9), ("adam_beta2", "adam_beta2", 0.95),
                                            ("adam_eps", "adam_eps", 1e-8), ("clip_grad", "grad_clip", 1.0)):
        values[field] = float(ctx.get(dest))
        note = "" if ctx.given(dest) or values[field] == heteroflow_default else \
            f" (Megatron's default; heteroflow's own would be {heteroflow_default:g})"
        ctx.mark_or_default(dest, "mapped", f"train.{field} = {values[field]:g}{note}")
    seed = ctx.get("seed")
    ctx.mark("seed", "mapped", f"train.seed = {seed}")
    _optimizer(ctx)
    train = {"global_batch_size": gbs, "micro_batch_size": layout.plan_micro_batch_size, "precision": precision,
             "steps": steps, "seed": seed, "lr": lr, "min_lr": min_lr, "warmup_steps": warmup, "weight_decay": wd,
             **values}
    train.update(_loss_scale(ctx, precision))
    data = _data(ctx)
    if data is not None:
        train["data"] = data
    train.update(_tensorboard(ctx))
    return train


def _tensorboard(ctx: Context) -> dict:
    """`--tensorboard-dir` and `--tensorboard-log-interval` -> `train.tensorboard_dir` / `tensorboard_log_interval`
    (rank 0 writes the step's scalars there, `heteroflow.runtime.tensorboard`)."""
    setting = ctx.args.setting("tensorboard_dir")
    if setting is None:
        ctx.mark("tensorboard_log_interval", "ignored", "no --tensorboard-dir: Megatron writes no TensorBoard logs")
        return {}
    if setting.unresolved:
        for dest in ("tensorboard_dir", "tensorboard_log_interval"):
            ctx.mark(dest, "ignored", f"the directory comes from {', '.join(setting.unresolved)}, which the script "
                                      "does not set: train.tensorboard_dir left unset")
        return {}
    path = str(setting.value)
    where = ", resolved against the job file's directory" if not path.startswith("/") else ""
    ctx.mark("tensorboard_dir", "mapped", f"train.tensorboard_dir = {path}: loss, lr, grad norm, loss scale, "
                                          f"throughput, per-stage times and memory from rank 0{where}")
    interval = ctx.value("tensorboard_log_interval")
    if interval is None:
        return {"tensorboard_dir": path}
    ctx.mark_or_default("tensorboard_log_interval", "mapped", f"train.tensorboard_log_interval = {int(interval)}")
    return {"tensorboard_dir": path, "tensorboard_log_interval": int(interval)}


def _precision(ctx: Context) -> str:
    fp16, bf16 = bool(ctx.get("fp16")), bool(ctx.get("bf16"))
    if fp16 and bf16:
        ctx.error("--fp16 and --bf16 cannot both be set (Megatron asserts not args.bf16 with --fp16)")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    ctx.mark("fp16", "mapped", f"train.precision = {precision}")
    ctx.mark("bf16", "mapped", f"train.precision = {precision}")
    if precision == "fp32":
        ctx.default("bf16", "mapped", "train.precision = fp32 (neither --bf16 nor --fp16)")
    return precision


_DYNAMIC = (("initial_loss_scale", "initial_loss_scale"), ("min_loss_scale", "min_loss_scale"),
            ("loss_scale_window", "loss_scale_window"), ("hysteresis", "hysteresis"))


def _loss_scale(ctx: Context, precision: str) -> dict:
    """Megatron's grad scaler: `--loss-scale` is a static scale under --fp16 or --bf16; else --fp16 scales
    dynamically with the other four flags (heteroflow's defaults are Megatron's, so only given values are
    written); bf16 without --loss-scale and fp32 scale nothing."""
    static = ctx.value("loss_scale")
    train: dict = {}
    if static is not None and precision == "fp32":
        ctx.mark("loss_scale", "ignored", "Megatron scales the loss only with --fp16 or --bf16")
    elif static is not None:
        if not 0 < static < float("inf"):
            ctx.error(f"{ctx.key('loss_scale')} {static:g} must be a finite positive number")
        train["loss_scale"] = static
        ctx.mark("loss_scale", "mapped", f"train.loss_scale = {static:g} (a static scale)")
    for dest, key in _DYNAMIC:
        if not ctx.given(dest):
            continue
        if static is not None or precision != "fp16":
            why = "--loss-scale sets a static scale" if static is not None else "it applies to --fp16 only"
            ctx.mark(dest, "ignored", f"dynamic loss-scaling setting, unused: {why}")
            continue
        value = ctx.value(dest)
        if value is None:
            continue
        integral = key in ("loss_scale_window", "hysteresis")
        if not value > 0 or value == float("inf") or (integral and float(value) != int(value)):
            ctx.error(f"{ctx.key(dest)} {value:g} must be a finite positive {'integer' if integral else 'number'}")
            continue
        train[key] = int(value) if integral else float(value)
        ctx.mark(dest, "mapped", f"train.{key} = {train[key]:g}")
    if precision == "fp16" and static is None:
        ctx.default("loss_scale", "mapped", "train.loss_scale = dynamic (fp16 without --loss-scale)",
                    value="dynamic")
    return train


def _steps(ctx: Context, gbs: int) -> int:
    iters, samples = ctx.value("train_iters"), ctx.value("train_samples")
    if iters and samples:
        ctx.error("--train-iters and --train-samples are exclusive (Megatron: expected iteration-based training)")
    if iters:
        for dest, zero in (("lr_decay_samples", None), ("lr_warmup_samples", 0), ("rampup_batch_size", None)):
            if ctx.get(dest) not in (None, zero):
                ctx.error(f"{ctx.key(dest)} with --train-iters: Megatron expects iteration-based training to use "
                          "iteration-based schedule arguments")
        ctx.mark("train_iters", "mapped", f"train.steps = {iters}")
        return iters
    if samples:
        for dest, zero in (("lr_decay_iters", None), ("lr_warmup_iters", 0)):
            if ctx.get(dest) not in (None, zero):
                ctx.error(f"{ctx.key(dest)} with --train-samples: Megatron expects sample-based schedule arguments")
        steps = max(samples // gbs, 1)
        ctx.mark("train_samples", "mapped" if samples % gbs == 0 else "approximated",
                 f"train.steps = {steps} ({samples} samples / global batch {gbs})")
        return steps
    if not ctx.errors:
        ctx.error("neither --train-iters nor --train-samples is given (Megatron needs one of them to train)")
    return 1


def _decay_steps(ctx: Context, steps: int, gbs: int) -> int:
    if ctx.get("lr_decay_iters"):
        return ctx.get("lr_decay_iters")
    if ctx.get("lr_decay_samples"):
        return max(ctx.get("lr_decay_samples") // gbs, 1)
    return steps


def _schedule(ctx: Context, lr: float | None, min_lr: float | None, steps: int, gbs: int) -> float | None:
    style = ctx.get("lr_decay_style")
    decay = _decay_steps(ctx, steps, gbs)
    if lr is None or min_lr is None:
        return min_lr
    if style == "constant":
        ctx.mark("lr_decay_style", "mapped", f"constant learning rate: train.min_lr = lr = {lr:g}")
        ctx.mark("min_lr", "ignored", "no decay with --lr-decay-style constant")
        for dest in ("lr_decay_iters", "lr_decay_samples"):
            ctx.mark(dest, "ignored", "no decay with --lr-decay-style constant")
        return lr
    ctx.mark_or_default("min_lr", "mapped", f"train.min_lr = {min_lr:g}")
    if style == "cosine":
        ctx.mark("lr_decay_style", "mapped", "warmup then cosine decay to train.min_lr, as heteroflow")
    else:
        ctx.mark_or_default("lr_decay_style", "approximated",
                            f"heteroflow decays with a cosine; Megatron's {style} decay differs in shape")
    for dest in ("lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        ctx.mark(dest, "approximated" if style == "WSD" else "ignored",
                 "part of the WSD schedule, approximated by a cosine" if style == "WSD" else "used only by WSD decay")
    detail = f"decay over all {steps} steps, as heteroflow"
    disposition = "mapped"
    if decay != steps:
        disposition = "approximated"
        detail = (f"Megatron decays over {decay} steps then holds min_lr; heteroflow's cosine ends at the last of "
                  f"{steps} steps")
    ctx.mark("lr_decay_iters", disposition, detail)
    ctx.mark("lr_decay_samples", disposition, detail)
    return min_lr


def _warmup(ctx: Context, steps: int, gbs: int) -> int:
    fraction = ctx.get("lr_warmup_fraction")
    iters, samples = ctx.get("lr_warmup_iters") or 0, ctx.get("lr_warmup_samples") or 0
    if fraction is not None and (iters or samples):
        ctx.error("can only specify one of lr-warmup-fraction and lr-warmup-iters / lr-warmup-samples (Megatron)")
    if fraction is not None:
        warmup = int(round(fraction * _decay_steps(ctx, steps, gbs)))
        ctx.mark("lr_warmup_fraction", "mapped", f"train.warmup_steps = {warmup} ({fraction:g} of the decay steps)")
    elif samples:
        warmup = int(round(samples / gbs))
        ctx.mark("lr_warmup_samples", "mapped" if samples % gbs == 0 else "approximated",
                 f"train.warmup_steps = {warmup} ({samples} samples / global batch {gbs})")
    else:
        warmup = iters
        ctx.mark_or_default("lr_warmup_iters", "mapped", f"train.warmup_steps = {warmup}")
    ctx.mark("lr_warmup_samples", "mapped", f"train.warmup_steps = {warmup}")
    init = ctx.get("lr_warmup_init")
    if init:
        ctx.mark("lr_warmup_init", "approximated", f"heteroflow warms up from 0, Megatron from {init:g}")
    else:
        ctx.mark("lr_warmup_init", "mapped", "warmup from 0, as heteroflow")
    if ctx.given("warmup"):
        ctx.error("--warmup argument is no longer valid, use --lr-warmup-fraction instead (Megatron)")
    return warmup


def _weight_decay(ctx: Context) -> float:
    wd = float(ctx.get("weight_decay"))
    style = ctx.get("weight_decay_incr_style")
    start, end = ctx.get("start_weight_decay"), ctx.get("end_weight_decay")
    if style == "constant":
        if start is not None or end is not None:
            ctx.error("--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine "
                      "(Megatron asserts they are None for constant)")
        ctx.mark("weight_decay_incr_style", "mapped", "constant weight decay, as heteroflow")
        note = "" if ctx.given("weight_decay") else " (Megatron's default; heteroflow's own would be 0.1)"
        ctx.mark_or_default("weight_decay", "mapped", f"train.weight_decay = {wd:g}{note}")
        return wd
    if start is None or end is None:
        ctx.error(f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay (Megatron)")
        return wd
    detail = f"heteroflow keeps weight decay constant at the final value {end:g}; Megatron ramps {start:g} -> {end:g}"
    for dest in ("weight_decay_incr_style", "start_weight_decay", "end_weight_decay"):
        ctx.mark(dest, "approximated", detail)
    ctx.mark("weight_decay", "ignored", "replaced by --start/--end-weight-decay")
    return float(end)


def _optimizer(ctx: Context) -> None:
    name = ctx.get("optimizer")
    if name == "adam":
        ctx.mark_or_default("optimizer", "mapped", "AdamW (Megatron's adam uses decoupled weight decay), as heteroflow")
    else:
        ctx.mark("optimizer", "approximated", f"heteroflow trains with AdamW, not {name}")
    for dest in ("decoupled_lr", "decoupled_min_lr"):
        if ctx.get(dest) is not None:
            ctx.mark(dest, "approximated", "heteroflow uses one learning rate for every layer; Megatron gives the "
                                           "input and output layers their own")
    if ctx.get("sft"):
        ctx.mark("sft", "approximated", "heteroflow trains on a token stream; Megatron's SFT prompt formatting and "
                                        "loss masking are not reproduced")


def _data(ctx: Context) -> dict | None:
    """`--data-path` (with its blend weights and `--split`) or `--train-data-path` -> `train.data.prefixes`:
    heteroflow draws the samples as Megatron's GPTDataset / BlendedDataset do (same seed, same samples)."""
    if ctx.get("mock_data"):
        ctx.mark("mock_data", "mapped", "train.data unset: heteroflow's built-in corpus")
    for dest in ("data_path", "train_data_path"):
        setting = ctx.args.setting(dest)
        if setting is None:
            continue
        if setting.unresolved:
            ctx.mark(dest, "ignored", f"the path comes from {', '.join(setting.unresolved)}, which the script does "
                                      "not set: train.data left unset (pass it to the importer or set train.data)")
            continue
        paths = [str(p) for p in setting.value or []]
        if not paths:
            ctx.mark(dest, "ignored", "no dataset prefix given: train.data left unset")
            continue
        # --train-data-path is the train split's own blend: all of its documents (Megatron's split (0, 1)).
        # Megatron reads the shares as every number in the text (quotes and spaces do not matter).
        split = "100,0,0" if dest == "train_data_path" else \
            ",".join(re.findall(r"[.0-9]+", str(ctx.get("split") or DEFAULT_SPLIT))) or str(ctx.get("split"))
        prefixes = paths[1::2] if _weighted(paths) else paths
        relative = any(not p.startswith("/") for p in prefixes)
        where = ", relative prefixes resolved against the job file's directory" if relative else ""
        ctx.mark(dest, "mapped", f"train.data.prefixes = {' '.join(paths)}: Megatron indexed datasets, samples "
                                 f"drawn as Megatron's GPTDataset{' and BlendedDataset' if len(paths) > 1 else ''} "
                                 f"with train.seed{where}")
        if dest == "data_path":
            ctx.mark_or_default("split", "mapped", f"train.data.split = {split} (heteroflow trains on the first share)")
        for flag, effect in _SAMPLE_CHANGES:
            if ctx.get(flag) not in (None, False, MID_LEVEL_SURPLUS):
                ctx.mark(flag, "approximated", effect)
        return {"prefixes": paths, "split": split}
    return None


_SAMPLE_CHANGES = (
    ("mid_level_dataset_surplus", "heteroflow builds blends with Megatron's default surplus 0.005; with another "
                                  "value Megatron's blended samples differ"),
    ("eod_mask_loss", "heteroflow computes the loss on every token, end-of-document tokens included"),
    ("reset_position_ids", "heteroflow never resets positions at document ends"),
    ("reset_attention_mask", "heteroflow never masks attention across document ends"),
)
"""Megatron data options that change what a step trains on, which heteroflow does not reproduce."""


def _weighted(paths: list[str]) -> bool:
    """Whether `--data-path` is `w1 p1 w2 p2 ...` (Megatron reads weights when every first of a pair is a number)."""
    if len(paths) % 2:
        return False
    try:
        [float(w) for w in paths[0::2]]
    except ValueError:
        return False
    return True