"""Per-stage figures of a step record and the end-of-train table, without processes."""

from __future__ import annotations

import pytest

from heteroflow.runtime.stage_table import ROWS, stage_table
from heteroflow.runtime.stage_times import MEASURED, PREDICTED, rank_figures, stage_records
from heteroflow.stagemap.breakdown import PARTS


def test_rank_figures_follow_the_parts_and_leave_the_rest_as_other():
    figures = rank_figures({"forward": 0.2, "backward": 0.3, "wait": 0.1, "optimizer": 0.05}, step_s=0.7)
    by_key = dict(zip(MEASURED, figures))
    assert by_key["forward_s"] == 0.2 and by_key["collective_s"] == 0.0 and by_key["step_s"] == 0.7
    assert by_key["other_s"] == pytest.approx(0.05)
    assert sum(by_key[k] for k in PARTS) + by_key["other_s"] == pytest.approx(by_key["step_s"])


def _record(step: int, scale: float) -> dict:
    measured = [{k: scale * (i + 1) * 0.01 for i, k in enumerate(MEASURED)} for _ in range(2)]
    predicted = tuple({k: 0.01 for k in PREDICTED} for _ in range(2))
    return {"step": step, "stages": stage_records(measured, predicted, ["gpu-a", "npu-b"])}


def test_the_table_leaves_out_the_warm_up_and_divides_measured_by_predicted():
    # Warm-up steps are ten times slower: a table that kept them would show ratios near 10.
    records = [_record(step, 10.0 if step < 2 else 1.0) for step in range(6)]
    table = stage_table(records)
    lines = table.splitlines()
    assert "mean of steps 2-5, after 2 warm-up steps" in lines[0] and "s1 npu-b" in lines[0]
    assert lines[1].split() == ["part", "s0", "pred", "meas", "ratio", "s1", "pred", "meas", "ratio"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert list(rows) == [k.removesuffix("_s") for k in ROWS]
    assert rows["forward"] == ["0.0100", "0.0100", "1.00"] * 2
    assert rows["backward"][2] == "2.00"
    assert rows["other"][0] == "-" and rows["other"][2] == "-"  # not priced


def test_no_table_without_stage_figures():
    assert stage_table([{"step": 0}]) is None


def test_a_part_no_stage_has_is_left_out():
    records = [_record(step, 1.0) for step in range(4)]
    for record in records:
        for stage in record["stages"]:
            stage["measured"]["alltoall_s"] = stage["predicted"]["alltoall_s"] = 0.0  # a dense model
    rows = [line.split()[0] for line in stage_table(records).splitlines()[2:]]
    assert "alltoall" not in rows and "forward" in rows and rows[-1] == "step"
