"""Offload inside the distributed runtime: a plan whose stages offload differently trains like the same plan
without offload (bit for bit with torch's AdamW kernel) and like the single-process reference, within each
rank's device budget; checkpoints move between offloaded and plain stages; no swap files are left behind,
also when a rank fails; settings the runtime does not run are refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.errors import ConfigError, UserError
from heteroflow.launcher.swap import check_swap_space, swap_bytes, sweep_swap
from heteroflow.offload.optimizer import ADAM_ENV, deepspeed_cpu_adam_module
from heteroflow.offload.swap import SCRATCH_MARKER, SWAP_PREFIX
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing import MultiprocError, run_ranks
from heteroflow.testing.training import assemble_weights

STEPS = 4
GIB = 2**30
SMALL_BUDGET = 640 << 10
"""Device budget of the `tiny-npu` ranks: below what their stage needs without offload (see the test)."""
CLUSTER = {
    # memory_gib chosen so that the budget after the reserve (2 GiB + 5%) is SMALL_BUDGET bytes.
    "device_types": {"tiny-npu": {"vendor": "ascend", "memory_gib": (SMALL_BUDGET / GIB + 2.0) / 0.95,
                                  "tflops_fp32": 10, "intra_node_gb_per_s": 50}},
    "nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
              {"name": "small-0", "device": "tiny-npu", "count": 2}]}
MODEL = {"preset": "micro-llama", "num_layers": 5, "tie_embeddings": True}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}
OFFLOAD = {  # per stage: (tp 2 + sp on NVIDIA, dp 2 on the small cards); between them every tier is used
    "A": [{"optimizer": "ssd"}, {"optimizer": "cpu", "params": "ssd", "activations": "cpu"}],
    "B": [{"optimizer": "cpu"}, {"optimizer": "ssd", "params": "cpu", "activations": "cpu"}],
    "none": [{}, {}],
}


def two_stage_plan(variant: str) -> dict:
    """4 ranks: 3 blocks with tp 2 and sp on NVIDIA, 2 blocks with dp 2 and full recompute on the small cards;
    the tied embedding spans both stages."""
    stages = [{"devices": ["gpu-0"], "layers": 3, "tp": 2, "dp": 1, "sp": True},
              {"devices": ["small-0"], "layers": 2, "tp": 1, "dp": 2, "recompute": "full"}]
    stages = [{**stage, "offload": tiers} if tiers else stage for stage, tiers in zip(stages, OFFLOAD[variant])]
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


def _run(variant: str, *, data_dir: str, swap_root: Path, steps: int = STEPS, torch_adam: bool = True,
         train: dict | None = None, resume: bool = False):
    job = parse_job({"cluster": CLUSTER, "model": MODEL,
                     "train": {**TRAIN, **(train or {}), "offload_dir": str(swap_root)},
                     "plan": two_stage_plan(variant)})
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=300, resume=resume)
    env = {ADAM_ENV: "torch"} if torch_adam else {}
    return run_ranks(_train_rank, job.plan.num_devices, args, timeout_s=600, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference, the plan without offload, with offload (torch's Adam kernel, then the default), run once each."""
    data_dir = str(tmp_path_factory.mktemp("data"))
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            if name == "reference":
                job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN})
                cache[name] = train_reference(job, steps=STEPS, data_dir=data_dir)
            else:
                swap_root = tmp_path_factory.mktemp(f"swap-{name}")
                variant, adam = name.split("-", 1) if "-" in name else (name, "torch")
                results = _run(variant, data_dir=data_dir, swap_root=swap_root, torch_adam=adam == "torch")
                cache[name] = (results, sorted(p.name for p in swap_root.iterdir()))
        return cache[name]

    get.data_dir = data_dir
    return get


def _weights(results) -> dict[str, torch.Tensor]:
    """The assembled weights of a cached run (its results paired with its swap file names)."""
    return assemble_weights([result for result, _ in results])


@pytest.mark.slow
def test_offloaded_plan_trains_bit_for_bit_like_the_plan_without_offload(runs):
    base, _ = runs("none")
    offloaded, _ = runs("A-torch")
    assert offloaded[0][0].losses == base[0][0].losses
    assert offloaded[0][0].losses[-1] < offloaded[0][0].losses[0]
    want, got = _weights(base), _weights(offloaded)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert [r.offload["which"]["adam"] for r, _ in offloaded] == ["torch-adamw"] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["A-torch", "A-default", "none"])
