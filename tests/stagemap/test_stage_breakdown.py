"""The predicted step split by stage and part (`stagemap.breakdown`): every stage's parts sum to the step time
the planner uses, and they are the split of the very figures the pipeline formulas add up."""

from __future__ import annotations

import pytest

from heteroflow.config import parse_job
from heteroflow.stagemap import evaluate_plan
from heteroflow.stagemap.breakdown import PARTS, step_breakdown
from heteroflow.stagemap.costs import MicroBatchParts
from heteroflow.stagemap.estimate import boundary_times, job_hardware, stage_hardware
from heteroflow.stagemap.costs import stage_costs
from heteroflow.stagemap.pipeline import pipeline_time, shared_makespan, simulate_shared

STAGE_SETS = {
    "tp-dp-zero": [{"devices": ["gpu-0"], "layers": 10, "tp": 2, "dp": 2, "zero": 1},
                   {"devices": ["npu-0"], "layers": 6, "tp": 4, "sp": True}],
    "zero2-offload-recompute": [
        {"devices": ["gpu-0"], "layers": 9, "tp": 1, "dp": 4, "zero": 2, "recompute": "selective"},
        {"devices": ["npu-0:0-1"], "layers": 4, "tp": 1, "dp": 2, "recompute": "full",
         "offload": {"optimizer": "cpu", "activations": "cpu"}},
        {"devices": ["npu-0:2-3"], "layers": 3, "tp": 2, "dp": 1}],
}


def _job(stages: list[dict], schedule: str):
    return parse_job({
        "cluster": {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 4},
                              {"name": "npu-0", "device": "ascend-910b2", "count": 4}]},
        "model": {"preset": "tiny-llama", "num_layers": 16},
        "train": {"global_batch_size": 32, "precision": "bf16"},
        "plan": {"schedule": schedule, "micro_batch_size": 4, "stages": stages}})


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("name", sorted(STAGE_SETS))
def test_every_stage_parts_sum_to_the_planners_step_time(name, schedule, emulate):
    job = _job(STAGE_SETS[name], schedule)
    estimate = evaluate_plan(job, job.plan, emulate=emulate)
    assert estimate.step_time_s > 0
    for stage in estimate.stages:
        times = stage.times.to_dict()
        assert list(times) == list(PARTS)
        assert sum(times.values()) == pytest.approx(estimate.step_time_s, rel=1e-9)
        assert all(v >= -1e-12 for v in times.values()), times
        assert times["forward_s"] > 0 and times["backward_s"] > 0 and times["optimizer_s"] > 0
        # The tail is the stage's own; the stages wait for the slowest one's.
        assert times["dp_s"] + times["optimizer_s"] + times["sync_s"] == pytest.approx(
            estimate.step_time_s - estimate.pipeline_time_s, rel=1e-9)
        assert stage.to_json()["step_parts_s"] == times
    tp_stages = [s for s in estimate.stages if s.layout.tp > 1]
    assert all(s.times.collective_s > 0 for s in tp_stages)
    assert all(s.times.collective_s == 0 for s in estimate.stages if s.layout.tp == 1)
    dp_stages = [s for s in estimate.stages if s.layout.dp > 1 and s.layout.zero < 3]
    assert all(s.times.dp_s > 0 for s in dp_stages)


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_step_is_the_pipeline_formula_of_the_stage_costs(schedule, emulate):
    """Recomputed from `StageCosts` with the pipeline formulas alone: the breakdown changes no figure."""
    job = _job(STAGE_SETS["zero2-offload-recompute"], schedule)
    plan = job.plan
    hardware = job_hardware(job, None, emulate=emulate, num_ranks=plan.num_devices)
    placed = [stage_hardware(job, hardware, s) for s in plan.stages]
    recv = boundary_times(job, hardware, placed, plan.micro_batch_size)
    p, m = len(plan.stages), plan.num_micro_batches(job.train)
    fwd, bwd, tails, fwd_wait, bwd_wait = [], [], [], [], []
    for k, ((hw, _), stage) in enumerate(zip(placed, plan.stages)):
        c = stage_costs(job.model, hw, stage.layout, plan.micro_batch_size, hardware)
        first, last = k == 0, k == p - 1
        fwd.append(c.forward_s(stage.layers, first, last) + (recv[k - 1] if k > 0 else 0.0))
        bwd.append(c.backward_s(stage.layers, first, last) + (recv[k] if k < p - 1 else 0.0))
        tails.append(c.tail_s(stage.layers, first, last))
        parts = c.parts(stage.layers, first, last)
        fwd_wait.append(parts.forward_comm_s + parts.forward_alltoall_s + (recv[k - 1] if k > 0 else 0.0))
        bwd_wait.append(parts.backward_comm_s + parts.backward_alltoall_s + (recv[k] if k < p - 1 else 0.0))
        assert parts.forward_s + parts.forward_comm_s == pytest.approx(c.forward_s(stage.layers, first, last))
        assert parts.backward_s + parts.backward_comm_s == pytest.approx(c.backward_s(stage.layers, first, last))
        assert parts.dp_s + parts.optimizer_s == pytest.approx(c.tail_s(stage.layers, first, last))
    if emulate:
        threads = [hw.num_devices * hardware.threads_per_rank for hw, _ in placed]
        expected = (simulate_shared(fwd, bwd, m, schedule, threads=threads, cores=hardware.cores,
                                    waits=(fwd_wait, bwd_wait))
                    + shared_makespan(tails, threads=threads, cores=hardware.cores))
    else:
        expected = pipeline_time(fwd, bwd, m, schedule) + max(tails)
    assert evaluate_plan(job, plan, emulate=emulate).step_time_s == pytest.approx(expected, rel=1e-12)


