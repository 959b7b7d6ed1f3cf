"""The supported torch range: the floor pyproject.toml declares, ZeRO-3 refused by name on a torch whose FSDP2
lacks what it calls, and torch elastic's rendezvous clock made compatible across torch 2.6 (nodes of one job
may run different torch builds). `tools/check_torch_range.sh` runs the real floor build."""

from __future__ import annotations

import datetime
import importlib.util
import re
import sys
import tomllib

import pytest
import torch
from torch.distributed import fsdp

from conftest import REPO
from heteroflow.devices.torch_support import PARAMS_OFFLOAD_TORCH, TORCH_FLOOR, ZERO3_TORCH, check_params_offload, \
    fsdp2_for_zero3
from heteroflow.errors import UserError
from heteroflow.launcher.launch import aware_rendezvous_clock


def test_pyproject_and_readme_state_the_floor():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={TORCH_FLOOR}" in dependencies
    readme = (REPO / "README.md").read_text()
    assert f"torch >= {TORCH_FLOOR}" in readme and f"need torch >= {ZERO3_TORCH}" in readme
    assert ZERO3_TORCH == PARAMS_OFFLOAD_TORCH  # the README gives one version for both


def test_zero3_runs_on_this_torch():
    assert fsdp2_for_zero3() is fsdp


def test_zero3_on_a_torch_without_the_sum_reduction_is_refused_by_name(monkeypatch):
    class OldFSDPModule:  # torch 2.6-2.7: FSDP2 public, without the setters ZeRO-3 needs
        def set_modules_to_forward_prefetch(self, modules):
            pass

    monkeypatch.setattr(fsdp, "FSDPModule", OldFSDPModule)
    want = (f"ZeRO-3 (zero: 3) needs torch >= 2.8 (this process has torch {torch.__version__}, whose "
            "torch.distributed.fsdp lacks FSDPModule.set_gradient_divide_factor, "
            "FSDPModule.set_force_sum_reduction_for_comms); run this stage's ranks on a newer torch, or give the "
            "stage zero 0, 1 or 2")
    with pytest.raises(UserError, match=re.escape(want)):
        fsdp2_for_zero3()


def test_zero3_on_a_torch_with_fsdp2_only_private_is_refused(monkeypatch):
    for name in ("fully_shard", "CPUOffloadPolicy", "OffloadPolicy"):  # torch 2.4-2.5: under _composable only
        monkeypatch.delattr(fsdp, name)
    with pytest.raises(UserError, match=r"lacks fully_shard, OffloadPolicy, CPUOffloadPolicy\);"):
        fsdp2_for_zero3()


def test_params_offload_on_a_torch_that_cannot_see_the_active_hooks_is_refused_by_name(monkeypatch):
    from heteroflow.devices import Device
    from heteroflow.offload.params import OffloadedParams
    from heteroflow.offload.store import TieredStore

    check_params_offload()  # this torch has it
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")  # torch < 2.8
    store = TieredStore(device=Device.cpu())
    want = (f"parameter offload (offload: {{params: cpu|ssd}}) needs torch >= {PARAMS_OFFLOAD_TORCH} (this process "
            f"has torch {torch.__version__}, which cannot tell which saved-tensor hooks are active)")
    with pytest.raises(UserError, match=re.escape(want)):
        OffloadedParams([torch.nn.Linear(4, 4)], store=store, tier="cpu")


OLD_RENDEZVOUS = """\
from datetime import datetime, timedelta


def heartbeat():
    return datetime.utcnow()


def expired(last_heartbeat):
    return last_heartbeat < datetime.utcnow() - timedelta(seconds=30)
"""
"""What torch 2.4 and 2.5's `dynamic_rendezvous` does with its time stamps (naive UTC)."""


def test_rendezvous_stamps_of_an_old_torch_compare_with_a_new_torchs(tmp_path, monkeypatch):
    path = tmp_path / "old_dynamic_rendezvous.py"
    path.write_text(OLD_RENDEZVOUS)
    spec = importlib.util.spec_from_file_location("old_dynamic_rendezvous", path)
    old = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "old_dynamic_rendezvous", old)
    spec.loader.exec_module(old)
    new_heartbeat = datetime.datetime.now(datetime.timezone.utc)  # torch >= 2.6 stamps
    with pytest.raises(TypeError, match="offset-naive and offset-aware"):
        old.expired(new_heartbeat)
    aware_rendezvous_clock(old)
    aware_rendezvous_clock(old)  # twice is once
    assert old.heartbeat().tzinfo is datetime.timezone.utc
    assert not old.expired(new_heartbeat) and old.expired(new_heartbeat - datetime.timedelta(minutes=1))


def test_this_torchs_rendezvous_is_left_as_it_is():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    before = dynamic_rendezvous.datetime
    aware_rendezvous_clock(dynamic_rendezvous)
    assert dynamic_rendezvous.datetime is before
