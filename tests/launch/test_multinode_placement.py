"""Per-node environment in the cluster YAML, and which plan ranks each node runs (no processes)."""

from __future__ import annotations

import copy

import pytest

from conftest import problems
from heteroflow.backends import RankMap
from heteroflow.config import parse_job
from heteroflow.devices.facade import visible_devices_variable
from heteroflow.launcher.placement import node_environment, node_ranks, plan_nodes
from heteroflow.runtime.nodes import ENV_NODE, ENV_NODE_RANKS, ENV_VISIBLE, assigned_rank, node_view

JOB = {
    "cluster": {
        "env": {"NCCL_DEBUG": "WARN", "SHARED": "cluster", "GLOO_SOCKET_IFNAME": "eth0"},
        "device_types": {"ascend-910b2": {"env": {"HCCL_CONNECT_TIMEOUT": 1200, "SHARED": "npu"}}},
        "nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 4, "host": "10.0.0.1",
                   "env": {"SHARED": "gpu-0", "NCCL_IB_HCA": "mlx5_0"}},
                  {"name": "npu-0", "device": "ascend-910b2", "count": 4}],
    },
    "model": {"preset": "micro-llama"},
    "train": {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32"},
    # npu-0 sits between two gpu-0 stages: gpu-0 holds ranks 0 and 3, npu-0 ranks 1 and 2
    "plan": {"micro_batch_size": 2, "stages": [{"devices": ["gpu-0:2"], "layers": 1},
                                               {"devices": ["npu-0:0-1"], "layers": 2, "dp": 2},
                                               {"devices": ["gpu-0:1"], "layers": 1}]},
}


def with_cluster(**changes) -> dict:
    data = copy.deepcopy(JOB)
    data["cluster"].update(changes)
    return data


def test_env_merges_cluster_then_device_type_then_node():
    cluster = parse_job(JOB).cluster
    assert cluster.node_env("gpu-0") == {"NCCL_DEBUG": "WARN", "SHARED": "gpu-0", "GLOO_SOCKET_IFNAME": "eth0",
                                         "NCCL_IB_HCA": "mlx5_0"}
    assert cluster.node_env("npu-0") == {"NCCL_DEBUG": "WARN", "SHARED": "npu", "GLOO_SOCKET_IFNAME": "eth0",
                                         "HCCL_CONNECT_TIMEOUT": "1200"}  # numbers become strings


def test_env_round_trips_through_to_dict_and_leaves_catalog_types_alone():
    cluster = parse_job(JOB).cluster
    again = parse_job({**JOB, "cluster": cluster.to_dict()}).cluster
    assert again.to_dict() == cluster.to_dict()
    assert again.node_env("npu-0") == cluster.node_env("npu-0")
    # an env-only entry is the catalog chip itself, not an override
    from heteroflow.config.catalog import CATALOG
    assert cluster.device_types["ascend-910b2"] == CATALOG["ascend-910b2"]
    assert cluster.to_dict()["device_types"] == {"ascend-910b2": {"env": {"HCCL_CONNECT_TIMEOUT": "1200",
                                                                          "SHARED": "npu"}}}


@pytest.mark.parametrize("env,path,fragment", [
    (["A=1"], "cluster.env", "expected a mapping of variable names to values, got a list"),
    ({"1BAD": "x"}, "cluster.env.1BAD", "is not an environment variable name"),
    ({"RANK": "3"}, "cluster.env.RANK", "set by the launcher for each worker; remove it"),
    ({"HETEROFLOW_NODE_RANKS": "0"}, "cluster.env.HETEROFLOW_NODE_RANKS", "set by the launcher"),
    ({"TORCHELASTIC_RESTART_COUNT": "0"}, "cluster.env.TORCHELASTIC_RESTART_COUNT", "set by the launcher"),
    ({"NCCL_IB_DISABLE": True}, "cluster.env.NCCL_IB_DISABLE", "quote it"),
    ({"X": None}, "cluster.env.X", "expected a string or a number, got null"),
    ({"X": {"a": 1}}, "cluster.env.X", "expected a string or a number, got a mapping"),
])
def test_bad_cluster_env_names_the_path(env, path, fragment):
    found = problems(with_cluster(env=env))
    assert any(p.startswith(path + ":") and fragment in p for p in found), found


