"""The default search (`plan`, `plan: auto`) covers the whole priced space: cp where it pays (a long sequence on
memory-poor cards) and ZeRO-3 with offloaded state (ZeRO-Infinity); and `train` runs whatever it picks."""

from __future__ import annotations

import pytest

from heteroflow.config import parse_job
from heteroflow.stagemap import RUNTIME_LAYOUTS, SearchOptions, search_plan
from heteroflow.stagemap.layout import cp_choices, search_layouts


def _job(memory_gib: int, seq_length: int):
    cards = {"small-card": {"vendor": "nvidia", "memory_gib": memory_gib, "tflops_bf16": 300,
                            "intra_node_gb_per_s": 200}}
    return parse_job({"cluster": {"device_types": cards, "nodes": [{"name": "n0", "device": "small-card", "count": 8}]},
                      "model": {"preset": "llama2-7b", "seq_length": seq_length}, "train": {"global_batch_size": 8}})


def test_default_search_is_the_whole_priced_space():
    assert RUNTIME_LAYOUTS == SearchOptions()
    job = _job(24, 4096)
    layouts = search_layouts(job.model, num_devices=8, node_count=8, micro_batch_size=8)
    zero_infinity = {(lay.offload.optimizer, lay.offload.params) for lay in layouts
                     if lay.zero == 3 and lay.offload.moves_state}
    assert zero_infinity == {("cpu", "device"), ("ssd", "device"), ("cpu", "cpu"), ("ssd", "ssd")}
    assert {lay.cp for lay in layouts} == {1, 2, 4, 8}
    assert not any(lay.zero in (1, 2) and lay.offload.params != "device" for lay in layouts)  # not a layout
    assert any(lay.zero == 3 and lay.dp == 1 and lay.cp > 1 for lay in layouts)  # ZeRO-3 shards over cp alone


def test_cp_choices_keep_tp_x_cp_inside_a_node():
    assert cp_choices(8, 8, 2) == [1, 2, 4]
    assert cp_choices(16, 8, 2) == [1, 2, 4]  # two nodes: cp groups do not cross them
    assert cp_choices(4, 8, 1) == [1, 2, 4]  # a node slice


@pytest.mark.parametrize("memory_gib,seq_length", [(24, 65536), (80, 32768)])
def test_cp_is_chosen_where_it_pays(memory_gib, seq_length):
    job = _job(memory_gib, seq_length)
    best = search_plan(job).estimate
    without_cp = search_plan(job, options=SearchOptions(cp=(1,))).estimate
    assert best is not None and without_cp is not None
    assert max(stage.layout.cp for stage in best.plan.stages) > 1
    assert best.step_time_s < without_cp.step_time_s


def test_memory_poor_long_sequence_picks_zero_infinity():
    best = search_plan(_job(24, 65536)).estimate
    assert any(s.layout.zero == 3 and s.layout.offload.params != "device" and s.layout.cp > 1 for s in best.plan.stages)


def test_short_sequence_on_roomy_cards_keeps_cp_1():
    best = search_plan(_job(80, 4096)).estimate
    assert all(stage.layout.cp == 1 for stage in best.plan.stages)
