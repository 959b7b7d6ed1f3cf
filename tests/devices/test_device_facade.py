"""The device facade: real on the CPU, emulated vendor labels, backends, and routing to torch.cuda."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from heteroflow.devices import Device, NullEvent, NullStream, collective_backend, emulated
from heteroflow.devices.probe import is_hygon_name
from heteroflow.errors import UserError


@pytest.mark.parametrize("vendor, backend", [
    ("nvidia", "nccl"), ("amd", "nccl"), ("hygon", "nccl"), ("ascend", "hccl"), ("cpu", "gloo")])
def test_backend_per_vendor(vendor, backend):
    assert collective_backend(vendor) == backend
    assert Device.for_vendor(vendor, 0).collective_backend == backend


def test_unknown_vendor_is_a_user_error():
    with pytest.raises(UserError, match="did you mean 'nvidia'"):
        collective_backend("nvida")
    with pytest.raises(UserError):
        Device.for_vendor("tpu", 0)
    with pytest.raises(UserError):
        Device.for_vendor("nvidia", -1)


def test_torch_device_strings():
    assert Device.for_vendor("nvidia", 3).torch_device_str == "cuda:3"
    assert Device.for_vendor("amd", 1).torch_device_str == "cuda:1"  # ROCm torch says cuda
    assert Device.for_vendor("ascend", 2).torch_device_str == "npu:2"
    assert Device.cpu().torch_device == torch.device("cpu")


@pytest.mark.parametrize("make", [lambda: Device.for_vendor("ascend", 5, emulate=True),
                                  lambda: emulated("ascend", 5)])
def test_emulated_device_keeps_its_label_but_runs_on_cpu(make):
    device = make()
    assert device.vendor_label == "ascend" and device.index == 5 and device.emulated
    assert device.torch_device == torch.device("cpu")
    assert device.collective_backend == "gloo"
    assert device.kind == "cpu"
    assert "emulated" in str(device)
    device.set_current()
    device.synchronize()


def test_from_probe_result():
    from heteroflow.devices import probe_local_devices

    cpu = probe_local_devices()[-1]
    device = Device.from_local(cpu)
    assert device == Device.cpu() and device.torch_device == torch.device(cpu.torch_device)


def test_seed_determinism():
    device = Device.cpu()
    device.manual_seed(1234)
    first = torch.randn(16, 16)
    device.manual_seed(1234)
    second = torch.randn(16, 16)
    device.manual_seed(4321)
    third = torch.randn(16, 16)
    assert torch.equal(first, second)
    assert not torch.equal(first, third)


def test_pinned_empty_on_cpu_is_plain_host_memory():
    buffer = Device.cpu().pinned_empty((3, 5), torch.bfloat16)
    assert buffer.shape == (3, 5) and buffer.dtype == torch.bfloat16
    assert buffer.device.type == "cpu"
    buffer.fill_(1.0)  # usable, not a placeholder
    assert buffer.sum().item() == 15


def test_stream_and_event_stand_ins():
    device = emulated("nvidia", 0)
    stream = device.new_stream()
    assert isinstance(stream, NullStream)
    start, end = device.new_event(enable_timing=True), device.new_event(enable_timing=True)
    assert isinstance(start, NullEvent)
    with device.stream_context(stream) as active:
        assert active is stream
        start.record(stream)
        time.sleep(0.01)
        x = torch.ones(4) * 2
        end.record(stream)
    with stream:  # like torch.Stream, usable directly
        stream.wait_stream(stream)
        stream.wait_event(end)
    end.synchronize()
    stream.synchronize()
    assert x.sum().item() == 8
    assert start.query() and stream.query()
    assert end.elapsed_time(start) < 0 < start.elapsed_time(end)
    assert start.elapsed_time(end) >= 5  # milliseconds, real wall time
    assert isinstance(stream.record_event(), NullEvent)


def test_unrecorded_event_has_no_elapsed_time():
    with pytest.raises(RuntimeError):
        NullEvent().elapsed_time(NullEvent())


def test_cpu_memory_accounting():
    device = Device.cpu()
    device.reset_peak_memory()
    before = device.memory_allocated_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # touched, so resident
    assert device.memory_allocated_bytes() >= before + 32 * 2**20
    peak = device.max_memory_allocated_bytes()
    del block
    assert peak >= before + 32 * 2**20
    assert device.max_memory_allocated_bytes() >= device.memory_allocated_bytes()
    assert device.total_memory_bytes() > peak


def test_cpu_supports_bf16():
    assert Device.cpu().supports_bf16
    assert emulated("ascend").supports_bf16  # the CPU runs the work, whatever the label


def test_missing_cuda_device_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(UserError, match="only 0 cuda device"):
        Device.for_vendor("nvidia", 0).set_current()


def test_every_runtime_call_checks_the_device_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    device = Device.for_vendor("nvidia", 0)
    for call in (device.memory_allocated_bytes, device.synchronize, device.new_stream,
                 lambda: device.pinned_empty((2,), torch.float32)):
        with pytest.raises(UserError, match="run with --emulate"):
            call()


def test_rocm_vendor_needs_rocm_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(UserError, match="ROCm"):
        Device.for_vendor("hygon", 0).memory_allocated_bytes()
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(UserError, match="CUDA build"):
        Device.for_vendor("nvidia", 0).memory_allocated_bytes()


def test_available_says_whether_the_device_is_here_without_raising(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert Device.cpu().available and emulated("ascend", 3).available
    assert Device.for_vendor("nvidia", 1).available and not Device.for_vendor("nvidia", 2).available
    assert not Device.for_vendor("amd", 0).available  # a CUDA build has no ROCm device
    assert not Device.for_vendor("ascend", 0).available  # no torch_npu


def test_ascend_without_torch_npu_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(UserError, match="torch_npu"):
        Device.for_vendor("ascend", 0).synchronize()


def test_cuda_calls_are_routed_with_the_index(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.version, "hip", None)
    for name, result in [("memory_allocated", 11), ("max_memory_allocated", 22),
                         ("reset_peak_memory_stats", None), ("synchronize", None),
                         ("set_device", None), ("device_count", 4)]:
        monkeypatch.setattr(torch.cuda, name,
                            lambda *args, _n=name, _r=result: calls.append((_n, args)) or _r)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=80 * 2**30, major=8))
    device = Device.for_vendor("nvidia", 2)
    assert device.memory_allocated_bytes() == 11
    assert device.max_memory_allocated_bytes() == 22
    assert device.total_memory_bytes() == 80 * 2**30
    assert device.supports_bf16
    device.reset_peak_memory()
    device.synchronize()
    device.set_current()
    assert ("set_device", (2,)) in calls and ("synchronize", (2,)) in calls
    assert ("memory_allocated", (2,)) in calls and ("reset_peak_memory_stats", (2,)) in calls
    with pytest.raises(UserError, match="only 4 cuda"):
        Device.for_vendor("nvidia", 4).set_current()


@pytest.mark.parametrize("name, expected", [("Ascend910A", False), ("Ascend910B2", True)])
def test_ascend_bf16_from_catalog(monkeypatch, name, expected):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu = types.SimpleNamespace(get_device_name=lambda i: name, is_available=lambda: True,
                                device_count=lambda: 1)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    assert Device.for_vendor("ascend", 0).supports_bf16 is expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_real_accelerator_smoke():
    vendor = "nvidia" if torch.version.hip is None else "amd"
    if vendor == "amd" and is_hygon_name(torch.cuda.get_device_name(0)):
        vendor = "hygon"
    device = Device.for_vendor(vendor, 0)
    device.set_current()
    device.reset_peak_memory()
    stream, event = device.new_stream(), device.new_event()
    with device.stream_context(stream):
        x = torch.ones(1024, 1024, device=device.torch_device)
        event.record(stream)
    event.synchronize()
    assert device.max_memory_allocated_bytes() >= x.numel() * 4
    host = device.pinned_empty((1024, 1024), torch.float32)
    assert host.is_pinned()
    host.copy_(x, non_blocking=True)
    device.synchronize()
    assert host.sum().item() == x.numel()
