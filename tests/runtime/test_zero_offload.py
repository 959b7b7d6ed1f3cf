"""ZeRO 1/2 with the optimizer state offloaded (ZeRO-Offload) run on emulated CPU ranks: the same losses and
weights as the plan with the state on the device, the one-device reference's losses, 1/dp of the state per rank
in the tier, checkpoints that move to a plan without offload, and fp16's skipped steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.offload.optimizer import ADAM_ENV
from heteroflow.runtime.metrics import read_step_records
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.stagemap.memory import memory_parts, offloaded_optimizer_bytes
from heteroflow.testing.training import assemble_weights, assert_weights_close, run_training

STEPS = 3
CLUSTER = {"nodes": [{"name": "a", "device": "cpu", "count": 4}]}
MODEL = {"preset": "micro-llama", "num_layers": 4, "tie_embeddings": True}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}
PLANS = {  # two stages of dp 2 (the tied embedding spans them), or one stage of tp 2 x dp 2
    "A": [{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1, "offload": {"optimizer": "cpu"}},
          {"devices": ["a:2-3"], "layers": 2, "dp": 2, "zero": 2, "offload": {"optimizer": "ssd"}}],
    "B": [{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1, "offload": {"optimizer": "ssd"}},
          {"devices": ["a:2-3"], "layers": 2, "dp": 2, "zero": 2, "offload": {"optimizer": "cpu"}}],
    "T": [{"devices": ["a:0-3"], "layers": 4, "tp": 2, "dp": 2, "sp": True, "zero": 2,
           "offload": {"optimizer": "ssd"}}],
}


def _plan(name: str) -> dict:
    """`PLANS[name]`, or with `-none` the same stages with everything on the device."""
    variant, _, none = name.partition("-")
    stages = [{k: v for k, v in stage.items() if not (none and k == "offload")} for stage in PLANS[variant]]
    return {"schedule": "1f1b", "micro_batch_size": 4, "stages": stages}


def _run(name: str, *, data_dir: str, tmp: Path, steps: int = STEPS, train: dict | None = None,
         resume: bool = False, metrics: Path | None = None, env: dict | None = None):
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "plan": _plan(name),
                     "train": {**TRAIN, **(train or {}), "steps": steps, "offload_dir": str(tmp)}})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=300, resume=resume,
                      metrics_path=str(metrics) if metrics else None)
    return job, run_training(args, timeout_s=600, env={ADAM_ENV: "torch", **(env or {})})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("data"))
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            if name == "reference":
                job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN})
                cache[name] = train_reference(job, steps=STEPS, data_dir=data_dir)
            else:
                cache[name] = _run(name, data_dir=data_dir, tmp=tmp_path_factory.mktemp(f"swap-{name}"))[1]
        return cache[name]

    get.data_dir = data_dir
    return get


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["A", "T"])
def test_zero_offload_trains_bit_for_bit_like_the_same_zero_on_the_device(runs, variant):
    offloaded, base = runs(variant), runs(f"{variant}-none")
    assert offloaded[0].losses == base[0].losses
    want, got = assemble_weights(base), assemble_weights(offloaded)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ranks_per_stage = [(s["zero"], s["dp"] * s.get("tp", 1)) for s in PLANS[variant]]
    assert [r.offload["zero"] for r in offloaded] == [zero for zero, n in ranks_per_stage for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["A", "T"])
def test_zero_offload_reproduces_the_single_process_losses(runs, variant):
    ref_losses, ref_weights = runs("reference")
    results = runs(variant)
    for got, want in zip(results[0].losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert results[0].losses[-1] < results[0].losses[0]
    weights = assemble_weights(results)
    for n, want in ref_weights.items():
        assert_weights_close(weights[n], want, tol=1e-5, name=n)


@pytest.mark.slow
def test_each_dp_rank_keeps_its_share_of_the_state_in_the_tier(runs):
    """Plan A: the fp32 master and two moments (12 bytes per parameter) of a stage's 1/dp on each dp rank."""
    results = runs("A")
    for stage, ranks in ((0, results[0:2]), (1, results[2:4])):
        numel = sum(local.numel() for local, _ in ranks[0].state.values())
        held = [r.offload["optimizer_tier_bytes"] for r in ranks]
        assert sum(held) == 12 * numel, stage
        assert all(abs(h - 12 * numel / 2) <= 12 for h in held), (stage, held)  # the flat buffer's padding


@pytest.mark.slow
def test_a_zero1_ssd_checkpoint_resumes_under_a_plan_without_offload(runs, tmp_path):
    """Saved after 2 steps under B (ZeRO-1 with the state on SSD; ZeRO-2 with it on the CPU), resumed for the
    third step under T without offload (one stage, tp 2 x dp 2): the losses go on as the reference's."""
    ref_losses, _ = runs("reference")
    train = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 100, "keep": 2}}
    _, first = _run("B", data_dir=runs.data_dir, tmp=tmp_path / "swap-b", steps=2, train=train)
    _, resumed = _run("T-none", data_dir=runs.data_dir, tmp=tmp_path / "swap-t", steps=STEPS, train=train,
                      resume=True)
    assert resumed[0].first_step == 2
    losses = first[0].losses + resumed[0].losses
    assert len(losses) == STEPS
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.slow
def test_fp16_overflow_on_one_dp_rank_skips_the_step_on_all_and_state_bytes_match_the_planner(runs, tmp_path):
    """fp16 with loss scaling under plan A: an inf on rank 1 (stage 0, dp rank 1) at step 1 skips that step on
    every rank, as without offload, and the losses stay bit for bit those of the plan without offload. Each
    rank's optimizer bytes in its tier are the planner's (fp16: fp32 master and moments, 12 bytes a parameter)."""
    train = {"precision": "fp16", "initial_loss_scale": 2.0**16, "hysteresis": 1}
    env = {"HETEROFLOW_INJECT_GRAD": "inf@1:1"}
    got = {}
    for name in ("A", "A-none"):
        metrics = tmp_path / f"{name}.jsonl"
        job, results = _run(name, data_dir=runs.data_dir, tmp=tmp_path / f"swap-{name}", train=train,
                            metrics=metrics, env=env)
        got[name] = (job, results, [(r["skipped"], r["loss_scale"]) for r in read_step_records(metrics)])
    job, results, records = got["A"]
    assert records == got["A-none"][2] == [(False, 2.0**16), (True, 2.0**16), (False, 2.0**15)]
    assert results[0].losses == got["A-none"][1][0].losses
    for k, stage in enumerate(job.plan.stages):
        parts = memory_parts(job.model, tp=stage.layout.tp, sp=stage.layout.sp, tokens=1.0, precision="fp16",
                             capacity_gib=1.0)
        planned = offloaded_optimizer_bytes(parts, stage.layout).at(stage.layers, 0, k == 0, k == 1)
        for r in results[2 * k:2 * k + 2]:
            assert abs(r.offload["optimizer_tier_bytes"] - planned) <= 12, (k, planned)


def test_the_swap_space_check_counts_one_dp_share_of_the_ssd_state():
    from heteroflow.launcher.swap import swap_bytes

    def needed(zero: int) -> int:
        stage = {"devices": ["a:0-3"], "layers": 4, "dp": 4, "zero": zero, "offload": {"optimizer": "ssd"}}
        job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN,
                         "plan": {"micro_batch_size": 4, "stages": [stage]}})
        return swap_bytes(job, job.plan)

    assert needed(1) == needed(2) < needed(0) / 3.5
