"""Did-you-mean for device types ranks the chip family and generation the user typed first."""

from __future__ import annotations

import pytest

from heteroflow.config.catalog import ALIASES, CATALOG
from heteroflow.config.chip_names import device_type_hint


def suggested(name: str) -> list[str]:
    hint = device_type_hint(name, CATALOG, ALIASES)
    return [part.strip("'") for part in hint.removeprefix(" (did you mean ").removesuffix("?)").split(" or ")] \
        if hint else []


@pytest.mark.parametrize("typed, first", [
    ("nvidia-a100", ["nvidia-a100-80g", "nvidia-a100-40g"]),  # the A100s, never the H100 a letter away
    ("nvidia-a100-80", ["nvidia-a100-80g", "nvidia-a100-40g"]),  # the generation typed before the A800 80 GB
    ("NVIDIA-A800", ["nvidia-a800-80g"]),
    ("nvida-h800", ["nvidia-h800"]),  # a vendor typo still finds the family
    ("ascend910b2", ["ascend-910b2"]),
    ("amd-mi300", ["amd-mi300x"]),
    ("hygon-k100ai", ["hygon-k100-ai"]),
    ("a100", ["nvidia-a100-80g", "nvidia-a100-40g"]),
])
def test_the_family_and_generation_typed_rank_first(typed, first):
    assert suggested(typed)[:len(first)] == first


def test_other_families_never_come_before_the_one_typed():
    for typed in ("nvidia-a100", "nvidia-a100-80"):
        names = suggested(typed)
        assert "nvidia-h100" not in names and "nvidia-h100-sxm" not in names
        assert names == ["nvidia-a100-80g", "nvidia-a100-40g", "nvidia-a800-80g"]  # same family, other generation last


def test_a_shorthand_and_its_name_are_not_both_suggested():
    names = suggested("nvidia-h10")
    assert not {"nvidia-h100", "nvidia-h100-sxm"} <= set(names)


def test_far_off_names_get_no_suggestion_and_the_cluster_error_uses_the_ranking():
    assert device_type_hint("tpu-v5p", CATALOG, ALIASES) == ""
    from conftest import problems
    [line] = problems({"cluster": {"nodes": [{"name": "a", "device": "nvidia-a100", "count": 2}]},
                       "model": {"preset": "micro-llama"}, "train": {"global_batch_size": 4}})
    assert line.startswith("cluster.nodes[0].device: unknown device type 'nvidia-a100' (did you mean "
                           "'nvidia-a100-80g' or 'nvidia-a100-40g'")
