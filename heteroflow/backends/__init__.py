"""Process groups and boundary transports for a heterogeneous plan.

`RankMap` places every rank; `build_process_groups` creates all groups in one order and returns this
rank's `ProcessGroups`; `StageBoundary` moves activations forward and gradients back across one
stage boundary, directly on the vendor backend or through the host-staged gloo bridge.

`RankMap` and the vendor rules are pure Python; the names that need torch load on first use, so
planning code can import this package on a machine without torch.
"""

from importlib import import_module

from heteroflow.backends.rankmap import RankInfo, RankMap, StageInfo
from heteroflow.backends.vendor import BRIDGE, DIRECT, boundary_kind, collective_backend

_LAZY = {
    "StageBoundary": "boundary", "BoundaryLink": "groups", "ProcessGroups": "groups",
    "build_process_groups": "groups", "init_world": "groups", "DirectTransport": "transport",
    "HostBridge": "transport", "TransportStats": "transport",
}

__all__ = ["BRIDGE", "DIRECT", "RankInfo", "RankMap", "StageInfo", "boundary_kind", "collective_backend", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"heteroflow.backends.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'heteroflow.backends' has no attribute {name!r}")
