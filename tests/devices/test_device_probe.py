"""Device probing: the CUDA, ROCm (AMD, Hygon) and Ascend paths with faked runtimes, the real CPU path,
and a broken torch_npu that must not break anything."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from heteroflow.devices import (
    CATALOG,
    LocalDevice,
    devices_json,
    format_devices,
    match_catalog_name,
    probe_local_devices,
)

GIB = 2**30
REPO_ROOT = Path(__file__).resolve().parents[2]


def fake_cuda(monkeypatch, cards, hip=None):
    """Make torch.cuda report `cards` ([(name, memory_gib)]), under CUDA or (hip set) ROCm."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cards))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties",
        lambda i: types.SimpleNamespace(name=cards[i][0], total_memory=int(cards[i][1] * GIB)),
    )
    monkeypatch.setattr(torch.version, "hip", hip)


def fake_npu(monkeypatch, cards, available=True):
    """Install a fake torch_npu module and torch.npu reporting `cards` ([(name, memory_gib)])."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu = types.SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: len(cards),
        get_device_name=lambda i: cards[i][0],
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=int(cards[i][1] * GIB)),
    )
    monkeypatch.setattr(torch, "npu", npu, raising=False)


@pytest.fixture(autouse=True)
def no_real_accelerators(monkeypatch):
    """Probe as a CPU-only machine unless a test fakes a runtime (also on hosts with a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` -> ImportError


def test_cpu_only_machine_finds_exactly_the_cpu():
    devices = probe_local_devices()
    assert len(devices) == 1
    cpu = devices[0]
    assert (cpu.vendor, cpu.index, cpu.torch_device, cpu.catalog_name) == ("cpu", 0, "cpu", "cpu")
    assert cpu.name.strip()
    assert cpu.memory_gib > 0.5


def test_cuda_path(monkeypatch):
    fake_cuda(monkeypatch, [("NVIDIA A100-SXM4-80GB", 79.2), ("NVIDIA A100-PCIE-40GB", 39.4)])
    devices = probe_local_devices()
    assert [d.torch_device for d in devices] == ["cuda:0", "cuda:1", "cpu"]
    a100_80, a100_40 = devices[:2]
    assert a100_80 == LocalDevice(vendor="nvidia", index=0, name="NVIDIA A100-SXM4-80GB",
                                  memory_gib=pytest.approx(79.2), catalog_name="nvidia-a100-80g",
                                  torch_device="cuda:0")
    assert (a100_40.vendor, a100_40.catalog_name) == ("nvidia", "nvidia-a100-40g")


def test_rocm_path_amd(monkeypatch):
    fake_cuda(monkeypatch, [("AMD Instinct MI300X", 191.5)] * 2, hip="6.2.41133")
    devices = probe_local_devices()
    assert [(d.vendor, d.catalog_name, d.torch_device) for d in devices[:2]] == [
        ("amd", "amd-mi300x", "cuda:0"), ("amd", "amd-mi300x", "cuda:1")]


@pytest.mark.parametrize("name, expected", [
    ("K100_AI", "hygon-k100-ai"),
    ("DCU K100", "hygon-k100"),
    ("Z100", "hygon-z100"),
    ("BW1000", "hygon-bw1000"),
    ("DCU Z100L", None),  # a Hygon part the catalog does not describe
])
def test_rocm_path_hygon(monkeypatch, name, expected):
    memory = 64 if expected is None else CATALOG[expected].memory_gib
    fake_cuda(monkeypatch, [(name, memory)], hip="5.7.24164")
    dcu = probe_local_devices()[0]
    assert (dcu.vendor, dcu.catalog_name, dcu.torch_device) == ("hygon", expected, "cuda:0")


def test_ascend_path(monkeypatch):
    fake_npu(monkeypatch, [("Ascend910B2", 61.0), ("Ascend910B2", 61.0), ("Ascend910A", 31.0)])
    devices = probe_local_devices()
    assert [(d.vendor, d.catalog_name, d.torch_device) for d in devices] == [
        ("ascend", "ascend-910b2", "npu:0"), ("ascend", "ascend-910b2", "npu:1"),
        ("ascend", "ascend-910a", "npu:2"), ("cpu", "cpu", "cpu")]


def test_ascend_runtime_without_devices(monkeypatch):
    fake_npu(monkeypatch, [("Ascend910B3", 61.0)], available=False)
    assert [d.vendor for d in probe_local_devices()] == ["cpu"]


@pytest.mark.parametrize("error", ["RuntimeError('built for torch 2.1')",
                                   "OSError('libhccl.so: cannot open shared object file')",
                                   "ImportError('undefined symbol: _ZN3c10')",
                                   "AttributeError('module torch has no attribute _C')"])
def test_broken_torch_npu_does_not_break_probing(monkeypatch, tmp_path, caplog, error):
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(f"raise {error}\n")
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    devices = probe_local_devices()
    assert [d.vendor for d in devices] == ["cpu"]
    assert "torch_npu is installed but does not import" in caplog.text


def test_torch_npu_that_fails_when_queried_does_not_break_probing(monkeypatch):
    fake_npu(monkeypatch, [("Ascend910B1", 61.0)])

    def broken():
        raise RuntimeError("drvGetDevNum failed")

    monkeypatch.setattr(torch.npu, "is_available", broken)
    assert [d.vendor for d in probe_local_devices()] == ["cpu"]


@pytest.mark.parametrize("vendor, name, memory_gib, expected", [
    ("nvidia", "NVIDIA A100-SXM4-80GB", 79.2, "nvidia-a100-80g"),
    ("nvidia", "NVIDIA A100-SXM4-40GB", 39.4, "nvidia-a100-40g"),
    ("nvidia", "NVIDIA A100 80GB PCIe", 79.2, "nvidia-a100-80g"),
    ("nvidia", "NVIDIA A800-SXM4-80GB", 79.3, "nvidia-a800-80g"),
    ("nvidia", "NVIDIA H100 80GB HBM3", 79.1, "nvidia-h100-sxm"),
    ("nvidia", "NVIDIA H100 PCIe", 79.6, "nvidia-h100-pcie"),
    ("nvidia", "NVIDIA H100 NVL", 93.6, "nvidia-h100-nvl"),
    ("nvidia", "NVIDIA H800", 79.1, "nvidia-h800"),
    ("nvidia", "NVIDIA H20", 95.0, "nvidia-h20"),
    ("nvidia", "NVIDIA H200", 139.8, "nvidia-h200"),  # not the H20
    ("nvidia", "NVIDIA H200 NVL", 140.4, "nvidia-h200-nvl"),
    ("nvidia", "NVIDIA B200", 179.1, "nvidia-b200"),
    ("nvidia", "NVIDIA GB200", 184.0, None),  # the Grace-Blackwell part is not the B200 (other clocks)
    ("nvidia", "NVIDIA H20", 139.8, None),  # memory far off the 96 GB entry: another card
    ("nvidia", "Tesla V100-SXM2-32GB", 31.7, "nvidia-v100-32g"),
    ("nvidia", "Tesla V100-SXM2-16GB", 15.8, None),  # memory far off the 32 GB entry
    ("nvidia", "NVIDIA GeForce RTX 4090", 23.6, None),
    ("amd", "AMD Instinct MI250X", 64.0, "amd-mi250x"),
    ("amd", "AMD Instinct MI300X", 191.5, "amd-mi300x"),
    ("amd", "AMD Instinct MI210", 64.0, None),
    ("ascend", "Ascend910B1", 61.0, "ascend-910b1"),
    ("ascend", "Ascend 910B-3", 61.0, "ascend-910b3"),
    ("ascend", "Ascend910B4", 30.0, "ascend-910b4"),
    ("ascend", "Ascend910PremiumA", 31.0, "ascend-910a"),
    ("ascend", "Ascend910ProB", 31.0, None),  # the old 910 Pro B is not a 910B
    ("ascend", "Ascend910_9392", 61.0, "ascend-910c"),  # one die of a 910C, as torch_npu names it
    ("ascend", "Ascend910_9381", 61.0, "ascend-910c"),
    ("ascend", "Ascend910C", 61.0, "ascend-910c"),
    ("ascend", "Ascend910_9362", 61.0, None),  # a bin the catalog does not describe
    ("ascend", "Ascend910B2C", 61.0, "ascend-910b2"),
    ("cpu", "anything", 4.0, "cpu"),
])
def test_match_catalog_name(vendor, name, memory_gib, expected):
    assert match_catalog_name(vendor, name, memory_gib) == expected


def test_an_unknown_card_is_unmatched_with_a_warning_saying_how_to_declare_it(monkeypatch, caplog):
    fake_cuda(monkeypatch, [("NVIDIA GB300", 268.0)] * 2)
    devices = probe_local_devices()
    probe_local_devices()
    assert [d.catalog_name for d in devices] == [None, None, "cpu"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"cuda:{i}: 'NVIDIA GB300' (268.0 GiB) matches no chip in the catalog; describe it under "
                      "cluster.device_types in the job YAML (a new name with vendor, memory_gib and peak rates; "
                      "`heteroflow devices --catalog` lists the fields) and pass that name to `heteroflow profile "
                      "--device-type`" for i in (0, 1)]  # once per device, however often it is probed


def test_match_without_memory_prefers_the_large_variant():
    assert match_catalog_name("nvidia", "NVIDIA A100-SXM4") == "nvidia-a100-80g"


def test_devices_report_and_json(monkeypatch):
    fake_cuda(monkeypatch, [("NVIDIA H100 80GB HBM3", 79.1), ("NVIDIA GeForce RTX 4090", 23.6)])
    devices = probe_local_devices()
    text = format_devices(devices)
    assert "cuda:0" in text and "nvidia-h100-sxm" in text and "(no match)" in text
    assert "cluster.device_types" in text
    data = devices_json(devices)
    assert json.loads(json.dumps(data)) == data
    assert data[0]["catalog_name"] == "nvidia-h100-sxm" and data[1]["catalog_name"] is None


def test_import_does_not_import_torch():
    code = textwrap.dedent("""
        import sys
        import heteroflow.devices as devices
        devices.lookup("nvidia-h100-sxm")
        devices.Device.for_vendor("ascend", 0, emulate=True).collective_backend
        devices.format_catalog(devices.CATALOG)
        heavy = sorted(m for m in ("torch", "torch_npu", "numpy") if m in sys.modules)
        assert not heavy, heavy
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
