"""This host's quick profile, for pricing emulated runs of a job that names no `cluster.profile`.

`train --emulate` and `plan --evaluate --emulate` run (or price) every rank as a local CPU process; without a
profile they were priced from default rates, far from what this machine does. The first such run measures
`heteroflow profile --quick` once and keeps it in heteroflow's cache directory (`HETEROFLOW_CACHE`, default
`~/.cache/heteroflow`) as `host-profile/<key>.yaml`, the key a hash of what describes the host (its name, CPU
model, core count, memory, Python and torch versions, the profile format): a different host or environment
measures its own. `HETEROFLOW_HOST_PROFILE=refresh` measures again (and replaces the file), `off` prices from
the defaults as before; a job's `cluster.profile` (or `plan --profile`) always wins.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import sys
from dataclasses import replace
from pathlib import Path

from heteroflow.config.job import JobConfig
from heteroflow.stagemap.profile import PROFILE_VERSION, Profile, load_profile, save_profile

ENV = "HETEROFLOW_HOST_PROFILE"
"""`refresh`: measure this host again; `off`: no host profile (emulated runs priced from the defaults)."""


def host_facts() -> dict[str, str]:
    """What the cached profile is keyed by."""
    import torch
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
            "cores": str(os.cpu_count() or 1), "memory_gib": f"{memory / 2**30:.0f}",
            "python": platform.python_version(), "torch": torch.__version__, "profile_version": str(PROFILE_VERSION)}


def host_profile_path(cache: Path, facts: dict[str, str] | None = None) -> Path:
    """Where this host's quick profile is cached under `cache`."""
    facts = facts if facts is not None else host_facts()
    key = hashlib.sha256(repr(sorted(facts.items())).encode()).hexdigest()[:16]
    return cache / "host-profile" / f"{key}.yaml"


def host_profile_file(cache: Path) -> Path | None:
    """This host's quick profile file under `cache`, measured (tens of seconds on an idle host) and written the
    first time or when `HETEROFLOW_HOST_PROFILE=refresh`; None when it is `off`."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode not in ("", "refresh", "off"):
        from heteroflow.errors import UserError
        raise UserError(f"{ENV}={mode}: expected refresh or off (or leave it unset)")
    if mode == "off":
        return None
    path = host_profile_path(cache)
    if path.exists() and mode != "refresh":
        return path
    print(f"heteroflow: measuring this host once to price emulated runs (`heteroflow profile --quick`); kept in "
          f"{path} (set {ENV}=refresh to measure again, {ENV}=off not to use it)", file=sys.stderr, flush=True)
    from heteroflow.measure.machine import measure_profile
    profile = measure_profile(quick=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.yaml")
    save_profile(profile, partial)
    os.replace(partial, path)  # a run starting meanwhile reads the old file or the new one, never half of it
    return path


def host_profile(cache: Path) -> Profile | None:
    """This host's quick profile (`host_profile_file`), or None when `HETEROFLOW_HOST_PROFILE=off`."""
    path = host_profile_file(cache)
    return load_profile(path) if path is not None else None


def emulation_profile(job: JobConfig, cache: Path) -> Profile | None:
    """The profile an emulated run of `job` is priced from when the caller has none: None when the job names
    a `cluster.profile` (it is read as before), else `host_profile`."""
    if job.cluster.profile:
        return None
    return host_profile(cache)


def emulation_job(job: JobConfig, cache: Path) -> JobConfig:
    """`job` naming this host's quick profile as its `cluster.profile` when it names none (for `tune --emulate`,
    whose trials, predictions and calibration all read the job's profile)."""
    if job.cluster.profile:
        return job
    path = host_profile_file(cache)
    return job if path is None else replace(job, cluster=replace(job.cluster, profile=str(path)))
