"""The chip catalog: required entries, sane numbers, lookup with did-you-mean, report output."""

from __future__ import annotations

import json
import math

import pytest

from heteroflow.config.device import VENDORS
from heteroflow.config.catalog import ALIASES, CATALOG, catalog_names, lookup
from heteroflow.devices.report import catalog_json, format_catalog
from heteroflow.errors import UserError

REQUIRED = [
    "nvidia-a100-40g", "nvidia-a100-80g", "nvidia-a800-80g", "nvidia-h100-sxm", "nvidia-h100-pcie",
    "nvidia-h100-nvl", "nvidia-h200", "nvidia-h200-nvl", "nvidia-b200", "nvidia-h800",
    "nvidia-h20", "nvidia-v100-32g", "amd-mi250x", "amd-mi300x", "hygon-z100", "hygon-k100", "hygon-k100-ai",
    "hygon-bw1000", "ascend-910a", "ascend-910b1", "ascend-910b2", "ascend-910b3", "ascend-910b4", "ascend-910c",
    "cpu",
]


def test_required_entries_present_and_keyed_by_name():
    assert set(REQUIRED) <= set(CATALOG)
    for key, spec in CATALOG.items():
        assert key == spec.name
    assert catalog_names() == list(CATALOG)


def test_a100_80g_listed_before_40g():
    names = catalog_names()
    assert names.index("nvidia-a100-80g") < names.index("nvidia-a100-40g")


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_fields_are_sane(name):
    spec = CATALOG[name]
    assert spec.vendor in VENDORS
    assert spec.source.strip()
    assert 1 <= spec.memory_gib <= 512
    rates = [spec.tflops_bf16, spec.tflops_fp16, spec.tflops_fp32]
    assert any(r is not None for r in rates), "a device must compute in some precision"
    for rate in rates:
        assert rate is None or (0 < rate < 5000 and math.isfinite(rate))
    for bandwidth in (spec.hbm_gb_per_s, spec.intra_node_gb_per_s, spec.host_link_gb_per_s):
        assert 0 < bandwidth < 10_000
    # Device memory is faster than the links out of it.
    assert spec.hbm_gb_per_s >= spec.intra_node_gb_per_s
    assert spec.hbm_gb_per_s >= spec.host_link_gb_per_s


def test_vendor_prefix_matches_vendor():
    for spec in CATALOG.values():
        assert spec.name == "cpu" or spec.name.startswith(spec.vendor + "-")


def test_fp16_only_chips():
    assert CATALOG["ascend-910a"].tflops_bf16 is None
    assert CATALOG["ascend-910a"].tflops_fp16 == 256
    v100 = CATALOG["nvidia-v100-32g"]
    assert v100.tflops_bf16 is None and v100.tflops_fp16 == 125
    assert v100.peak_tflops("bf16") is None


def test_specific_published_figures():
    assert CATALOG["nvidia-h100-sxm"].tflops_bf16 == 989  # dense, not the sparse 1979
    assert CATALOG["nvidia-a100-80g"].intra_node_gb_per_s == 300  # per direction of NVLink's 600
    mi250x = CATALOG["amd-mi250x"]
    assert mi250x.memory_gib == 64 and "GCD" in mi250x.source
    # dense halves of the datasheets' sparse figures; per direction halves of bidirectional links
    assert [CATALOG[n].tflops_bf16 for n in ("nvidia-h100-pcie", "nvidia-h100-nvl", "nvidia-h200", "nvidia-h200-nvl",
                                             "nvidia-b200")] == [756, 835, 989, 835, 2250]
    assert [CATALOG[n].hbm_gb_per_s for n in ("nvidia-h100-pcie", "nvidia-h100-nvl", "nvidia-h200",
                                              "nvidia-b200")] == [2000, 3900, 4800, 8000]
    assert (CATALOG["nvidia-h200"].memory_gib, CATALOG["nvidia-b200"].intra_node_gb_per_s) == (141, 900)
    die = CATALOG["ascend-910c"]  # one of the package's two dies, as torch_npu shows them
    assert (die.memory_gib, die.tflops_bf16, die.hbm_gb_per_s) == (64, 376, 1600)
    bw = CATALOG["hygon-bw1000"]
    assert (bw.memory_gib, bw.tflops_bf16, bw.intra_node_gb_per_s) == (64, 480, 100)


def test_vendors_that_publish_little_say_so():
    for name in ("hygon-z100", "hygon-k100", "hygon-bw1000", "ascend-910b1", "ascend-910b2",
                 "ascend-910b3", "ascend-910b4", "ascend-910c"):
        assert "approximate, public reports" in CATALOG[name].source
    assert "measured on the 2-core dev machine" in CATALOG["cpu"].source


def test_lookup_exact_case_insensitive_and_alias():
    assert lookup("nvidia-h100-sxm") is CATALOG["nvidia-h100-sxm"]
    assert lookup(" NVIDIA-H20 ") is CATALOG["nvidia-h20"]
    assert lookup("ascend-910b").name == ALIASES["ascend-910b"]
    assert lookup("nvidia-h200-sxm") is CATALOG["nvidia-h200"]
    for target in ALIASES.values():
        assert target in CATALOG


def test_lookup_unknown_suggests_close_names():
    with pytest.raises(UserError) as info:
        lookup("a100")
    message = str(info.value)
    assert "unknown chip 'a100'" in message
    assert "did you mean 'nvidia-a100-80g'" in message  # the 80 GB card comes first
    assert "nvidia-a100-40g" in message


def test_lookup_far_off_name_has_no_suggestion_but_says_where_to_look():
    with pytest.raises(UserError, match="devices --catalog") as info:
        lookup("tpu-v5p")
    assert "did you mean" not in str(info.value)


def test_catalog_report_and_json():
    text = format_catalog(CATALOG)
    for name in REQUIRED:
        assert name in text
    assert "per direction" in text
    data = catalog_json(CATALOG)
    assert [d["name"] for d in data] == catalog_names()
    assert json.loads(json.dumps(data)) == data
    assert data[catalog_names().index("ascend-910a")]["tflops_bf16"] is None
