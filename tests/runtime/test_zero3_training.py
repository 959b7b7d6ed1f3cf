"""ZeRO-3 stages (FSDP2 per block over the stage's dp group) train like the single-process reference, hold 1/dp
of their parameters between steps, and checkpoint into the layout-independent format that other plans resume."""

from __future__ import annotations

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing import run_ranks
from heteroflow.testing.training import assemble_weights, check_against_reference, train_rank

STEPS = 3
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 2},
                     {"name": "dcu-0", "device": "hygon-bw1000", "count": 4}]}
MODEL = {"preset": "micro-llama", "num_layers": 5}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}

DP4 = {"micro_batch_size": 4, "stages": [  # one stage, dp 4: an embedding tied on one stage (one FSDP unit)
    {"devices": ["dcu-0"], "layers": 5, "tp": 1, "dp": 4, "zero": 3}]}
DP2_TP2 = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [  # ZeRO-3 at both ends of a tied embedding
    {"devices": ["npu-0"], "layers": 2, "tp": 1, "dp": 2, "zero": 3},
    {"devices": ["dcu-0"], "layers": 3, "tp": 2, "dp": 2, "sp": True, "zero": 3, "recompute": "full"}]}
MIXED = {"schedule": "gpipe", "micro_batch_size": 4, "stages": [  # tied between a ZeRO-1 and a ZeRO-3 stage
    {"devices": ["gpu-0"], "layers": 3, "tp": 2, "dp": 1},
    {"devices": ["npu-0"], "layers": 2, "tp": 1, "dp": 2, "zero": 3, "recompute": "selective"}]}




def _run(job_data: dict, plan: dict, *, steps: int, data_dir: str, resume: bool = False):
    job = parse_job({**job_data, "plan": plan})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=120, resume=resume)
    return run_ranks(train_rank, job.plan.num_devices, args, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("plan,tie", [(DP4, True), (DP2_TP2, True), (MIXED, True)], ids=["dp4", "dp2-tp2", "mixed"])
def test_zero3_plan_matches_single_process(tmp_path, plan, tie):
    data_dir = str(tmp_path / "data")
    job_data = {"cluster": CLUSTER, "model": {**MODEL, "tie_embeddings": tie}, "train": TRAIN}
    ref_losses, ref_weights = train_reference(parse_job(job_data), steps=STEPS, data_dir=data_dir)
    results = _run(job_data, plan, steps=STEPS, data_dir=data_dir)
    check_against_reference(results, ref_losses, ref_weights)


ZERO1 = {"micro_batch_size": 4, "stages": [
    {"devices": ["gpu-0"], "layers": 4, "tp": 1, "dp": 2, "zero": 1},
    {"devices": ["npu-0:0-0"], "layers": 1, "tp": 1, "dp": 1}]}


@pytest.mark.slow
@pytest.mark.parametrize("plan_a,plan_b", [(DP2_TP2, ZERO1), (ZERO1, DP4)], ids=["zero3-to-zero1", "zero1-to-zero3"])
def test_zero3_checkpoints_resume_across_zero_stages(tmp_path, plan_a, plan_b):
    """Steps 0-1 under plan A, then steps 2-3 under plan B: the losses of an uninterrupted run."""
    data_dir, ckpt_dir = str(tmp_path / "data"), tmp_path / "ckpt"
    steps, stop_at = 4, 2
    job_data = {"cluster": CLUSTER, "model": {**MODEL, "tie_embeddings": True},
                "train": {**TRAIN, "steps": steps, "checkpoint": {"dir": str(ckpt_dir), "interval": 2, "keep": 1}}}
    ref_losses, ref_weights = train_reference(parse_job(job_data), steps=steps, data_dir=data_dir)
    first = _run(job_data, plan_a, steps=stop_at, data_dir=data_dir)
    resumed = _run(job_data, plan_b, steps=steps, data_dir=data_dir, resume=True)
    assert resumed[0].first_step == stop_at
    losses = list(first[0].losses) + list(resumed[0].losses)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert got == pytest.approx(want, rel=1e-5), f"step {step}"
    weights = assemble_weights(resumed)
    if "head.weight" in weights:
        torch.testing.assert_close(weights.pop("head.weight"), weights["embed.weight"], rtol=0, atol=0)
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero3_in_16_bit_follows_zero1(tmp_path, precision):
    """16-bit ZeRO-3 (weights gathered in that dtype; fp16 with dynamic loss scaling) takes the steps ZeRO-1 takes:
    the same skipped steps and scales, losses equal up to 16-bit rounding. (At a scale near fp16's limit ZeRO-3
    overflows sooner: its embedding and norm gradients are fp16 too, where autocast keeps ZeRO-1's in fp32.)"""
    from heteroflow.runtime.metrics import read_step_records

    train = {**TRAIN, "precision": precision, "steps": 4}
    if precision == "fp16":
        train.update(loss_scale="dynamic", initial_loss_scale=2.0 ** 10, loss_scale_window=2)
    job_data = {"cluster": CLUSTER, "model": MODEL, "train": train}
    records = {}
    for zero in (1, 3):
        plan = {"micro_batch_size": 4, "stages": [{"devices": ["npu-0"], "layers": 5, "tp": 1, "dp": 2, "zero": zero}]}
        job = parse_job({**job_data, "plan": plan})
        metrics = tmp_path / f"zero{zero}.jsonl"
        args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=4, data_dir=str(tmp_path / "data"),
                          metrics_path=str(metrics), show_progress=False, timeout_s=120)
        run_ranks(train_rank, job.plan.num_devices, args, timeout_s=300)
        records[zero] = read_step_records(metrics)
    for zero1, zero3 in zip(records[1], records[3]):
        assert zero3.get("skipped") == zero1.get("skipped") and zero3.get("loss_scale") == zero1.get("loss_scale")
        assert zero3["loss"] == pytest.approx(zero1["loss"], rel=5e-4)
    assert records[3][-1]["loss"] < records[3][0]["loss"]
