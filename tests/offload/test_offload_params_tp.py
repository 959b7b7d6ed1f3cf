"""Parameter offload with tp > 1: each tp rank stores, fetches and updates its own shards.

Plans with `offload.params` on cpu or ssd and tp 2 (with sp, whose norm gradients are partial over tp, and
with dp 2 x tp 2), and tp 4 beyond the kv heads (whole k/v projections with partial gradients), train like
the single-process reference, and bit for bit like the same layout without offload (torch's AdamW kernel);
every rank prefetches the next block and has its own swap directory, named after it; the device bytes of
parameters per rank stay within the planner's figure for the stage (a window of two blocks' tp shards plus
the resident embedding and head); a checkpoint of a params-on-ssd tp 2 stage resumes under a plan without
offload and the losses continue.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.layout.shards import layer_params_per_rank
from heteroflow.offload.aio import deepspeed_aio_module, memlock_limit_bytes, odirect_supported
from heteroflow.offload.optimizer import ADAM_ENV
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.stagemap.memory import memory_model
from heteroflow.testing import run_ranks
from heteroflow.testing.training import assemble_weights

STEPS = 3
CLUSTER = {"nodes": [{"name": "host", "device": "cpu", "count": 4}]}
MODEL = {"preset": "micro-llama", "num_layers": 4}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.5}
PLANS = {  # one stage; tp 2 on the first two devices, or dp 2 x tp 2 on all four
    "cpu-tp2-sp": {"devices": ["host:0-1"], "tp": 2, "sp": True, "offload": {"optimizer": "cpu", "params": "cpu"}},
    "ssd-tp2": {"devices": ["host:0-1"], "tp": 2, "recompute": "full",
                "offload": {"optimizer": "ssd", "params": "ssd", "activations": "cpu"}},
    "cpu-dp2-tp2": {"devices": ["host"], "tp": 2, "dp": 2, "offload": {"optimizer": "cpu", "params": "cpu"}},
    # tp 4 > 2 kv heads: every rank keeps wk / wv whole and their gradients are partial over tp
    "cpu-tp4-kv": {"devices": ["host"], "tp": 4, "offload": {"optimizer": "cpu", "params": "cpu"}},
    "plain-dp2": {"devices": ["host:0-1"], "tp": 1, "dp": 2},
}


def _job(name: str, *, swap_root: Path, train: dict | None = None):
    plain, _, name = name.rpartition(":")
    stage = {"layers": MODEL["num_layers"], **PLANS[name]}
    if plain:
        stage.pop("offload")
    return parse_job({"cluster": CLUSTER, "model": MODEL,
                      "train": {**TRAIN, **(train or {}), "offload_dir": str(swap_root)},
                      "plan": {"schedule": "1f1b", "micro_batch_size": 4, "stages": [stage]}})


def _train_rank(rank: int, world_size: int, args: WorkerArgs):
    """`run_worker`, also showing the swap directories this rank had open in its first step and the order
    in which its first step prefetched and used the blocks' parameters."""
    import heteroflow.runtime.pipeline as pipeline
    from heteroflow.offload.store import TieredStore
    from heteroflow.offload.swap import live_swap_dirs

    real, seen, events, steps = pipeline.run_pipeline_step, [], [], []

    def step(*a, **k):
        if not seen:
            seen.append([d.name for d in live_swap_dirs()])
        steps.append(1)
        try:
            return real(*a, **k)
        finally:
            steps.append(1)

    def logged(kind: str, method):
        def call(store, name, *a, **k):
            if len(steps) == 1 and name.startswith("block"):  # inside the first step's pipeline
                events.append((kind, name))
            return method(store, name, *a, **k)
        return call

    pipeline.run_pipeline_step = step
    TieredStore.prefetch = logged("prefetch", TieredStore.prefetch)
    TieredStore.get = logged("get", TieredStore.get)
    return run_worker(args), seen[0] if seen else [], events


