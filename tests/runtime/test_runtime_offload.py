"""Offload inside the distributed runtime: a plan whose stages offload differently trains like the same plan
without offload (bit for bit with torch's AdamW kernel) and like the single-process reference, within each
rank's device budget, and leaves no swap files behind, also when a rank fails."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.errors import ConfigError, UserError
from heteroflow.offload.optimizer import ADAM_ENV, deepspeed_cpu_adam_module
from heteroflow.offload.swap import SCRATCH_MARKER, SWAP_PREFIX
from heteroflow.runtime.offload_step import check_offload_plan, check_swap_space, swap_bytes, sweep_swap
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing import MultiprocError, run_ranks

STEPS = 4
GIB = 2**30
SMALL_BUDGET = 640 << 10
"""Device budget of the `tiny-npu` ranks: below what their stage needs without offload (see the test)."""
CLUSTER = {
    # memory_gib chosen so that the budget after the reserve (2 GiB + 5%) is SMALL_BUDGET bytes.
    "device_types": {"tiny-npu": {"vendor": "ascend", "memory_gib": (SMALL_BUDGET / GIB + 2.0) / 0.95,
                                  "tflops_fp32": 10, "intra_node_gb_per_s": 50}},
    "nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
              {"name": "npu-0", "device": "ascend-910b2", "count": 2},
              {"name": "small-0", "device": "tiny-npu", "count": 1}]}
MODEL = {"preset": "micro-llama", "num_layers": 5, "tie_embeddings": True}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}
OFFLOAD = [{"optimizer": "ssd"}, {"params": "cpu", "activations": "cpu"},
           {"optimizer": "cpu", "params": "ssd", "activations": "cpu"}]


def three_stage_plan(offload: bool) -> dict:
    """(tp2) on NVIDIA with the optimizer on SSD, (dp2) on Ascend with params and activations on the CPU,
    one small card with params on SSD and optimizer and activations on the CPU; tied embeddings span them."""
    stages = [{"devices": ["gpu-0"], "layers": 2, "tp": 2, "dp": 1},
              {"devices": ["npu-0"], "layers": 1, "tp": 1, "dp": 2, "recompute": "full"},
              {"devices": ["small-0"], "layers": 2, "tp": 1, "dp": 1, "recompute": "full"}]
    if offload:
        stages = [{**stage, "offload": tiers} for stage, tiers in zip(stages, OFFLOAD)]
    return {"schedule": "1f1b", "micro_batch_size": 4, "stages": stages}


def _train_rank(rank: int, world_size: int, args: WorkerArgs):
    """`run_worker`, counting the bytes the CPU activation tier held."""
    import heteroflow.runtime.pipeline as pipeline
    from heteroflow.offload.activations import ActivationOffload

    tier_context, stats = pipeline.activation_context, []

    def counting(rt):
        context = tier_context(rt)
        if isinstance(context, ActivationOffload):
            stats.append(context.stats)
        return context

    pipeline.activation_context = counting
    result = run_worker(args)
    return result, sum(s.bytes_saved for s in stats)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference, plan without offload, plan with offload (torch's Adam kernel, then the default), run once."""
    data_dir = str(tmp_path_factory.mktemp("data"))
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            if name == "reference":
                job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN})
                cache[name] = train_reference(job, steps=STEPS, data_dir=data_dir)
            else:
                swap_root = tmp_path_factory.mktemp(f"swap-{name}")
                job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": {**TRAIN, "offload_dir": str(swap_root)},
                                 "plan": three_stage_plan(offload=name != "no-offload")})
                args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=STEPS, data_dir=data_dir,
                                  return_state=True, show_progress=False, timeout_s=300)
                env = {ADAM_ENV: "torch"} if name == "offload-torch-adam" else {}
                results = run_ranks(_train_rank, job.plan.num_devices, args, timeout_s=600, env=env)
                cache[name] = (job, results, sorted(p.name for p in swap_root.iterdir()))
        return cache[name]

    return get


def _weights(results) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for result, _ in results:
        for name, (local, shard) in result.state.items():
            shard.take(full.setdefault(name, torch.zeros(shard.full_shape))).copy_(local)
    return full


