"""Every class of bad job input is reported with its exact YAML path."""

from __future__ import annotations

import copy

import pytest

from conftest import problems
from heteroflow.config import load_job, parse_job
from heteroflow.errors import UserError

GOOD = {
    "cluster": {
        "inter_node_gb_per_s": 25,
        "nodes": [
            {"name": "gpu-0", "device": "nvidia-a100-80g", "count": 8},
            {"name": "npu-0", "device": "ascend-910b2", "count": 8},
        ],
    },
    "model": {"preset": "llama2-7b"},
    "train": {"global_batch_size": 64, "micro_batch_size": 2, "precision": "bf16", "steps": 10},
    "plan": {
        "schedule": "1f1b",
        "micro_batch_size": 2,
        "stages": [
            {"devices": ["gpu-0"], "layers": 18, "tp": 4, "dp": 2},
            {"devices": ["npu-0:0-3"], "layers": 14, "tp": 2, "dp": 2},
        ],
    },
}


def edited(**changes) -> dict:
    """GOOD with changes applied at dotted paths (`cluster.nodes.1.count=0`)."""
    data = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = data
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        if value is _DELETE:
            del target[int(last) if last.isdigit() else last]
        else:
            target[int(last) if last.isdigit() else last] = value
    return data


_DELETE = object()


def test_good_job_is_valid():
    assert problems(GOOD) == []
    job = parse_job(GOOD)
    assert job.plan.layer_ranges() == [(0, 18), (18, 32)]
    assert job.plan.stages[1].device_type == "ascend-910b2"
    assert [str(r) for r in job.plan.stages[1].device_refs] == ["npu-0:0", "npu-0:1", "npu-0:2", "npu-0:3"]


def test_unknown_keys_named_with_suggestion():
    found = problems(edited(cluster__nodes__0__cuont=3, trian={}))
    assert any(p.startswith("cluster.nodes[0].cuont: unknown key (did you mean 'count'") for p in found), found
    assert any(p.startswith("trian: unknown key") for p in found), found


def test_wrong_types():
    found = problems(edited(cluster__nodes__1__count="eight", train__precision=16))
    assert "cluster.nodes[1].count: expected an integer, got a string 'eight'" in found
    assert any(p.startswith("train.precision: expected a string") for p in found), found
    assert "plan: not checked: fix the problems in cluster, model and train first" in found
    found = problems(edited(plan__stages__0__sp="yes"))
    assert any(p.startswith("plan.stages[0].sp: expected true or false") for p in found), found


def test_missing_required_fields():
    found = problems(edited(train__global_batch_size=_DELETE, cluster__nodes__0__device=_DELETE))
    assert "train.global_batch_size: required field is missing" in found
    assert "cluster.nodes[0].device: required field is missing" in found
    assert problems({"cluster": GOOD["cluster"], "train": GOOD["train"]}) == ["model: required field is missing"]


@pytest.mark.parametrize("value", [0, -2])
def test_zero_or_negative_counts(value):
    found = problems(edited(cluster__nodes__1__count=value))
    assert f"cluster.nodes[1].count: must be between 1 and 1024, got {value}" in found


def test_duplicate_node_names():
    data = edited(cluster__nodes__1__name="gpu-0", plan="auto")
    assert any(p.startswith("cluster.nodes[1].name: duplicate node name 'gpu-0'") for p in problems(data))


def test_unknown_device_type_did_you_mean():
    found = problems(edited(cluster__nodes__1__device="a100", plan="auto"))
    assert any(p.startswith("cluster.nodes[1].device: unknown device type 'a100' (did you mean 'nvidia-a100-80g'")
               for p in found), found