def _run(name: str, *, data_dir: str, swap_root: Path, steps: int = STEPS, train: dict | None = None,
         resume: bool = False):
    """Train plan `name` (`plain:NAME`: the same layout without offload) on its ranks; their results."""
    job = _job(name, swap_root=swap_root, train=train)
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=300, resume=resume)
    return run_ranks(_train_rank, job.plan.num_devices, args, timeout_s=600, env={ADAM_ENV: "torch"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference and each offloaded plan, run once each (the ssd run also writes a checkpoint)."""
    data_dir = str(tmp_path_factory.mktemp("data"))
    ckpt = tmp_path_factory.mktemp("ckpt") / "run"
    cache: dict = {}
    swap_roots: dict[str, Path] = {}

    def get(name: str):
        if name not in cache:
            if name == "reference":
                job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN})
                cache[name] = train_reference(job, steps=STEPS, data_dir=data_dir)
            else:
                swap_root = swap_roots[name] = tmp_path_factory.mktemp(f"swap-{name}")
                train = {"checkpoint": {"dir": str(ckpt), "interval": 2, "keep": 3}} if name == "ssd-tp2" else None
                results = _run(name, data_dir=data_dir, swap_root=swap_root, train=train)
                cache[name] = (results, sorted(p.name for p in swap_root.iterdir()))
        return cache[name]

    get.data_dir, get.ckpt, get.swap_roots = data_dir, ckpt, swap_roots
    return get


def _expected_io(swap_root: Path) -> str:
    """The SSD engine a rank's store opens under `swap_root` (`offload.aio.open_engine`'s rules): DeepSpeed's
    async_io where its op builds (libaio-dev installed), O_DIRECT is possible and enough memory can be locked;
    the thread pool otherwise, with O_DIRECT where the file system allows it."""
    direct = odirect_supported(str(swap_root))
    if direct and memlock_limit_bytes() >= (1 << 30) and deepspeed_aio_module()[0] is not None:
        return "deepspeed-aio"
    return "threads-odirect" if direct else "threads-buffered"


def _weights(results) -> dict[str, torch.Tensor]:
    """The assembled weights of a run whose ranks also returned what they observed."""
    return assemble_weights([result for result, *_ in results])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-tp2-sp", "ssd-tp2", "cpu-dp2-tp2", "cpu-tp4-kv"])
def test_params_offload_with_tp_trains_like_the_single_process_reference(runs, name):
    ref_losses, ref_weights = runs("reference")
    results, left = runs(name)
    losses = results[0][0].losses
    assert len(losses) == STEPS and losses[-1] < losses[0]
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    weights = _weights(results)
    assert weights.keys() == ref_weights.keys()
    # every tp and dp rank offloaded its own blocks, and nothing is left in the swap root
    assert all(r.offload is not None and r.offload["policy"]["params"] != "device" for r, *_ in results)
    assert left == []
    if name.startswith("ssd"):
        assert {r.offload["which"]["io"] for r, *_ in results} == {_expected_io(runs.swap_roots[name])}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-tp2-sp", "ssd-tp2", "cpu-dp2-tp2", "cpu-tp4-kv"])
def test_params_offload_with_tp_trains_bit_for_bit_like_the_same_layout_on_the_device(runs, name):
    """The weights too: Adam turns the reference's different summation order into weight differences of
    ~1e-4 on gradients near zero, but the same tp layout without offload adds in the same order (partial
    norm gradients under sp summed over tp after the micro-batches, as on the device)."""
    results, _ = runs(name)
    plain, _ = runs(f"plain:{name}")
    assert results[0][0].losses == plain[0][0].losses
    want, got = _weights(plain), _weights(results)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.slow
def test_each_tp_rank_has_its_own_swap_directory_named_after_it(runs):
    results, _ = runs("ssd-tp2")
    names = [dirs for _, dirs, _ in results]
    assert all(len(dirs) == 1 for dirs in names)
    for tp, (dirs, (result, *_)) in enumerate(zip(names, results)):
        assert re.fullmatch(rf"heteroflow-swap-\d+-s0-dp0-cp0-tp{tp}-[0-9a-f]{{12}}", dirs[0]), dirs[0]
        assert Path(result.offload["swap_dir"]).name == dirs[0]
        assert not Path(result.offload["swap_dir"]).exists()


def _stage_numels(result) -> tuple[int, int]:
    """(elements of one block's local shards, elements kept on the device: embedding, final norm, head)."""
    blocks = {}
    rest = 0
    for name, (local, _) in result.state.items():
        m = re.match(r"layers\.(\d+)\.", name)
        if m:
            blocks[m.group(1)] = blocks.get(m.group(1), 0) + local.numel()
        else:
            rest += local.numel()
    sizes = set(blocks.values())
    assert len(sizes) == 1
    return sizes.pop(), rest


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-tp2-sp", "ssd-tp2", "cpu-dp2-tp2"])
def test_device_bytes_of_parameters_stay_within_the_planners_window(runs, name):
    results, _ = runs(name)
    job = _job(name, swap_root=Path("."))
    stage = job.plan.stages[0]
    layers = MODEL["num_layers"]
    tokens = job.plan.micro_batch_size / stage.layout.dp * job.model.seq_length
    priced = memory_model(job.model, stage.layout, tokens=tokens, precision="fp32", capacity_gib=1.0)
    planned_weights = priced.weights.at(layers, 1, True, True)
    planned_grads = priced.gradients.at(layers, 1, True, True)
    for result, *_ in results:
        block_numel, resident_numel = _stage_numels(result)
        # the planner's per-rank block is this rank's tp shard of a block
        assert block_numel == layer_params_per_rank(job.model, stage.layout.tp)
        peaks = result.offload["peak_by_kind"]
        window = peaks["params"] - 4 * resident_numel
        assert 4 * block_numel <= window <= 2 * 4 * block_numel  # one block in use, at most two (prefetch)
        assert peaks["params"] <= planned_weights
        assert peaks["grads"] <= planned_grads
        # and far below the stage's whole parameters: what keeping them on the device would take
        assert peaks["params"] < 4 * (layers * block_numel + resident_numel)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu-tp2-sp", "ssd-tp2", "cpu-dp2-tp2"])
def test_every_tp_rank_prefetches_the_next_block(runs, name):
    """Forward walks blocks 0..3 and prefetches the next one, backward walks back and prefetches the previous
    one: every block but the first of a pass is prefetched before its first use, on every rank."""
    results, _ = runs(name)
    layers = MODEL["num_layers"]
    for _, _, events in results:
        gets, prefetched = [], set()
        for kind, block in events:
            if kind == "prefetch":
                prefetched.add(block)
                continue
            assert len(gets) % layers == 0 or block in prefetched, (block, events)  # a pass starts unprefetched
            prefetched.discard(block)
            gets.append(block)
        # one stage, 1F1B: forward then backward of each of the two micro-batches
        assert gets == [f"block{i}" for i in [*range(layers), *reversed(range(layers))] * 2], gets


@pytest.mark.slow
def test_params_on_ssd_tp2_checkpoint_resumes_without_offload(runs, tmp_path):
    """Resume the ssd tp 2 run's step-2 checkpoint under tp 1 x dp 2 without offload: step 2's loss and the
    final weights are the uninterrupted run's."""
    results, _ = runs("ssd-tp2")
    assert (runs.ckpt / "step-000002").is_dir()
    train = {"checkpoint": {"dir": str(runs.ckpt), "interval": 100, "keep": 3}}
    # the uninterrupted run's last checkpoint (step 3) is newer; resume from step 2 by moving it aside
    (runs.ckpt / "step-000003").rename(tmp_path / "step-000003")
    resumed = _run("plain-dp2", data_dir=runs.data_dir, swap_root=tmp_path / "swap", train=train, resume=True)
    assert resumed[0][0].first_step == 2
    (got,) = resumed[0][0].losses
    want = results[0][0].losses[2]
    assert abs(got - want) <= 1e-6 * abs(want)
    ref_losses, ref_weights = runs("reference")
    assert abs(got - ref_losses[2]) <= 1e-5 * abs(ref_losses[2])
    weights, continued = _weights(resumed), _weights(results)
    for n, want in continued.items():
        torch.testing.assert_close(weights[n], want, rtol=1e-6, atol=1e-6, msg=n)


# ---- pure logic: what train accepts, what plan: auto picks, what the planner and the launcher count --------


def test_plans_offload_params_with_tp():
    for name in ("cpu-tp2-sp", "ssd-tp2", "cpu-dp2-tp2", "cpu-tp4-kv"):
        (stage,) = [s for s in _job(name, swap_root=Path(".")).plan.stages if s.layout.offload.params != "device"]
        assert stage.layout.tp > 1


def test_plan_auto_offloads_tp_shards_of_parameters_when_nothing_else_fits():
    from heteroflow.stagemap import RUNTIME_LAYOUTS, search_plan
    from heteroflow.stagemap.layout import OFFLOAD_CHOICES

    # Llama-2 7B on one node of two 7 GiB cards: without ZeRO-3 (which shards the parameters over dp instead),
    # only tp 2 with the parameters off the device fits.
    cards = {"device_types": {"small-card": {"vendor": "ascend", "memory_gib": 7, "tflops_bf16": 200,
                                             "intra_node_gb_per_s": 50}},
             "nodes": [{"name": "n0", "device": "small-card", "count": 2}]}
    job = parse_job({"cluster": cards, "model": {"preset": "llama2-7b", "seq_length": 1024},
                     "train": {"global_batch_size": 16, "precision": "bf16"}})
    no_zero3 = replace(RUNTIME_LAYOUTS, zero=tuple(z for z in RUNTIME_LAYOUTS.zero if z < 3))
    params_on_device = tuple(off for off in OFFLOAD_CHOICES if off.params == "device")
    assert not search_plan(job, options=replace(no_zero3, offload=params_on_device)).feasible
    report = search_plan(job, options=no_zero3)
    assert report.feasible
    plan = report.estimate.plan
    (stage,) = plan.stages
    assert stage.layout.tp == 2 and stage.layout.offload.params == "cpu"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_planners_params_window_is_two_blocks_of_tp_shards_plus_the_resident_ends(tp):
    from heteroflow.layout import OffloadSpec, ParallelLayout
    from heteroflow.layout.shards import embedding_params_per_rank, head_params_per_rank
    from heteroflow.stagemap.memory import memory_from_parts, memory_parts, memory_total_from_parts

    job = parse_job({"cluster": CLUSTER, "model": {"preset": "llama2-7b"}, "train": {"global_batch_size": 16}})
    model = job.model
    layout = ParallelLayout(tp=tp, offload=OffloadSpec(optimizer="cpu", params="ssd"))
    parts = memory_parts(model, tp=tp, sp=False, tokens=4096, precision="bf16", capacity_gib=64)
    priced = memory_from_parts(parts, layout)
    block, embed = layer_params_per_rank(model, tp), embedding_params_per_rank(model, tp)
    head = head_params_per_rank(model, tp, single_stage=False)
    gib = 2**30
    for first, last, ends in ((False, False, 0), (True, False, embed), (False, True, head), (True, True, embed + head)):
        # independent of the stage's layer count: only the window is on the device
        assert priced.weights.at(1, 1, first, last) == priced.weights.at(40, 1, first, last)
        assert priced.components(40, 1, first, last)["weights"] * gib == pytest.approx(2 * (2 * block + ends))
        # one block's bf16 `.grad` while its backward runs: the optimizer tier takes every other gradient (the
        # resident ends' too) as autograd produces it
        assert priced.components(40, 1, first, last)["gradients"] * gib == pytest.approx(2 * block)
        assert memory_total_from_parts(parts, layout).at(40, 1, first, last) == pytest.approx(
            priced.total().at(40, 1, first, last))


def test_launcher_counts_each_tp_ranks_swap_files_of_its_shards():
    from heteroflow.launcher.swap import swap_bytes

    def stage(devices: str, tp: int) -> dict:
        return {"devices": [devices], "layers": 4, "tp": tp, "offload": {"params": "ssd"}}

    job = _job("ssd-tp2", swap_root=Path("."))
    one = parse_job({**job.to_dict(), "plan": {"micro_batch_size": 4, "stages": [stage("host:0", 1)]}})
    two = parse_job({**job.to_dict(), "plan": {"micro_batch_size": 4, "stages": [stage("host:0-1", 2)]}})
    held = 4 * 4 * layer_params_per_rank(job.model, 2)  # fp32 shards of 4 blocks on one tp rank
    assert 2 * held < swap_bytes(two, two.plan) < 1.2 * swap_bytes(one, one.plan)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_planner_prices_the_weight_write_back_of_one_tp_shard(tp):
    """After the step each rank writes its updated shards back to the ssd tier (per parameter it holds, at the
    node's SSD write bandwidth shared by its devices); the cpu tier updates them in host memory."""
    from heteroflow.config import PRESETS
    from heteroflow.config.catalog import CATALOG
    from heteroflow.layout import OffloadSpec, ParallelLayout
    from heteroflow.stagemap.costs import StageHardware, stage_costs
    from heteroflow.stagemap.hardware import Hardware, device_model

    model, dev = PRESETS["llama2-7b"], device_model(CATALOG["nvidia-a100-80g"], "bf16")
    hardware = Hardware(models={}, inter_node_gb_per_s=25.0)
    hw = StageHardware(device=dev, num_devices=tp, num_nodes=1, node_count=8)
    cpu, ssd = (stage_costs(model, hw, ParallelLayout(tp=tp, offload=OffloadSpec(optimizer="cpu", params=tier)),
                            1, hardware) for tier in ("cpu", "ssd"))
    write_bw = min(dev.host_link_gb_per_s, dev.ssd_write_gb_per_s / 8) * 1e9
    assert ssd.tail_per_param_s - cpu.tail_per_param_s == pytest.approx(2 / write_bw)  # bf16 weights
    # per parameter of the rank: a tp rank's tail covers its shard only
    assert ssd.params.per_layer == pytest.approx(layer_params_per_rank(model, tp))