@pytest.mark.slow
def test_offloaded_plan_trains_bit_for_bit_like_the_plan_without_offload(runs):
    _, base, _ = runs("no-offload")
    _, offloaded, _ = runs("offload-torch-adam")
    assert offloaded[0][0].losses == base[0][0].losses
    assert offloaded[0][0].losses[-1] < offloaded[0][0].losses[0]
    want, got = _weights(base), _weights(offloaded)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert all(r.offload["which"]["adam"] == "torch-adamw" for r, _ in offloaded if r.offload)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["offload-torch-adam", "offload-default-adam", "no-offload"])
def test_offloaded_plan_reproduces_the_single_process_losses(runs, name):
    ref_losses, ref_weights = runs("reference")
    _, results, _ = runs(name)
    for got, want in zip(results[0][0].losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    weights = _weights(results)
    torch.testing.assert_close(weights.pop("head.weight"), weights["embed.weight"], rtol=0, atol=0)  # tied copies
    for n, want in ref_weights.items():
        torch.testing.assert_close(weights[n], want, rtol=1e-5, atol=1e-5, msg=n)
    if name == "offload-default-adam" and deepspeed_cpu_adam_module()[0] is not None:
        assert {r.offload["which"]["adam"] for r, _ in results if r.offload} == {"deepspeed-cpu-adam", "torch-adamw"}


@pytest.mark.slow
def test_each_rank_stays_within_its_device_budget(runs):
    job, results, _ = runs("offload-default-adam")
    reports = [r.offload for r, _ in results]
    assert all(report is not None for report in reports)
    for report in reports:
        assert report["peak_bytes"] <= report["limit_bytes"]
    small, _ = results[-1]  # the tiny-npu rank
    assert abs(small.offload["limit_bytes"] - SMALL_BUDGET) < 64
    # Without offload the stage keeps parameters, gradients and two Adam moments in fp32 on the device
    # (DataParallelAdamW even adds an fp32 master copy): far above the budget this rank trained within.
    stage_numel = sum(local.numel() for local, _ in small.state.values())
    assert 16 * stage_numel > 2 * small.offload["limit_bytes"]
    assert small.offload["peak_bytes"] > 0
    # The CPU activation tier held activations on the two stages that ask for it, and only there.
    assert [saved > 0 for _, saved in results] == [False, False, True, True, True]


@pytest.mark.slow
def test_swap_files_are_gone_after_the_run(runs):
    for name in ("offload-torch-adam", "offload-default-adam"):
        _, results, left = runs(name)
        assert left == []
        swap_dirs = [r.offload["swap_dir"] for r, _ in results if r.offload and r.offload["swap_dir"]]
        assert len(swap_dirs) == 3  # the two ranks of the SSD optimizer stage and the small card
        assert not any(Path(d).exists() for d in swap_dirs)


FAIL_CLUSTER = {"nodes": [{"name": "npu-0", "device": "ascend-910b2", "count": 2},
                          {"name": "dcu-0", "device": "hygon-bw1000", "count": 1}]}
FAIL_PLAN = {"micro_batch_size": 4, "stages": [
    {"devices": ["npu-0"], "layers": 2, "dp": 2, "offload": {"optimizer": "ssd", "params": "ssd"}},
    {"devices": ["dcu-0"], "layers": 2, "offload": {"optimizer": "ssd", "params": "ssd"}}]}


def _failing_rank(rank: int, world_size: int, args: WorkerArgs, fail_rank: int):
    """`run_worker`, with rank `fail_rank` raising in its second step (after its swap files exist)."""
    if rank == fail_rank:
        import heteroflow.runtime.pipeline as pipeline

        real, calls = pipeline.run_pipeline_step, []

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return real(*a, **k)

        pipeline.run_pipeline_step = failing
    return run_worker(args)


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [2, 0])
def test_swap_files_are_gone_after_a_rank_fails(tmp_path, fail_rank):
    swap_root = tmp_path / "swap"
    job = parse_job({"cluster": FAIL_CLUSTER, "model": {"preset": "micro-llama"},
                     "train": {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32",
                               "offload_dir": str(swap_root)}, "plan": FAIL_PLAN})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=4, data_dir=str(tmp_path / "data"),
                      show_progress=False, timeout_s=120)
    with pytest.raises(MultiprocError) as failure:
        run_ranks(_failing_rank, 3, args, fail_rank, timeout_s=600)
    assert "injected failure" in failure.value.outputs[fail_rank]
    # The failing rank removed its directory on the way out; the others when they were stopped.
    assert not list(swap_root.glob(f"{SWAP_PREFIX}*"))


