"""ZeRO-3 with offloaded optimizer state and/or parameters (ZeRO-Infinity, `offload.zero3`) on emulated CPU ranks:
the one-device reference's losses and weights, tier bytes per rank as the planner prices them, and checkpoints
that resume under a plan without offload."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import parse_job
from heteroflow.layout import ParallelLayout
from heteroflow.offload.optimizer import ADAM_ENV
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.stagemap.memory import memory_parts, offloaded_optimizer_bytes, stage_memory_bytes
from heteroflow.testing.training import check_against_reference, run_training

STEPS = 3
CLUSTER = {"nodes": [{"name": "a", "device": "cpu", "count": 4}]}
MODEL = {"preset": "micro-llama", "num_layers": 4, "tie_embeddings": True}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}
PLANS = {
    # ZeRO-3 + optimizer on cpu, at both ends of the tied embedding
    "opt-cpu": [{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 3, "offload": {"optimizer": "cpu"}},
                {"devices": ["a:2-3"], "layers": 2, "dp": 2, "zero": 3, "offload": {"optimizer": "cpu"}}],
    # ZeRO-3 + params and optimizer on ssd: dp 2, then tp 2 x dp 2 with sp
    "ssd-dp2": [{"devices": ["a:0-1"], "layers": 4, "dp": 2, "zero": 3,
                 "offload": {"optimizer": "ssd", "params": "ssd"}}],
    "ssd-tp2": [{"devices": ["a:0-3"], "layers": 4, "tp": 2, "dp": 2, "sp": True, "zero": 3,
                 "offload": {"optimizer": "ssd", "params": "ssd"}}],
    # ZeRO-3 over cp 2 x dp 2 with params (and optimizer) on cpu
    "cp2-params-cpu": [{"devices": ["a:0-3"], "layers": 4, "cp": 2, "dp": 2, "zero": 3,
                        "offload": {"optimizer": "cpu", "params": "cpu"}}],
}
PLAIN = [{"devices": ["a:0-1"], "layers": 4, "dp": 2, "zero": 1}]


def _job(stages: list[dict], *, tmp, steps: int = STEPS, checkpoint: dict | None = None, precision: str = "fp32"):
    train = {**TRAIN, "steps": steps, "offload_dir": str(tmp), "precision": precision}
    if checkpoint:
        train["checkpoint"] = checkpoint
    return parse_job({"cluster": CLUSTER, "model": MODEL, "train": train,
                      "plan": {"schedule": "1f1b", "micro_batch_size": 4, "stages": stages}})


def _run(job, *, data_dir: str, steps: int = STEPS, resume: bool = False):
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=300, resume=resume)
    return run_training(args, timeout_s=600, env={ADAM_ENV: "torch"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("data"))
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN})
    return data_dir, train_reference(job, steps=STEPS, data_dir=data_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_zero_infinity_trains_like_one_device(reference, tmp_path, name):
    data_dir, (ref_losses, ref_weights) = reference
    job = _job(PLANS[name], tmp=tmp_path)
    results = _run(job, data_dir=data_dir)
    check_against_reference(results, ref_losses, ref_weights)
    # Per rank: the optimizer tier holds the planner's figure (fp32 master + moments, 1/(cp x dp) of the stage's);
    # on the device, the planner's parameter bytes are the shard this rank keeps there plus the gathered window
    # (the planner's figure with the parameters offloaded).
    stage_of = [k for k, stage in enumerate(job.plan.stages) for _ in range(stage.layout.num_devices)]
    for rank, result in enumerate(results):
        k = stage_of[rank]
        lay = job.plan.stages[k].layout
        first, last = job.plan.layer_ranges()[k]
        parts = memory_parts(job.model, tp=lay.tp, sp=lay.sp, tokens=1.0, precision="fp32", capacity_gib=0.0)
        planned = offloaded_optimizer_bytes(parts, lay).at(last - first, 1, k == 0, k == len(job.plan.stages) - 1)
        assert result.offload["optimizer_tier_bytes"] == pytest.approx(planned, rel=0.03)
        device = result.offload["device_bytes"]
        assert device["optimizer"] == device["grads"] == 0
        window = replace(lay, offload=replace(lay.offload, params="cpu"))
        assert device["params"] + _planned(job, k, window)["params"] == pytest.approx(_planned(job, k, lay)["params"],
                                                                                     rel=0.03)
        assert _planned(job, k, lay)["optimizer"] == 0
        if lay.offload.params == "ssd":  # the shards went to their swap files after every step and came back
            assert result.offload["param_swap_bytes_read"] >= (STEPS - 1) * result.offload["param_tier_bytes"] > 0


def _planned(job, k: int, lay: ParallelLayout) -> dict[str, float]:
    first, last = job.plan.layer_ranges()[k]
    return stage_memory_bytes(job.model, lay, precision="fp32", micro_batch_size=4, schedule="1f1b",
                              num_stages=len(job.plan.stages), stage=k, num_micro_batches=2, layers=last - first)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("opt-cpu", "plain"), ("ssd-dp2", "plain"), ("cp2-params-cpu", "plain"),
                                        ("plain", "ssd-tp2")])
def test_zero_infinity_checkpoints_move_to_and_from_plans_without_offload(reference, tmp_path, first, then):
    """Steps 0-1 under one plan, step 2 under the other (ZeRO-1 with everything on the device, or ZeRO-Infinity):
    the reference's losses."""
    data_dir, (ref_losses, _) = reference
    plans = {**PLANS, "plain": PLAIN}
    ckpt = {"dir": str(tmp_path / "ckpt"), "interval": 2, "keep": 1}
    before = _run(_job(plans[first], tmp=tmp_path / "swap", steps=2, checkpoint=ckpt), data_dir=data_dir, steps=2)
    after = _run(_job(plans[then], tmp=tmp_path / "swap", checkpoint=ckpt), data_dir=data_dir, resume=True)
    assert after[0].first_step == 2
    for step, (got, want) in enumerate(zip(list(before[0].losses) + list(after[0].losses), ref_losses)):
        assert got == pytest.approx(want, rel=1e-5), f"step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("precision,rel", [("bf16", 1e-4), ("fp16", 1e-6)])
def test_zero_infinity_in_16_bits_follows_zero3_on_the_device(reference, tmp_path, precision, rel):
    """bf16 / fp16 (with loss scaling and its skipped steps): the losses of the same ZeRO-3 stage without offload
    (bf16 rounds its gradient shards to bf16 before the fp32 accumulator, hence the looser bound)."""
    data_dir = reference[0]
    offloaded = [{"devices": ["a:0-1"], "layers": 4, "dp": 2, "zero": 3,
                  "offload": {"optimizer": "cpu", "params": "ssd"}}]
    losses = []
    for stages in (offloaded, [{k: v for k, v in offloaded[0].items() if k != "offload"}]):
        job = _job(stages, tmp=tmp_path, precision=precision)
        losses.append(_run(job, data_dir=data_dir)[0].losses)
    for got, want in zip(*losses):
        assert got == pytest.approx(want, rel=rel)
