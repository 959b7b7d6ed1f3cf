"""A precision per stage in the planner: each stage priced at its own precision, `plan: auto` giving a device
type that lacks `train.precision` (Ascend 910A has no bf16) the fastest precision it supports, and
`train.precision` kept wherever a device type supports it.

Before per-stage precision, a bf16 job left the 910A nodes out of the search without a word."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from conftest import REPO
from heteroflow.config import load_plan_file, parse_job
from heteroflow.layout import OffloadSpec, ParallelLayout
from heteroflow.stagemap import SearchOptions, evaluate_plan, search_plan
from heteroflow.stagemap.costs import StageHardware
from heteroflow.stagemap.estimate import boundary_times, job_hardware
from heteroflow.stagemap.exhaustive import exhaustive_search
from heteroflow.stagemap.memory import dtype_bytes, memory_model, state_bytes_per_param

A100_910A = {"inter_node_gb_per_s": 25, "nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 8},
                                                  {"name": "npu-0", "device": "ascend-910a", "count": 8}]}


def _job(precision: str = "bf16", plan: dict | None = None, cluster: dict | None = None, model: object = "llama2-7b",
         global_batch_size: int = 256):
    data = {"cluster": cluster or A100_910A, "model": model,
            "train": {"global_batch_size": global_batch_size, "precision": precision}}
    if plan is not None:
        data["plan"] = plan
    return parse_job(data)


def _two_stage_plan(npu_precision: str | None) -> dict:
    npu = {"devices": ["npu-0"], "layers": 12, "dp": 8, "zero": 1}
    if npu_precision is not None:
        npu["precision"] = npu_precision
    return {"schedule": "1f1b", "micro_batch_size": 8,
            "stages": [npu, {"devices": ["gpu-0"], "layers": 20, "dp": 8, "zero": 1}]}


def test_state_and_element_bytes_per_precision():
    assert state_bytes_per_param("bf16") == state_bytes_per_param("fp16") == (2, 4, 12)  # fp32 grads; master, m, v
    assert state_bytes_per_param("fp32") == (4, 4, 8)  # the weights are the master copy
    assert (dtype_bytes("bf16"), dtype_bytes("fp16"), dtype_bytes("fp32")) == (2, 2, 4)
    model = _job().model
    half, full = (memory_model(model, ParallelLayout(dp=8, zero=1), tokens=4096.0, precision=p, capacity_gib=32)
                  .components(8, 2, False, False) for p in ("fp16", "fp32"))
    assert full["weights"] == pytest.approx(2 * half["weights"])
    assert full["gradients"] == pytest.approx(half["gradients"])  # an fp32 gradient buffer either way
    # the 16-bit activations double in fp32; the fp32 ones (norm inputs, log-sum-exp) are the same either way
    assert 1.5 * half["activations"] < full["activations"] < 2 * half["activations"]
    assert full["optimizer"] == pytest.approx(half["optimizer"] * 8 / 12)


def test_a_bf16_job_plans_the_910a_stages_in_fp16():
    job = _job()
    report = search_plan(job)
    assert report.feasible
    by_type = {s.device_type: s for s in report.estimate.stages}
    assert set(by_type) == {"nvidia-a100-80g", "ascend-910a"}  # the 910A nodes help instead of being dropped
    for stage in report.estimate.stages:
        assert stage.precision == ("fp16" if stage.device_type == "ascend-910a" else "bf16")
        assert stage.layout.precision == ("fp16" if stage.device_type == "ascend-910a" else None)
    single = report.baselines["best_single_type"].estimate
    assert report.estimate.tokens_per_s > single.tokens_per_s
    uniform = report.baselines["megatron_uniform"].estimate  # the baselines follow the same rule
    assert uniform is not None
    assert {s.device_type: s.precision for s in uniform.stages} == {"nvidia-a100-80g": "bf16", "ascend-910a": "fp16"}
    assert any("ascend-910a cannot train in bf16" in note for note in report.notes)  # said, not silent
    again = evaluate_plan(job, report.plan)
    assert again.step_time_s == pytest.approx(report.estimate.step_time_s, rel=1e-12)


def test_a_pinned_precision_is_kept_where_the_device_type_supports_it():
    fp32 = search_plan(_job("fp32"))  # bf16 / fp16 would be faster on both types, but the job says fp32
    assert fp32.feasible and not fp32.notes
    assert {s.precision for s in fp32.estimate.stages} == {"fp32"}
    assert all(s.layout.precision is None for s in fp32.estimate.stages)
    fp16 = search_plan(_job("fp16"))  # both types have fp16: one precision, nothing written per stage
    assert {s.precision for s in fp16.estimate.stages} == {"fp16"}
    assert all(s.layout.precision is None for s in fp16.estimate.stages)
    # An explicit stage precision is priced as written.
    pinned = _job(plan={"schedule": "1f1b", "micro_batch_size": 8,
                        "stages": [{"devices": ["gpu-0"], "layers": 32, "dp": 8, "zero": 1, "precision": "fp32"}]})
    estimate = evaluate_plan(pinned, pinned.plan)
    assert estimate.stages[0].precision == "fp32"
    assert estimate.step_time_s > evaluate_plan(pinned, _retyped(pinned.plan, None)).step_time_s


def _retyped(plan, precision: str | None):
    return replace(plan, stages=tuple(replace(s, layout=replace(s.layout, precision=precision)) for s in plan.stages))


def test_an_fp32_stage_is_priced_slower_and_larger_than_the_same_stage_in_fp16():
    half = evaluate_plan(job := _job(plan=_two_stage_plan("fp16")), job.plan)
    full = evaluate_plan(job := _job(plan=_two_stage_plan("fp32")), job.plan)
    assert (half.stages[0].precision, full.stages[0].precision) == ("fp16", "fp32")
    assert full.stages[0].forward_s > 2 * half.stages[0].forward_s  # fp32 has no 910A cube rate: peak / 8
    assert full.stages[0].backward_s > 2 * half.stages[0].backward_s
    assert full.stages[0].memory_peak_gib > half.stages[0].memory_peak_gib
    assert full.step_time_s > half.step_time_s
    # The bf16 stage is priced the same, except that it now receives fp32 hidden states (twice the bytes).
    assert full.stages[1].layout == half.stages[1].layout and full.stages[1].precision == "bf16"
    assert full.stages[1].recv_forward_s > half.stages[1].recv_forward_s
    assert full.stages[1].memory_peak_gib == pytest.approx(half.stages[1].memory_peak_gib)


def test_a_boundary_is_priced_at_the_senders_element_size():
    job = _job()
    hardware = job_hardware(job, None)

    def stage(device_type: str, precision: str, node: str):
        hw = StageHardware(device=hardware.device(device_type, precision), num_devices=8, num_nodes=1, node_count=8)
        return hw, frozenset((node,))

    (to_a100,) = boundary_times(job, hardware, [stage("ascend-910a", "fp16", "npu-0"),
                                                stage("nvidia-a100-80g", "bf16", "gpu-0")], 8)
    (to_a100_fp32,) = boundary_times(job, hardware, [stage("ascend-910a", "fp32", "npu-0"),
                                                     stage("nvidia-a100-80g", "bf16", "gpu-0")], 8)
    (from_a100,) = boundary_times(job, hardware, [stage("nvidia-a100-80g", "bf16", "gpu-0"),
                                                  stage("ascend-910a", "fp32", "npu-0")], 8)
    assert to_a100_fp32 > 1.9 * to_a100  # latencies aside, twice the bytes
    assert from_a100 == pytest.approx(to_a100)  # the receiver's precision does not matter


def test_plan_json_and_plan_file_carry_each_stages_precision(tmp_path):
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump({"cluster": A100_910A, "model": "llama2-7b",
                                        "train": {"global_batch_size": 256, "precision": "bf16"}, "plan": "auto"}))

    def heteroflow(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                              timeout=300, cwd=REPO)

    result = heteroflow("plan", str(job_path), "--json", "-o", str(tmp_path / "plan.yaml"))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {s["device_type"]: s["precision"] for s in data["stages"]} == {"nvidia-a100-80g": "bf16",
                                                                          "ascend-910a": "fp16"}
    assert all("precision" in s for b in data["baselines"].values() for s in b.get("stages", []))
    assert data["notes"]
    written = yaml.safe_load((tmp_path / "plan.yaml").read_text())["plan"]["stages"]
    # precision is written only where it differs from train.precision
    assert {s["device_type"]: s.get("precision") for s in written} == {"nvidia-a100-80g": None, "ascend-910a": "fp16"}
    load_plan_file(tmp_path / "plan.yaml", parse_job(yaml.safe_load(job_path.read_text())))  # valid as written
    again = heteroflow("plan", str(job_path), "--evaluate", str(tmp_path / "plan.yaml"), "--json")
    assert again.returncode == 0, again.stderr
    evaluated = json.loads(again.stdout)
    assert [s["precision"] for s in evaluated["stages"]] == [s["precision"] for s in data["stages"]]
    assert evaluated["step_time_s"] == pytest.approx(data["step_time_s"], rel=1e-12)
    text = heteroflow("plan", str(job_path), "--evaluate", str(tmp_path / "plan.yaml"))
    assert "precision" in text.stdout and "fp16" in text.stdout


def _small_cluster(slow_chip: dict) -> dict:
    """A bf16 chip too small to hold the model alone next to an `old` chip without bf16."""
    return {"inter_node_gb_per_s": 25,
            "device_types": {"fast": {"vendor": "nvidia", "memory_gib": 1.6, "tflops_bf16": 300,
                                      "intra_node_gb_per_s": 64, "host_link_gb_per_s": 16},
                             "old": {"vendor": "ascend", "memory_gib": 2.0, "intra_node_gb_per_s": 64,
                                     "host_link_gb_per_s": 16, **slow_chip}},
            "nodes": [{"name": "a", "device": "fast", "count": 2}, {"name": "b", "device": "old", "count": 2}]}


SMALL_MODEL = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 2816, "num_attention_heads": 16,
               "num_kv_heads": 4, "vocab_size": 8000, "seq_length": 1024}
TINY_OPTIONS = SearchOptions(zero=(0, 3), recompute=("none", "full"), sp=(False,),
                             offload=(OffloadSpec(), OffloadSpec(optimizer="cpu")))


@pytest.mark.parametrize("slow_chip, expected", [({"tflops_fp16": 200}, "fp16"),
                                                 ({"tflops_fp16": 5, "tflops_fp32": 150}, "fp32")],
                         ids=["fp16-only", "fp32-faster"])
def test_the_search_takes_the_fastest_precision_and_matches_exhaustive_search(slow_chip, expected):
    job = _job(cluster=_small_cluster(slow_chip), model=SMALL_MODEL, global_batch_size=4)
    report = search_plan(job, options=TINY_OPTIONS)
    best, plan, _ = exhaustive_search(job, options=TINY_OPTIONS)
    assert plan is not None and report.feasible
    assert report.estimate.step_time_s == pytest.approx(best, rel=1e-9)
    old = [s for s in report.estimate.stages if s.device_type == "old"]
    assert old and {s.precision for s in old} == {expected}