# ---- pure logic: refusals, the job key, the disk check ------------------------------------------------


def _job(stages: list[dict], train: dict | None = None, tmp_path: Path | None = None):
    return parse_job({"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 4}]},
                      "model": {"preset": "micro-llama"}, "train": {"global_batch_size": 8, **(train or {})},
                      "plan": {"micro_batch_size": 4, "stages": stages}}, base_dir=str(tmp_path or "."))


def test_zero_with_offloaded_state_is_refused_naming_the_stage():
    job = _job([{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1},
                {"devices": ["a:2-3"], "layers": 2, "dp": 2, "zero": 1, "offload": {"optimizer": "ssd"}}])
    with pytest.raises(UserError, match=r"plan\.stages\[1\]: zero 1 together with offload \{optimizer: ssd\}"):
        check_offload_plan(job.plan)


def test_params_offload_with_tp_is_refused_naming_the_stage():
    job = _job([{"devices": ["a:0-1"], "layers": 4, "tp": 2, "offload": {"params": "cpu"}}])
    with pytest.raises(UserError, match=r"plan\.stages\[0\]: offload params: cpu needs tp: 1"):
        check_offload_plan(job.plan)


def test_activation_offload_alone_and_optimizer_offload_with_tp_are_run():
    check_offload_plan(_job([{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1,
                              "offload": {"activations": "cpu"}},
                             {"devices": ["a:2-3"], "layers": 2, "tp": 2, "offload": {"optimizer": "cpu"}}]).plan)


def test_offload_dir_is_a_strict_job_key():
    stages = [{"devices": ["a:0-1"], "layers": 4, "dp": 2}]
    assert _job(stages, {"offload_dir": "scratch"}).train.to_dict()["offload_dir"] == "scratch"
    with pytest.raises(ConfigError, match="train.offload_dir: expected a string"):
        _job(stages, {"offload_dir": 3})
    with pytest.raises(ConfigError, match="train.offload_dir: 'ckpt/swap' is inside train.checkpoint.dir 'ckpt'"):
        _job(stages, {"offload_dir": "ckpt/swap", "checkpoint": {"dir": "ckpt"}})


def test_swap_space_is_checked_before_launch(tmp_path, monkeypatch):
    import heteroflow.runtime.offload_step as offload_step
    from heteroflow.runtime.train import TrainOptions, train_job

    job = _job([{"devices": ["a:0-1"], "layers": 2, "dp": 2, "offload": {"optimizer": "ssd"}},
                {"devices": ["a:2-3"], "layers": 2, "dp": 2, "offload": {"params": "ssd"}}],
               {"offload_dir": "swap"}, tmp_path)
    needed = swap_bytes(job, job.plan)
    assert needed >= 2 * 12 * 45_000 * 2  # two ranks' fp32 master + moments of two blocks, at least
    assert check_swap_space(job, job.plan) == str(tmp_path / "swap")  # fits: the directory is made by the ranks
    plain = _job([{"devices": ["a:0-1"], "layers": 4, "dp": 2}])
    assert swap_bytes(plain, plain.plan) == 0 and check_swap_space(plain, plain.plan) is None

    monkeypatch.setattr(offload_step.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    monkeypatch.setattr("heteroflow.runtime.train.launch", lambda *a: pytest.fail("launched despite a full disk"))
    monkeypatch.setenv("HETEROFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=rf"not enough free disk space for offload swap files in {tmp_path / 'swap'}: "
                                        r"the plan's ssd tiers need .* GiB \(\d+ bytes\).* only 0.00 GiB \(1048576 bytes\)"):
        train_job(job, TrainOptions(emulate=True, steps=1))


def test_launcher_sweeps_swap_directories_of_killed_ranks(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{SWAP_PREFIX}{dead.stdout.strip()}-0123456789ab"
    live = tmp_path / f"{SWAP_PREFIX}{os.getpid()}-0123456789ab"
    for d in (stale, live):
        d.mkdir()
        (d / SCRATCH_MARKER).write_text("scratch")
        (d / "adam_block0.swp").write_bytes(b"x" * 4096)
    sweep_swap(str(tmp_path))
    assert not stale.exists() and live.exists()
