"""The planner's ZeRO-Offload figures: the optimizer state in the tier divided by dp under ZeRO 1/2, none of it
on the device, and the step's host work and traffic per rank shrinking with dp as the runtime's do."""

from __future__ import annotations

import pytest

from heteroflow.config import PRESETS
from heteroflow.config.catalog import CATALOG
from heteroflow.layout import OffloadSpec, ParallelLayout
from heteroflow.stagemap.costs import StageHardware, stage_costs
from heteroflow.stagemap.hardware import Hardware, device_model
from heteroflow.stagemap.memory import memory_from_parts, memory_parts, offloaded_optimizer_bytes

MODEL = PRESETS["llama2-7b"]
A100 = device_model(CATALOG["nvidia-a100-80g"], "bf16")
PARTS = memory_parts(MODEL, tp=2, sp=False, tokens=4096.0, precision="bf16", capacity_gib=80)


@pytest.mark.parametrize("tier", ["cpu", "ssd"])
@pytest.mark.parametrize("zero", [1, 2])
def test_the_tier_holds_one_dp_share_of_the_state_and_the_device_none(zero, tier):
    sharded = ParallelLayout(tp=2, dp=4, zero=zero, offload=OffloadSpec(optimizer=tier))
    whole = ParallelLayout(tp=2, dp=4, zero=0, offload=OffloadSpec(optimizer=tier))
    on_device = ParallelLayout(tp=2, dp=4, zero=zero)
    for first, last in ((True, False), (False, True), (True, True)):
        held = offloaded_optimizer_bytes(PARTS, sharded).at(8, 0, first, last)
        assert held == pytest.approx(offloaded_optimizer_bytes(PARTS, whole).at(8, 0, first, last) / 4)
        # exactly what the same ZeRO stage keeps on the device when the state stays there
        assert held == pytest.approx(memory_from_parts(PARTS, on_device).optimizer.at(8, 0, first, last))
        assert memory_from_parts(PARTS, sharded).optimizer.at(8, 0, first, last) == 0
    assert offloaded_optimizer_bytes(PARTS, on_device).at(8, 0, True, True) == 0


@pytest.mark.parametrize("tier", ["cpu", "ssd"])
def test_zero_offload_shortens_the_step_tail_over_zero_0_offload(tier):
    """The host Adam, the SSD traffic and the weights' trip up cover 1/dp of the parameters per rank; every
    gradient still goes down."""
    hw = StageHardware(device=A100, num_devices=8, num_nodes=1, node_count=8)
    hardware = Hardware(models={}, inter_node_gb_per_s=25)
    tails = {zero: stage_costs(MODEL, hw, ParallelLayout(dp=8, zero=zero, offload=OffloadSpec(optimizer=tier)), 8,
                               hardware).tail_s(8, False, False) for zero in (0, 1, 2)}
    assert tails[1] < tails[0] and tails[2] < tails[0]
    assert tails[2] == pytest.approx(tails[1])  # ZeRO 2 runs as ZeRO 1 with the state offloaded
