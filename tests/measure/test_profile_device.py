"""`heteroflow profile` measures the machine's accelerator through the device facade, whichever vendor it is:
on an Ascend machine (torch_npu faked here, as in tests/devices) the timing waits on the NPU runtime and the
profile describes the NPU, not the CPU; a card the catalog does not know is an error naming it."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from heteroflow.devices import Device
from heteroflow.errors import UserError
from heteroflow.measure import machine
from heteroflow.measure.machine import measure_profile

GIB = 2**30


@pytest.fixture
def fake_ascend(monkeypatch):
    """One Ascend card behind a faked torch_npu: `(calls, card)`, the calls its runtime gets and a function
    that swaps the card (name, memory in GiB).

    The CPU cannot hold NPU tensors, so the facade's tensors for it land on the CPU (`torch_device`, and
    unpinned host buffers); every runtime call (name, memory, current device, synchronize) goes to the fake."""
    calls: list[tuple] = []
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))

    def runtime(name, result=None):
        return lambda *args, **kwargs: calls.append((name, args)) or result

    def card(name: str, memory_gib: float) -> None:
        npu = types.SimpleNamespace(
            is_available=lambda: True, device_count=lambda: 1, get_device_name=runtime("get_device_name", name),
            get_device_properties=runtime("get_device_properties",
                                          types.SimpleNamespace(name=name, total_memory=int(memory_gib * GIB))),
            set_device=runtime("set_device"), synchronize=runtime("synchronize"))
        monkeypatch.setattr(torch, "npu", npu, raising=False)

    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda called on an Ascend machine")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    npu_on_cpu = property(lambda self: torch.device("cpu") if self.kind == "npu" else torch.device(self.torch_device_str))
    monkeypatch.setattr(Device, "torch_device", npu_on_cpu)
    monkeypatch.setattr(Device, "pinned_empty", lambda self, shape, dtype: torch.empty(tuple(shape), dtype=dtype))
    card("Ascend910B2", 61.0)
    monkeypatch.setattr(machine, "measure_cpu_thread", lambda quick: None)  # host-only figures, timed elsewhere
    return calls, card


def test_profile_on_an_ascend_machine_times_the_npu(fake_ascend, tmp_path):
    calls, _ = fake_ascend
    profile = measure_profile(quick=True, disk_dir=str(tmp_path), link=False)
    (device,) = profile.devices
    assert (device.device_type, device.vendor, device.description) == ("ascend-910b2", "ascend", "Ascend910B2")
    assert device.memory_gib == pytest.approx(61.0)
    assert all(rate > 0 for sizes in device.gemm_tflops.values() for _, rate in sizes)
    assert device.memory_gb_per_s > 0 and device.host_link_gb_per_s > 0 and device.launch_overhead_s > 0
    syncs = [args for name, args in calls if name == "synchronize"]
    # every timed loop (3 precisions x 3 sizes of GEMM, two copies, the launch loop) waits on NPU 0
    assert len(syncs) > 3 * 3 + 3 and set(syncs) == {(0,)}
    assert ("set_device", (0,)) in calls
    assert profile.emulation is None  # what emulated CPU ranks pay is measured on CPU hosts only


def test_an_unknown_card_is_named_with_how_to_declare_it(fake_ascend, tmp_path):
    _, card = fake_ascend
    card("Ascend999Z", 40.0)
    with pytest.raises(UserError, match=r"npu:0: no catalog entry matches 'Ascend999Z' \(40 GiB\); pass --device-type"):
        measure_profile(quick=True, disk_dir=str(tmp_path), link=False)
    profile = measure_profile(quick=True, disk_dir=str(tmp_path), link=False, device_type="ascend-910b3")
    assert (profile.devices[0].device_type, profile.devices[0].vendor) == ("ascend-910b3", "ascend")
