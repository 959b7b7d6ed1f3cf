"""End-to-end: `heteroflow profile` as a user runs it, and a job priced with the profile it writes."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO
from heteroflow.stagemap import load_profile

EMULATED = REPO / "configs" / "jobs" / "emulated-three-vendor.yaml"


def heteroflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_quick_profile_writes_a_profile_a_job_can_use(tmp_path):
    profile = tmp_path / "profile.yaml"
    result = heteroflow("profile", "--quick", "-o", str(profile), "--disk-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    loaded = load_profile(profile)
    cpu = loaded.device("cpu")
    assert cpu is not None and cpu.gemm_tflops["fp32"][0][1] > 0 and cpu.memory_gb_per_s > 0
    assert loaded.link is not None and loaded.link.backend == "gloo" and loaded.link.gb_per_s > 0
    assert loaded.disk is not None and loaded.disk.read_gb_per_s > 0
    assert loaded.link.allreduce_gb_per_s > 0 and loaded.link.allreduce_latency_s > 0
    thread = loaded.cpu_thread  # what one thread does: prices the ranks of `train --emulate`
    assert thread is not None and thread.elementwise_gb_per_s > 0 and thread.block_backward_overhead_s > 0
    assert all(r > 0 for _, f, b in thread.attention_tflops["fp32"] for r in (f, b))
    assert all(f > 0 and b > 0 for f, b in thread.reference_block_s.values())
    busy = loaded.emulation  # what emulated ranks pay beyond those rates, measured as a step meets it
    assert busy is not None and [r for r, _ in busy.busy_latency_s] == [1.0, 2.0]  # quick: 1 and 2 a core
    latencies = [t for _, t in busy.busy_latency_s]
    assert all(t > 0 for t in latencies) and latencies == sorted(latencies)  # more sharing never waits less
    cores = loaded.host.cpu_cores
    assert [t for t, _ in busy.thread_speedup] == ([float(cores)] if cores > 1 else [])
    assert all(1.0 <= v <= cores for _, v in busy.thread_speedup)
    assert [r for r, _ in busy.oversubscribed_slowdown] == [2.0] and busy.oversubscribed_slowdown[0][1] >= 1.0
    # what tp 2 adds to a block outside its collectives, as the runtime's timer separates them
    assert len(busy.tp_block_overhead_s) == 2 and all(0 <= v < 0.1 for v in busy.tp_block_overhead_s)
    # the core time of a transfer's send or receive between busy processes, never less with more of them
    spent = [v for _, v in busy.transfer_cpu_s]
    assert [r for r, _ in busy.transfer_cpu_s] == [1.0, 2.0] and all(0 < v < 0.1 for v in spent)
    assert spent == sorted(spent)
    # a job naming the profile is priced with it
    job = tmp_path / "job.yaml"
    job.write_text(EMULATED.read_text().replace("cluster: ../clusters/cpu-emulation.yaml",
                                                f"cluster:\n  profile: {profile.name}\n  nodes:\n"
                                                "    - {name: gpu-0, device: cpu, count: 2}\n"
                                                "    - {name: npu-0, device: cpu, count: 2}\n"
                                                "    - {name: dcu-0, device: cpu, count: 4}"))
    result = heteroflow("plan", str(job), "--evaluate", "--json")
    assert result.returncode == 0, result.stderr