def test_busy_stages_split_their_time_by_the_priced_proportions():
    """Two stages of one thread each on one core: each computes at half speed while both compute, while its
    collectives block without a core and take their priced time; what is left of the makespan is waiting."""
    parts = [MicroBatchParts(forward_s=1.0, forward_comm_s=1.0, backward_s=2.0, backward_comm_s=0.0, dp_s=0.5,
                             optimizer_s=0.5),
             MicroBatchParts(forward_s=1.0, forward_comm_s=0.0, backward_s=2.0, backward_comm_s=0.0, dp_s=0.0,
                             optimizer_s=3.0)]
    alone = step_breakdown(parts, [0.0, 0.0], [0.0, 0.0], 2, "1f1b")
    shared = step_breakdown(parts, [0.0, 0.0], [0.0, 0.0], 2, "1f1b", shared=([1, 1], 1, ()))
    for result in (alone, shared):
        for times in result.stages:
            assert times.total_s == pytest.approx(result.step_s)
    s0 = alone.stages[0]
    assert (s0.forward_s, s0.collective_s, s0.backward_s) == (2.0, 2.0, 4.0)
    assert alone.stages[0].sync_s == pytest.approx(2.0) and alone.stages[1].sync_s == 0.0
    assert shared.step_s > alone.step_s
    # The computing is slowed by the other stage's; the collective, which takes no core, is not.
    assert shared.stages[0].collective_s == pytest.approx(alone.stages[0].collective_s)
    assert shared.stages[0].forward_s > alone.stages[0].forward_s


@pytest.mark.parametrize("emulate", [False, True])
def test_a_tied_embedding_is_summed_in_the_end_stages_dp_reduction(emulate):
    """The runtime sums a tied embedding's gradient over every rank of the first and last stage (one gloo group,
    inside the `dp` part): the planner adds exactly that all-reduce to those two stages' dp part, and nothing to
    a middle stage's."""
    from dataclasses import replace

    from heteroflow.stagemap.comm import tied_sync_s
    untied = _job(STAGE_SETS["zero2-offload-recompute"], "1f1b")
    tied = replace(untied, model=replace(untied.model, tie_embeddings=True))
    a = evaluate_plan(untied, untied.plan, emulate=emulate)
    b = evaluate_plan(tied, tied.plan, emulate=emulate)
    hardware = job_hardware(tied, None, emulate=emulate, num_ranks=tied.plan.num_devices)
    first, last = (stage_hardware(tied, hardware, s)[0] for s in (tied.plan.stages[0], tied.plan.stages[-1]))
    sync = tied_sync_s(512 * 128 * 4, hardware, first=first.device, last=last.device, ranks=4 + 2)
    assert sync > 0
    assert b.stages[1].tail_s == pytest.approx(a.stages[1].tail_s)
    for k in (0, 2):
        assert b.stages[k].tail_s - a.stages[k].tail_s == pytest.approx(sync, rel=0.05)  # tying also changes what the stages hold, a little
    if not emulate:  # the accelerators' gloo sum: each side's copies to and from the host, the network ring
        assert sync > 2 * 512 * 128 * 4 / (first.device.host_link_gb_per_s * 1e9)
    for est in (a, b):
        for st in est.stages:
            assert st.times.total_s == pytest.approx(est.step_time_s)


def test_a_tied_embedding_between_stages_of_one_vendor_is_priced_on_their_backend_without_host_copies():
    """As the runtime runs it (`runtime.stage.tied_grads_backend`): end stages of one accelerator vendor sum on
    their vendor's group, device to device; of different vendors on gloo, through host copies."""
    from heteroflow.stagemap.comm import all_reduce_s, tied_sync_s
    job = _job(STAGE_SETS["zero2-offload-recompute"], "1f1b")
    hardware = job_hardware(job, None, emulate=False, num_ranks=job.plan.num_devices)
    gpu, npu = (stage_hardware(job, hardware, s)[0].device for s in (job.plan.stages[0], job.plan.stages[-1]))
    assert gpu.vendor != npu.vendor
    nbytes = 512 * 128 * 4
    same = tied_sync_s(nbytes, hardware, first=gpu, last=gpu, ranks=6)
    assert same == all_reduce_s(nbytes, 6, hardware.inter_node_gb_per_s, hardware.inter_latency_s)
    assert tied_sync_s(nbytes, hardware, first=gpu, last=npu, ranks=6) > same + 2 * nbytes / (
        gpu.host_link_gb_per_s * 1e9)
