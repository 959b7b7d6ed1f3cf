"""Text tables and JSON data for `heteroflow devices [--catalog] [--json]`."""

from __future__ import annotations

from typing import Mapping, Sequence

from heteroflow.config.device import DeviceSpec
from heteroflow.devices.probe import LocalDevice


def format_devices(devices: Sequence[LocalDevice]) -> str:
    """A table of the local devices: torch device, vendor, reported name, memory, catalog match."""
    rows = [
        [d.torch_device, d.vendor, d.name, f"{d.memory_gib:.1f}", d.catalog_name or "(no match)"]
        for d in devices
    ]
    table = _table(["device", "vendor", "name", "memory GiB", "catalog"], rows)
    if any(d.catalog_name is None for d in devices):
        table += ("\n\nUnmatched devices need an entry under cluster.device_types in the job YAML "
                  "(see `heteroflow devices --catalog` for the fields).")
    return table


def format_catalog(catalog: Mapping[str, DeviceSpec]) -> str:
    """A table of chip specs (dense TFLOP/s, GB/s per direction), then each entry's source."""
    rows = [
        [s.name, s.vendor, _num(s.memory_gib), _num(s.tflops_bf16), _num(s.tflops_fp16),
         _num(s.tflops_fp32), _num(s.hbm_gb_per_s), _num(s.intra_node_gb_per_s),
         _num(s.host_link_gb_per_s)]
        for s in catalog.values()
    ]
    headers = ["name", "vendor", "mem GiB", "bf16 TF", "fp16 TF", "fp32 TF", "HBM GB/s",
               "intra GB/s", "host GB/s"]
    notes = "\n".join(f"  {s.name}: {s.source}" for s in catalog.values() if s.source)
    legend = ("TF = dense peak TFLOP/s ('-' = unsupported or unpublished); "
              "link bandwidths are per direction.")
    return f"{_table(headers, rows)}\n\n{legend}\nSources:\n{notes}" if notes else _table(headers, rows)


def devices_json(devices: Sequence[LocalDevice]) -> list[dict]:
    """The local devices as JSON-serialisable data, one mapping per device."""
    return [d.to_dict() for d in devices]


def catalog_json(catalog: Mapping[str, DeviceSpec]) -> list[dict]:
    """The catalog as JSON-serialisable data, one mapping per chip in catalog order."""
    return [spec.to_dict() for spec in catalog.values()]


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:g}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    # Numbers right-aligned so magnitudes line up; text left-aligned.
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    numeric = [all(_is_number(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _is_number(cell: str) -> bool:
    if cell == "-":
        return True
    try:
        float(cell)
    except ValueError:
        return False
    return True
