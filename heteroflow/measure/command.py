"""The work behind `heteroflow profile` (the CLI only parses arguments)."""

from __future__ import annotations

import sys

from heteroflow.config.yamlfile import dump_yaml
from heteroflow.measure.machine import measure_profile
from heteroflow.stagemap.commands import print_json
from heteroflow.stagemap.profile import save_profile


def profile_command(*, output: str | None = None, quick: bool = False, device_type: str | None = None,
                    disk_dir: str | None = None, as_json: bool = False, link: bool = True) -> int:
    """Measure this machine and write (or print) the profile."""
    profile = measure_profile(quick=quick, device_type=device_type, disk_dir=disk_dir, link=link)
    if output:
        save_profile(profile, output)
        print(f"wrote {output}", file=sys.stderr)
    if as_json:
        print_json({"profile": profile.to_dict()})
    elif not output:
        print(dump_yaml({"profile": profile.to_dict()}, sort_keys=False, default_flow_style=None), end="")
    else:
        dev = profile.devices[0]
        best = max((r for curve in dev.gemm_tflops.values() for _, r in curve), default=0.0)
        print(f"{dev.device_type}: up to {best:.3g} TFLOP/s GEMM, memory {dev.memory_gb_per_s:.3g} GB/s"
              + (f", link ({profile.link.backend}) {profile.link.gb_per_s:.3g} GB/s" if profile.link else "")
              + (f", disk read {profile.disk.read_gb_per_s:.3g} / write {profile.disk.write_gb_per_s:.3g} GB/s"
                 if profile.disk else ""))
    return 0