def test_bad_node_and_device_type_env_name_their_paths():
    data = copy.deepcopy(JOB)
    data["cluster"]["nodes"][1]["env"] = {"MASTER_PORT": "1"}
    data["cluster"]["device_types"] = {"nvidia-a100": {"env": {"A": "1"}}, "ascend-910b2": {"env": "x"}}
    found = problems(data)
    assert "cluster.nodes[1].env.MASTER_PORT: MASTER_PORT is set by the launcher for each worker; remove it" in found
    assert any(p.startswith("cluster.device_types.nvidia-a100: unknown device type 'nvidia-a100'") and
               "did you mean" in p for p in found), found
    assert any(p.startswith("cluster.device_types.ascend-910b2.env: expected a mapping") for p in found), found


def test_node_ranks_follow_device_order_and_need_not_be_contiguous():
    job = parse_job(JOB)
    rank_map = RankMap.from_plan(job.plan, job.cluster)
    assert plan_nodes(job.plan) == ["gpu-0", "npu-0"]
    gpu = node_ranks(rank_map, "gpu-0")
    assert gpu.ranks == (3, 0) and gpu.devices == (1, 2)  # local rank 0 is device 1, which plan rank 3 uses
    npu = node_ranks(rank_map, "npu-0")
    assert npu.ranks == (1, 2) and npu.devices == (0, 1)
    assert node_ranks(rank_map, "elsewhere").ranks == ()


def test_node_environment_places_ranks_and_limits_visible_devices():
    job = parse_job(JOB)
    env = node_environment(job, job.plan, "gpu-0", emulate=False)
    assert env[ENV_NODE] == "gpu-0" and env[ENV_NODE_RANKS] == "3,0"
    assert env["CUDA_VISIBLE_DEVICES"] == env[ENV_VISIBLE] == "1,2"
    assert env["SHARED"] == "gpu-0"
    npu = node_environment(job, job.plan, "npu-0", emulate=False)
    assert npu["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and npu["HCCL_CONNECT_TIMEOUT"] == "1200"
    # emulated ranks run on the CPU: no visible-devices variable
    assert "CUDA_VISIBLE_DEVICES" not in node_environment(job, job.plan, "gpu-0", emulate=True)


def test_yaml_visible_devices_wins_and_a_full_node_sets_none():
    data = copy.deepcopy(JOB)
    data["cluster"]["nodes"][0]["env"]["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
    job = parse_job(data)
    env = node_environment(job, job.plan, "gpu-0", emulate=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and ENV_VISIBLE not in env
    data = copy.deepcopy(JOB)
    data["plan"]["stages"][1]["devices"] = ["npu-0"]
    data["plan"]["stages"][1]["dp"] = 2
    data["plan"]["stages"][1]["tp"] = 2
    job = parse_job(data)
    assert "ASCEND_RT_VISIBLE_DEVICES" not in node_environment(job, job.plan, "npu-0", emulate=False)


def test_visible_devices_variable_per_vendor():
    assert [visible_devices_variable(v) for v in ("nvidia", "amd", "hygon", "ascend", "cpu")] == [
        "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", None]


def test_worker_side_rank_and_device_view(monkeypatch):
    job = parse_job(JOB)
    rank_map = RankMap.from_plan(job.plan, job.cluster)
    assert assigned_rank() is None and node_view(rank_map) is rank_map  # single node: elastic's numbering
    for name, value in node_environment(job, job.plan, "gpu-0", emulate=False).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert assigned_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert assigned_rank() == 0
    view = node_view(rank_map)
    # with CUDA_VISIBLE_DEVICES=1,2 physical devices 1 and 2 are cuda:0 and cuda:1; other nodes unchanged
    assert [view.info(r).local_device for r in range(4)] == [1, 0, 1, 0]
    assert [rank_map.info(r).local_device for r in range(4)] == [2, 0, 1, 1]