def test_custom_device_type_and_override():
    data = edited(plan="auto")
    data["cluster"]["device_types"] = {
        "my-dcu": {"vendor": "hygon", "memory_gib": 64, "tflops_bf16": 480, "intra_node_gb_per_s": 100},
        "nvidia-a100-80g": {"memory_gib": 79.5},
    }
    data["cluster"]["nodes"][1]["device"] = "my-dcu"
    job = parse_job(data)
    assert job.cluster.device_types["my-dcu"].vendor == "hygon"
    assert job.cluster.device_types["my-dcu"].peak_tflops("bf16") == 480
    assert job.cluster.device_types["nvidia-a100-80g"].memory_gib == 79.5
    assert job.cluster.device_types["nvidia-a100-80g"].tflops_bf16 == 312
    data["cluster"]["device_types"]["bad"] = {"vendor": "intel", "memory_gib": 16}
    found = problems(data)
    assert any(p.startswith("cluster.device_types.bad.vendor: must be one of") for p in found), found
    assert "cluster.device_types.bad.intra_node_gb_per_s: required field is missing" in found


@pytest.mark.parametrize("field,value,path,fragment", [
    ("hidden_size", 4010, "model.hidden_size", "not divisible by num_attention_heads 32"),
    ("num_kv_heads", 5, "model.num_kv_heads", "not divisible by num_kv_heads 5"),
])
def test_impossible_model_shapes(field, value, path, fragment):
    found = problems(edited(**{f"model__{field}": value, "plan": "auto"}))
    assert any(p.startswith(path + ":") and fragment in p for p in found), found


def test_model_without_preset_needs_every_shape_field():
    found = problems(edited(model={"num_layers": 2, "hidden_size": 64}, plan="auto"))
    assert "model.num_attention_heads: required field is missing" in found
    assert "model.vocab_size: required field is missing" in found


def test_unknown_preset():
    found = problems(edited(model={"preset": "llama-7b"}, plan="auto"))
    assert any(p.startswith("model.preset: unknown model preset 'llama-7b' (did you mean") for p in found), found


def test_plan_layers_must_add_up():
    found = problems(edited(plan__stages__1__layers=10))
    assert "plan.stages: stage layers add up to 28, but model.num_layers is 32; make the stages' layers sum to 32" \
        in found


def test_plan_tp_times_dp_must_match_devices():
    found = problems(edited(plan__stages__0__dp=1))
    assert "plan.stages[0].devices: 8 devices, but tp * cp * dp = 4 * 1 * 1 = 4; the layout must use exactly " \
           "the stage's devices" in found


def test_plan_device_used_twice():
    found = problems(edited(plan__stages__1__devices=["npu-0:0-2", "gpu-0:7"]))
    assert any(p.startswith("plan.stages[1].devices: device gpu-0:7 is used twice (also by plan.stages[0])")
               for p in found), found


def test_plan_device_that_does_not_exist():
    found = problems(edited(plan__stages__1__devices=["npu-0:4-9"]))
    assert "plan.stages[1].devices[0]: devices 4-9 do not exist: node 'npu-0' has devices 0-7" in found
    found = problems(edited(plan__stages__1__devices=["npu-9:0-3"]))
    assert any(p.startswith("plan.stages[1].devices[0]: unknown node 'npu-9' (did you mean 'npu-0'") for p in found)


def test_plan_tp_must_divide_heads():
    data = edited(plan__stages__0__tp=3, plan__stages__0__devices=["gpu-0:0-5"])
    found = problems(data)
    assert "plan.stages[0].tp: tp 3 does not divide num_attention_heads 32" in found


def test_plan_dp_must_divide_micro_batch():
    found = problems(edited(plan__stages__0__tp=2, plan__stages__0__dp=4))
    assert any(p.startswith("plan.stages[0].dp: dp 4 does not divide micro_batch_size 2") for p in found), found


def test_plan_stage_mixing_device_types():
    found = problems(edited(plan__stages__1__devices=["npu-0:0-1", "gpu-0:0-1"],
                            plan__stages__0__devices=["gpu-0:2-7"], plan__stages__0__tp=2,
                            plan__stages__0__dp=2))
    assert any(p.startswith("plan.stages[1].devices: mixes device types") for p in found), found