def test_offloaded_plan_reproduces_the_single_process_losses(runs, name):
    ref_losses, ref_weights = runs("reference")
    results, _ = runs(name)
    for got, want in zip(results[0][0].losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    weights = _weights(results)
    torch.testing.assert_close(weights.pop("head.weight"), weights["embed.weight"], rtol=0, atol=0)  # tied copies
    for n, want in ref_weights.items():
        torch.testing.assert_close(weights[n], want, rtol=1e-5, atol=1e-5, msg=n)
    if name == "A-default" and deepspeed_cpu_adam_module()[0] is not None:
        assert {r.offload["which"]["adam"] for r, _ in results} == {"deepspeed-cpu-adam"}


@pytest.mark.slow
def test_each_rank_stays_within_its_device_budget(runs):
    results, _ = runs("A-default")
    reports = [r.offload for r, _ in results]
    assert all(report is not None for report in reports)
    for report in reports:
        assert 0 < report["peak_bytes"] <= report["limit_bytes"]
    for small, _ in results[2:]:  # the tiny-npu ranks
        assert abs(small.offload["limit_bytes"] - SMALL_BUDGET) < 64
        # Without offload the stage keeps parameters, gradients, an fp32 master and two Adam moments on the
        # device (DataParallelAdamW): far above the budget this rank trained within.
        stage_numel = sum(local.numel() for local, _ in small.state.values())
        assert 20 * stage_numel > 2 * small.offload["limit_bytes"]
    # The CPU activation tier held activations on the stage that asks for it, and only there.
    assert [saved > 0 for _, saved in results] == [False, False, True, True]


@pytest.mark.slow
def test_swap_files_are_gone_after_the_run(runs):
    for name in ("A-torch", "A-default"):
        results, left = runs(name)
        assert left == []
        swap_dirs = [r.offload["swap_dir"] for r, _ in results if r.offload["swap_dir"]]
        assert len(swap_dirs) == 4  # optimizer on SSD on the NVIDIA ranks, parameters on SSD on the small ones
        assert not any(Path(d).exists() for d in swap_dirs)


@pytest.mark.slow
def test_checkpoints_move_between_offloaded_and_plain_stages(runs, tmp_path):
    """Save offloaded (A), resume without offload, save, resume offloaded differently (B): the losses and
    weights of the run without offload, bit for bit."""
    from heteroflow.checkpoint.pieces import CheckpointReader

    base, _ = runs("none")
    ckpt = tmp_path / "ckpt"
    train = {"checkpoint": {"dir": str(ckpt), "interval": 100, "keep": 3}}
    losses = []
    for variant, steps in (("A", 2), ("none", 3), ("B", 4)):
        results = _run(variant, data_dir=runs.data_dir, swap_root=tmp_path / f"swap-{variant}", steps=steps,
                       train=train, resume=variant != "A")
        assert results[0][0].first_step == steps - (2 if variant == "A" else 1)
        losses += results[0][0].losses
    assert tuple(losses) == base[0][0].losses
    want, got = _weights(base), _weights(results)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # What B saved at the end (its parameters from their CPU tier, its state from SSD) is that state too.
    step_dir = ckpt / f"step-{STEPS:06d}"
    assert json.loads((step_dir / "metadata.json").read_text())["optimizer_steps"] == STEPS
    with CheckpointReader(step_dir) as reader:
        for name, value in want.items():
            if name == "head.weight":
                continue  # tied: stored once, as embed.weight
            box = tuple((0, n) for n in value.shape)
            for kind in ("param", "master"):
                stored = reader.read(kind, name, box, shape=tuple(value.shape), dtype=torch.float32)
                assert torch.equal(stored, value), (kind, name)


FAIL_CLUSTER = {"nodes": [{"name": "npu-0", "device": "ascend-910b2", "count": 2},
                          {"name": "dcu-0", "device": "hygon-bw1000", "count": 1}]}
FAIL_PLAN = {"micro_batch_size": 4, "stages": [
    {"devices": ["npu-0"], "layers": 2, "dp": 2, "offload": {"optimizer": "ssd", "params": "ssd"}},
    {"devices": ["dcu-0"], "layers": 2, "offload": {"optimizer": "ssd", "params": "ssd"}}]}


def _failing_rank(rank: int, world_size: int, args: WorkerArgs, fail_rank: int):
    """`run_worker`; every rank shows its swap directories in its first step, `fail_rank` raises in its second."""
    import heteroflow.runtime.pipeline as pipeline
    from heteroflow.offload.swap import live_swap_dirs

    real, calls = pipeline.run_pipeline_step, []

    def step(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            print("SWAP-DIRS " + json.dumps([str(d) for d in live_swap_dirs() if d.is_dir()]), flush=True)
        if len(calls) == 2 and rank == fail_rank:
            raise RuntimeError("injected failure")
        return real(*a, **k)

    pipeline.run_pipeline_step = step
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
    outputs = failure.value.outputs
    assert "injected failure" in outputs[fail_rank]
    # Every rank had its swap directory when the failure came (all finished step 0 before it) ...
    shown = [json.loads(m) for text in outputs.values() for m in re.findall(r"^SWAP-DIRS (.*)$", text, re.M)]
    assert len(shown) == 3 and all(len(dirs) == 1 and dirs[0].startswith(str(swap_root)) for dirs in shown)
    # ... and none is left: the failing rank removed its own on the way out, the others when they were stopped.
    assert not any(Path(dirs[0]).exists() for dirs in shown)
    assert not list(swap_root.glob(f"{SWAP_PREFIX}*"))


# ---- pure logic: refusals, the job key, the disk check, plan: auto --------------------------------------


def _job(stages: list[dict], train: dict | None = None, tmp_path: Path | None = None):
    return parse_job({"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 4}]},
                      "model": {"preset": "micro-llama"}, "train": {"global_batch_size": 8, **(train or {})},
                      "plan": {"micro_batch_size": 4, "stages": stages}}, base_dir=str(tmp_path or "."))


def test_zero_1_2_with_offloaded_params_is_not_a_layout():
    """Parameters are sharded and offloaded together under ZeRO-3 only: the plan is refused when it is read."""
    with pytest.raises(ConfigError, match=r"plan\.stages\[1\]\.offload: params: ssd needs zero 3 or 0, got zero 2 "
                                          r"\(ZeRO 1/2 do not shard parameters\); use zero: 3"):
        _job([{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1, "offload": {"optimizer": "ssd"}},
              {"devices": ["a:2-3"], "layers": 2, "dp": 2, "zero": 2, "offload": {"optimizer": "ssd", "params": "ssd"}}])


def test_every_offload_with_every_zero_stage_is_a_valid_plan():
    """Each tier under each ZeRO stage that shards what it offloads is a plan as written (a layout rule raises)."""
    plans = [
        [{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1, "offload": {"activations": "cpu"}},
         {"devices": ["a:2-3"], "layers": 2, "tp": 2, "offload": {"optimizer": "cpu"}}],
        [{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 1, "offload": {"optimizer": "cpu"}},
         {"devices": ["a:2-3"], "layers": 2, "dp": 2, "zero": 2, "offload": {"optimizer": "ssd", "activations": "cpu"}}],
        [{"devices": ["a:0-3"], "layers": 4, "tp": 2, "dp": 2, "offload": {"optimizer": "ssd", "params": "ssd"}}],
        [{"devices": ["a:0-1"], "layers": 2, "dp": 2, "zero": 3, "offload": {"optimizer": "cpu"}},
         {"devices": ["a:2-3"], "layers": 2, "cp": 2, "zero": 3, "offload": {"optimizer": "ssd", "params": "ssd"}}],
    ]
    for stages in plans:
        plan = _job(stages).plan
        assert [(s.layout.zero, s.layout.offload.to_dict()) for s in plan.stages] == \
            [(s.get("zero", 0), s["offload"]) for s in stages]


def test_offload_dir_is_a_strict_job_key():
    stages = [{"devices": ["a:0-1"], "layers": 4, "dp": 2}]
    assert _job(stages, {"offload_dir": "scratch"}).train.to_dict()["offload_dir"] == "scratch"
    with pytest.raises(ConfigError, match="train.offload_dir: expected a string"):
        _job(stages, {"offload_dir": 3})
    with pytest.raises(ConfigError, match="train.offload_dir: 'ckpt/swap' is inside train.checkpoint.dir 'ckpt'"):
        _job(stages, {"offload_dir": "ckpt/swap", "checkpoint": {"dir": "ckpt"}})


def test_swap_space_is_checked_before_launch(tmp_path, monkeypatch):
    import heteroflow.launcher.swap as launcher_swap
    from heteroflow.launcher.prepare import TrainOptions
    from heteroflow.launcher.train import train_job

    job = _job([{"devices": ["a:0-1"], "layers": 2, "dp": 2, "offload": {"optimizer": "ssd"}},
                {"devices": ["a:2-3"], "layers": 2, "dp": 2, "offload": {"params": "ssd"}}],
               {"offload_dir": "swap"}, tmp_path)
    needed = swap_bytes(job, job.plan)
    assert needed >= 2 * 12 * 45_000 * 2  # two ranks' fp32 master + moments of two blocks, at least
    assert swap_bytes(job, job.plan, node="other") == 0  # a node without ranks of the plan writes nothing
    assert check_swap_space(job, job.plan) == str(tmp_path / "swap")  # fits: the directory is made by the ranks
    plain = _job([{"devices": ["a:0-1"], "layers": 4, "dp": 2}])
    assert swap_bytes(plain, plain.plan) == 0 and check_swap_space(plain, plain.plan) is None

    monkeypatch.setattr(launcher_swap.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    monkeypatch.setattr("heteroflow.launcher.train.launch", lambda *a: pytest.fail("launched despite a full disk"))
    monkeypatch.setenv("HETEROFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=rf"not enough free disk space for offload swap files in {tmp_path / 'swap'}: "
                                        r"the plan's ssd tiers need .* GiB \(\d+ bytes\).* "
                                        r"only 0.00 GiB \(1048576 bytes\)"):
        train_job(job, TrainOptions(emulate=True, steps=1))


def test_swap_root_inside_a_checkpoint_is_refused_before_launch(tmp_path):
    ckpt = tmp_path / "old-run"
    ckpt.mkdir()
    (ckpt / "heteroflow-checkpoint.json").write_text("{}")
    job = _job([{"devices": ["a:0-3"], "layers": 4, "dp": 4, "offload": {"optimizer": "ssd"}}],
               {"offload_dir": str(ckpt / "swap")}, tmp_path)
    with pytest.raises(UserError, match="is a checkpoint; choose a swap directory outside any checkpoint"):
        check_swap_space(job, job.plan)


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


SMALL_CARDS = {"device_types": {"small-card": {"vendor": "ascend", "memory_gib": 32, "tflops_bf16": 200,
                                               "intra_node_gb_per_s": 50}},
               "nodes": [{"name": "n0", "device": "small-card", "count": 2}]}


def test_plan_auto_offloads_when_nothing_else_fits_and_the_runtime_accepts_it():
    from heteroflow.launcher.prepare import search_plan_or_fail
    from heteroflow.layout import OffloadSpec
    from heteroflow.stagemap import SearchOptions, search_plan

    # Llama-2 7B on two 32 GiB cards: without offload nothing fits (ZeRO-3 neither).
    job = parse_job({"cluster": SMALL_CARDS, "model": {"preset": "llama2-7b", "seq_length": 1024},
                     "train": {"global_batch_size": 16, "precision": "bf16"}})
    assert not search_plan(job, options=SearchOptions(offload=(OffloadSpec(),))).feasible
    plan = search_plan_or_fail(job)
    assert any(stage.layout.offload.optimizer != "device" for stage in plan.stages)


@pytest.mark.parametrize("num_devices,node_count", [(1, 1), (2, 2), (4, 4), (8, 4)])
def test_every_layout_plan_auto_searches_is_run(num_devices, node_count):
    from heteroflow.stagemap import RUNTIME_LAYOUTS
    from heteroflow.stagemap.layout import search_layouts

    job = parse_job({"cluster": SMALL_CARDS, "model": {"preset": "llama2-7b"}, "train": {"global_batch_size": 16}})
    layouts = search_layouts(job.model, num_devices=num_devices, node_count=node_count, micro_batch_size=8,
                             zero=RUNTIME_LAYOUTS.zero, offload_zero=RUNTIME_LAYOUTS.offload_zero)
    # parameters leave the device at dp 1 or, with dp > 1, under ZeRO-3 (ZeRO-Infinity)
    assert all(lay.dp == 1 or lay.zero == 3 for lay in layouts if lay.offload.params != "device")
    assert any(lay.offload.optimizer != "device" for lay in layouts)
    # ZeRO-Offload and ZeRO-Infinity: every ZeRO stage with the optimizer state on cpu or ssd wherever it shards
    zero_offload = {(lay.zero, lay.offload.optimizer) for lay in layouts
                    if lay.zero and lay.offload.optimizer != "device"}
    expected = {(z, tier) for z in (1, 2, 3) for tier in ("cpu", "ssd")} if num_devices > 1 else set()
    assert zero_offload == expected
    for lay in layouts:  # every searched layout is one a plan may hold
        assert lay.validate(job.model, num_devices=num_devices, micro_batch_size=8) == []


def test_zero_infinity_swap_space_is_each_rank_share(tmp_path):
    """Under ZeRO-3 every rank writes 1/dp of the stage's state and parameter shards to its swap files: the check
    before launch asks for about half of what the same ranks need under ZeRO 0 at dp 2."""
    def needed(zero: int) -> int:
        job = _job([{"devices": ["a:0-1"], "layers": 4, "dp": 2, "zero": zero,
                     "offload": {"optimizer": "ssd", "params": "ssd"}}], tmp_path=tmp_path)
        return swap_bytes(job, job.plan)

    assert 0.4 * needed(0) < needed(3) < 0.6 * needed(0)
