"""Model presets carry the published shapes; fields next to a preset override it."""

from __future__ import annotations

import pytest

from heteroflow.config import PRESETS, parse_job, parse_model
from heteroflow.config.reader import Problems

from conftest import REPO

# Published parameter counts (model cards / papers), in billions.
PUBLISHED_B = {
    "llama2-7b": 6.74, "llama2-13b": 13.02, "llama2-70b": 68.98, "llama3-8b": 8.03, "llama3-70b": 70.55,
    "qwen2.5-7b": 7.62, "qwen3-8b": 8.19, "gpt3-175b": 175.0,
}


@pytest.mark.parametrize("name,billions", PUBLISHED_B.items())
def test_preset_parameter_counts_match_published(name, billions):
    assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_fields_override_a_preset():
    problems = Problems()
    spec = parse_model({"preset": "llama3-8b", "seq_length": 2048, "num_layers": 4}, problems)
    assert problems.items == []
    assert (spec.seq_length, spec.num_layers, spec.hidden_size) == (2048, 4, 4096)
    assert spec.rope_theta == 500000.0


def test_preset_shorthand_string():
    problems = Problems()
    assert parse_model("qwen3-8b", problems) == PRESETS["qwen3-8b"]
    assert PRESETS["qwen3-8b"].kv_channels == 128


def test_plan_round_trips_through_a_plan_file(tmp_path):
    import yaml

    from heteroflow.config import load_job, load_plan_file
    job = load_job(REPO / "configs/jobs/qwen2.5-7b-dcu.yaml")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({"plan": {**job.plan.to_dict(), "predicted": {"step_time_s": 1.0}}}))
    assert load_plan_file(plan_file, job) == job.plan
    assert job.plan.stages[1].layout.offload.optimizer == "cpu" and job.plan.stages[0].layout.sp


def test_job_round_trips_through_its_dict():
    from heteroflow.config import load_job
    job = load_job(REPO / "configs/jobs/llama3-70b-three-vendor.yaml")
    again = parse_job(job.to_dict(), base_dir=job.base_dir)
    assert again == job
