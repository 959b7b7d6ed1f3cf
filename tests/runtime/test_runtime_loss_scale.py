"""fp16 with loss scaling and a precision per stage, run by the runtime on emulated CPU ranks.

CPU autocast in fp16 rounds matmul inputs and outputs to fp16 as a GPU does (torch 2.13), so gradients
below fp16's subnormal range (about 6e-8) flush to zero in the backward and at fp16 stage boundaries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from heteroflow.config import parse_job
from heteroflow.runtime.metrics import read_step_records
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing import run_ranks

MODEL = {"preset": "micro-llama"}
TRAIN = {"global_batch_size": 16, "micro_batch_size": 8, "steps": 24, "lr": 3e-3, "min_lr": 3e-4,
         "warmup_steps": 2, "grad_clip": 1.0}
TWO_NODES = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                       {"name": "npu-0", "device": "ascend-910b2", "count": 2}]}
TWO_STAGES = {"schedule": "1f1b", "micro_batch_size": 8, "stages": [
    {"devices": ["gpu-0:0"], "layers": 2}, {"devices": ["npu-0:0"], "layers": 2}]}


def _rank(rank: int, world_size: int, args: WorkerArgs):
    return run_worker(args)


def train_run(data_dir, *, train: dict, plan: dict = TWO_STAGES, cluster: dict = TWO_NODES, steps: int,
              metrics: Path | None = None, ckpt: Path | None = None, resume: bool = False,
              env: dict | None = None):
    """Run the plan on emulated ranks; rank 0's result and the metrics records (when asked for)."""
    train = {**TRAIN, **train, "steps": steps}
    if ckpt is not None:
        train["checkpoint"] = {"dir": str(ckpt), "interval": steps, "keep": 5}
    job = parse_job({"cluster": cluster, "model": MODEL, "train": train, "plan": plan})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, show_progress=False,
                      timeout_s=120, metrics_path=str(metrics) if metrics else None, resume=resume)
    results = run_ranks(_rank, job.plan.num_devices, args, timeout_s=300, env=env)
    records = read_step_records(metrics) if metrics else []
    return results[0], records


def max_rel_diff(got, want) -> float:
    return max(abs(g - w) / w for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


@pytest.mark.slow
def test_fp16_with_dynamic_scaling_tracks_fp32_where_unscaled_fp16_does_not(data_dir, tmp_path):
    """micro-llama's gradients are large (512 tokens a step): at loss scale 1 they stay above fp16's
    subnormal range and fp16 tracks fp32 unscaled. A real batch has 1e5 to 1e6 tokens a step, and the loss is
    their mean: its gradients are that much smaller. A static loss scale of 2**-8 gives this model the
    gradients of a 256 times larger batch (131 k tokens) without any scaling up; there fp16 flushes many of
    them (the backward of the fp16 matmuls and the fp16 boundary) and falls behind fp32 by about 5% of the loss
    by step 20. Dynamic scaling starting at 2**16 multiplies the same gradients back into fp16's normal range
    and tracks fp32 within 2e-3 relative (measured: 3e-5): fp16's rounding (2**-11 relative per operation)
    moves each step's update a little, Adam's normalisation keeps that from compounding over 24 steps."""
    steps = 24
    fp32, _ = train_run(data_dir, train={"precision": "fp32"}, steps=steps)
    scaled, records = train_run(data_dir, train={"precision": "fp16", "initial_loss_scale": 2.0**16}, steps=steps,
                                metrics=tmp_path / "scaled.jsonl")
    small_grads, _ = train_run(data_dir, train={"precision": "fp16", "loss_scale": 2.0**-8}, steps=steps)
    assert fp32.losses[-1] < fp32.losses[0] - 1.0  # it trains
    scaled_diff, unscaled_diff = max_rel_diff(scaled.losses, fp32.losses), max_rel_diff(small_grads.losses, fp32.losses)
    print(f"max loss rel diff to fp32: dynamic scaling {scaled_diff:.1e}, small gradients unscaled {unscaled_diff:.1e}")
    assert scaled_diff < 2e-3
    assert unscaled_diff > 2e-2 and small_grads.losses[-1] > fp32.losses[-1] + 0.1
    assert [r["loss_scale"] for r in records] == [2.0**16] * steps and not any(r["skipped"] for r in records)


EIGHT_RANKS = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                         {"name": "npu-0", "device": "ascend-910b2", "count": 2},
                         {"name": "dcu-0", "device": "hygon-bw1000", "count": 4}]}
