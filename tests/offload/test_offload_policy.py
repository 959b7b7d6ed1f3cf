"""OffloadPolicy from a plan's stage: tiers, per-rank budget from the device's memory, traffic to price."""

from __future__ import annotations

import pytest

from heteroflow.config import load_job
from heteroflow.errors import UserError
from heteroflow.offload.policy import GIB, OffloadPolicy, device_budget_bytes, offload_traffic
from offload_testkit import REPO  # noqa: F401

JOB = REPO / "configs" / "jobs" / "qwen2.5-7b-dcu.yaml"


def test_from_stage_reads_tiers_and_budget(monkeypatch, tmp_path):
    job = load_job(JOB)
    fast, slow = job.plan.stages
    monkeypatch.setenv("HETEROFLOW_SWAP_DIR", str(tmp_path))
    on_device = OffloadPolicy.from_stage(fast, cluster=job.cluster)
    assert (on_device.optimizer, on_device.params, on_device.activations) == ("device", "device", "device")
    assert not on_device.any and on_device.swap_root is None
    policy = OffloadPolicy.from_stage(slow, cluster=job.cluster, max_in_flight=4)
    assert policy.optimizer == "cpu" and policy.any and not policy.uses_ssd and policy.max_in_flight == 4
    memory_gib = job.cluster.device_types[slow.device_type].memory_gib
    assert policy.device_budget_bytes == int(memory_gib * GIB * 0.95 - 2 * GIB)
    assert policy.to_dict()["optimizer"] == "cpu"


def test_budget_and_tier_errors():
    assert device_budget_bytes(80, reserve_gib=0, reserve_fraction=0) == 80 * GIB
    with pytest.raises(UserError, match="leaves no memory"):
        device_budget_bytes(1.5)
    with pytest.raises(UserError, match="offload.activations: 'ssd' is not one of device, cpu"):
        OffloadPolicy(activations="ssd")
    with pytest.raises(UserError, match="multiple of 4096"):
        OffloadPolicy(chunk_numel=1000)


def test_traffic_per_step():
    n, mb = 1_000_000, 4
    none = offload_traffic(OffloadPolicy(), num_params=n, param_bytes=2, num_micro_batches=mb)
    assert none.seconds(host_link_gb_per_s=25, disk_read_gb_per_s=2, disk_write_gb_per_s=1,
                        cpu_adam_params_per_s=1e9) == 0
    opt_cpu = offload_traffic(OffloadPolicy(optimizer="cpu"), num_params=n, param_bytes=2, num_micro_batches=mb)
    assert (opt_cpu.device_to_host, opt_cpu.host_to_device, opt_cpu.disk_read) == (2 * n, 2 * n, 0)
    full = offload_traffic(OffloadPolicy(optimizer="ssd", params="ssd"), num_params=n, param_bytes=2,
                           num_micro_batches=mb)
    assert full.disk_read == 2 * 2 * n * mb + 12 * n and full.disk_write == 2 * n + 12 * n
    assert full.host_to_device == 2 * 2 * n * mb and full.cpu_adam_params == n


def test_measure_offload_for_the_profile(tmp_path, monkeypatch):
    from heteroflow.offload.measure import measure_offload

    monkeypatch.setenv("HETEROFLOW_AIO", "threads")
    monkeypatch.setenv("HETEROFLOW_CPU_ADAM", "torch")
    bw = measure_offload(str(tmp_path), nbytes=16 << 20, chunk_bytes=4 << 20, adam_params=1 << 16)
    assert bw.disk_write_gb_per_s > 0 and bw.disk_read_gb_per_s > 0 and bw.host_copy_gb_per_s > 0
    assert bw.cpu_adam_params_per_s > 0
    assert (bw.io_path, bw.adam_path) == ("threads-odirect", "torch-adamw")
    assert not list(tmp_path.iterdir())  # the scratch directory is gone
    assert set(bw.to_dict()) >= {"disk_read_gb_per_s", "disk_write_gb_per_s"}


def test_policy_imports_without_torch():
    import os
    import subprocess
    import sys

    code = "import sys, heteroflow.offload.policy, heteroflow.offload; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.stdout.strip() == "False"  # the planner prices offload on machines without torch