def test_plan_tp_group_must_stay_in_one_node():
    data = edited(plan__stages__1__devices=["gpu-0:6-7", "npu-0:0-1"], plan__stages__0__devices=["gpu-0:0-5"])
    data["cluster"]["nodes"][1]["device"] = "nvidia-a100-80g"
    data["plan"]["stages"][0].update(tp=2, dp=1, layers=18)
    data["plan"]["stages"][0]["devices"] = ["gpu-0:0-1"]
    data["plan"]["stages"][1].update(tp=4, dp=1)
    found = problems(data)
    assert any(p.startswith("plan.stages[1].tp: tp group") and "spans nodes gpu-0, npu-0" in p for p in found), found


def test_precision_the_device_lacks():
    data = edited(plan="auto")
    data["cluster"]["nodes"][1]["device"] = "ascend-910a"
    data["plan"] = copy.deepcopy(GOOD["plan"])
    found = problems(data)
    assert any(p.startswith("plan.stages[1].devices: ascend-910a does not support bf16 (train.precision); set this "
                            "stage's precision (or train.precision) to fp16") for p in found), found


def test_a_stage_precision_the_device_lacks_names_the_stage():
    data = edited(plan="auto")
    data["cluster"]["nodes"][1]["device"] = "ascend-910a"
    data["plan"] = copy.deepcopy(GOOD["plan"])
    data["train"]["precision"] = "fp16"
    data["plan"]["stages"][1]["precision"] = "bf16"
    found = problems(data)
    assert any(p.startswith("plan.stages[1].precision: ascend-910a does not support bf16; set this stage's precision "
                            "to fp16 or fp32") for p in found), found
    data["plan"]["stages"][1]["precision"] = "fp16"
    data["plan"]["stages"][0]["precision"] = "fp32"
    assert not problems(data)


def test_every_problem_reported_not_just_the_first():
    found = problems(edited(cluster__nodes__0__count=0, train__steps=-1, model__num_layers="x", plan="auto"))
    assert len(found) == 3, found


def test_train_rules():
    found = problems(edited(train__min_lr=1.0, train__lr=0.1, plan="auto"))
    assert any(p.startswith("train.min_lr: 1 is above lr 0.1") for p in found), found
    found = problems(edited(train__global_batch_size=63, plan="auto"))
    assert "train.global_batch_size: 63 is not divisible by micro_batch_size 2" in found
    found = problems(edited(train__data={"path": "x.bin", "dtype": "int8"}, plan="auto"))
    assert any(p.startswith("train.data.dtype: must be one of uint16, uint32") for p in found), found


def test_yaml_syntax_error_names_file_line_column(write_yaml):
    path = write_yaml("cluster:\n  nodes: [a, b\nmodel: x\n")
    with pytest.raises(UserError) as info:
        load_job(path)
    assert str(info.value).startswith(f"{path}:3:")
    assert "YAML error" in str(info.value)


def test_duplicate_yaml_key_is_an_error(write_yaml):
    path = write_yaml("model: {preset: llama2-7b}\nmodel: {preset: llama3-8b}\n")
    with pytest.raises(UserError) as info:
        load_job(path)
    assert f"{path}:2:1: YAML error: duplicate key 'model'" == str(info.value)


def test_missing_file():
    with pytest.raises(UserError, match="file not found"):
        load_job("/nonexistent/job.yaml")


def test_catalog_aliases_and_case_resolve_to_canonical_names():
    data = edited(plan="auto")
    data["cluster"]["nodes"][1]["device"] = "ascend-910b"
    data["cluster"]["nodes"][0]["device"] = "NVIDIA-A100-80G"
    job = parse_job(data)
    assert [n.device for n in job.cluster.nodes] == ["nvidia-a100-80g", "ascend-910b3"]