THREE_STAGES = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [
    {"devices": ["gpu-0"], "layers": 1, "tp": 2, "dp": 1},
    {"devices": ["npu-0"], "layers": 2, "tp": 1, "dp": 2},  # ranks 2 and 3
    {"devices": ["dcu-0"], "layers": 1, "tp": 2, "dp": 2, "zero": 1}]}


def checkpoint_tensors(step_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank file's tensors (parameters, fp32 masters and Adam moments), by file."""
    return {path.name: load_file(path) for path in sorted(step_dir.glob("rank-*.safetensors"))}


def metadata(step_dir: Path) -> dict:
    return json.loads((step_dir / "metadata.json").read_text())


@pytest.mark.slow
def test_an_inf_on_one_rank_of_a_middle_stage_skips_the_step_everywhere(data_dir, tmp_path):
    """Rank 3 (stage 1 of 3, dp rank 1) finds an inf at step 1: all 8 ranks skip that step. After it every
    rank's parameters, masters and Adam moments are bit for bit those after step 0, the optimizer has
    counted one step, and the scale has halved once (hysteresis 1)."""
    train = {"precision": "fp16", "global_batch_size": 8, "micro_batch_size": 4, "hysteresis": 1,
             "initial_loss_scale": 2.0**16}
    common = dict(train=train, plan=THREE_STAGES, cluster=EIGHT_RANKS)
    train_run(data_dir, steps=1, ckpt=tmp_path / "one", **common)
    _, records = train_run(data_dir, steps=2, ckpt=tmp_path / "skipped", metrics=tmp_path / "skipped.jsonl",
                           env={"HETEROFLOW_INJECT_GRAD": "inf@3:1"}, **common)
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in records] == [(0, False, 2.0**16), (1, True, 2.0**16)]
    assert records[1]["grad_norm"] is None  # not finite: written as null
    before, after = tmp_path / "one" / "step-000001", tmp_path / "skipped" / "step-000002"
    want, got = checkpoint_tensors(before), checkpoint_tensors(after)
    assert len(got) == 8 and got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for key, tensor in want[name].items():
            assert torch.equal(got[name][key], tensor), f"{name} {key}"
    assert metadata(before)["optimizer_steps"] == metadata(after)["optimizer_steps"] == 1
    assert metadata(after)["loss_scaler"] == {"scale": 2.0**15, "growth_tracker": 0, "hysteresis_tracker": 0}


@pytest.mark.slow
def test_a_bf16_stage_and_an_fp16_stage_train_like_the_fp32_reference(data_dir):
    """Stage 0 on an A100 in bf16, stage 1 (tp 2) on Ascend 910A cards, which have no bf16, in fp16: the
    boundary carries bf16 activations forward and fp16 gradients (with the loss scale) back, each side
    casting to its own dtype. bf16 keeps 8 bits of mantissa: one rounding moves a value by up to 2**-9 (2e-3)
    relative; the loss, a mean over 512 tokens, stays within 3e-3 relative of the one-device fp32 reference
    over 12 steps (measured: 2e-4)."""
    steps = 12
    cluster = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 1},
                         {"name": "npu-0", "device": "ascend-910a", "count": 2}]}
    plan = {"schedule": "1f1b", "micro_batch_size": 8, "stages": [
        {"devices": ["gpu-0"], "layers": 2},
        {"devices": ["npu-0"], "layers": 2, "tp": 2, "precision": "fp16"}]}
    train = {"precision": "bf16", "initial_loss_scale": 2.0**16}
    mixed, _ = train_run(data_dir, train=train, plan=plan, cluster=cluster, steps=steps)
    job = parse_job({"cluster": cluster, "model": MODEL, "train": {**TRAIN, **train, "steps": steps}})
    reference, _ = train_reference(job, steps=steps, data_dir=data_dir)
    diff = max_rel_diff(mixed.losses, reference)
    print(f"max loss rel diff, bf16 + fp16 stages vs fp32 reference: {diff:.1e}")
    assert mixed.losses[-1] < mixed.losses[0] - 0.5
    assert diff < 3e-3


@pytest.mark.slow
def test_resume_under_another_plan_restores_the_scale_and_hysteresis(data_dir, tmp_path):
    """Two overflows (hysteresis 2) halve the scale once and use up the hysteresis; a clean step follows and
    the run stops. Resumed under a three-stage plan, one more overflow halves the scale at once: the tracker
    came back as 0 (a fresh one would tolerate it), and the scale came back as 2**15 (not the initial)."""
    ckpt = tmp_path / "ckpt"
    train = {"precision": "fp16", "initial_loss_scale": 2.0**16, "hysteresis": 2}
    train_run(data_dir, train=train, steps=3, ckpt=ckpt, env={"HETEROFLOW_INJECT_GRAD": "inf@1:0,inf@0:1"})
    assert metadata(ckpt / "step-000003")["loss_scaler"] == {"scale": 2.0**15, "growth_tracker": 1,
                                                             "hysteresis_tracker": 0}
    other = {"schedule": "gpipe", "micro_batch_size": 8, "stages": [
        {"devices": ["gpu-0:0"], "layers": 1}, {"devices": ["gpu-0:1"], "layers": 2},
        {"devices": ["npu-0"], "layers": 1, "dp": 2}]}
    _, records = train_run(data_dir, train=train, plan=other, steps=5, ckpt=ckpt, resume=True,
                           metrics=tmp_path / "resumed.jsonl", env={"HETEROFLOW_INJECT_GRAD": "inf@2:3"})
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in records] == \
        [(3, True, 2.0**15), (4, False, 2.0**14)]
    assert metadata(ckpt / "step-000005")["loss_scaler"] == {"scale": 2.0**14, "growth_tracker": 1,
                                                             "hysteresis_tracker": -1}


@pytest.mark.slow
def test_a_skipped_step_drops_the_offloaded_stages_gradients(data_dir, tmp_path):
    """A stage whose optimizer state lives on the host accumulates gradients there: a skipped step must
    forget them, or the inf would poison the next step too (and every one after it)."""
    plan = {**TWO_STAGES, "stages": [TWO_STAGES["stages"][0],
                                     {**TWO_STAGES["stages"][1], "offload": {"optimizer": "cpu"}}]}
    train = {"precision": "fp16", "initial_loss_scale": 2.0**16, "hysteresis": 1, "offload_dir": str(tmp_path)}
    _, records = train_run(data_dir, train=train, plan=plan, steps=3, metrics=tmp_path / "m.jsonl",
                           env={"HETEROFLOW_INJECT_GRAD": "inf@1:1", "HETEROFLOW_CPU_ADAM": "torch"})
    assert [(r["skipped"], r["loss_scale"]) for r in records] == [(False, 2.0**16), (True, 2.0**16),
                                                                  (False, 2.0**15)]


def _rank_with_overflow_limit(rank: int, world_size: int, args: WorkerArgs, limit: int):
    import heteroflow.runtime.worker as worker

    worker.MAX_STUCK_OVERFLOWS = limit  # this rank's process only
    return run_worker(args)


@pytest.mark.slow
def test_overflows_that_no_back_off_can_cure_are_divergence(data_dir):
    """At a static scale every overflow is skipped, but a run of them in a row (20 by default, 3 here)
    stops training with a message that says why; a clean step in between starts the count again."""
    from heteroflow.testing.multiproc import MultiprocError

    job = parse_job({"cluster": TWO_NODES, "model": MODEL, "plan": TWO_STAGES,
                     "train": {**TRAIN, "precision": "fp16", "loss_scale": 1, "steps": 6}})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=6, data_dir=data_dir, show_progress=False,
                      timeout_s=120)
    with pytest.raises(MultiprocError, match="training diverged: the gradients held an inf or nan in 3 steps in "
                                             "a row up to step 4, at its static loss scale 1"):
        run_ranks(_rank_with_overflow_limit, 2, args, 3, timeout_s=300,
                  env={"HETEROFLOW_INJECT_GRAD": "inf@0:0,inf@1:2,nan@1:3,inf@0:4"})
