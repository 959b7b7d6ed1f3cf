"""Process groups and boundary transports for a heterogeneous plan.

`RankMap` places every rank; `build_process_groups` creates all groups in one order and returns this
rank's `ProcessGroups`; `StageBoundary` moves activations forward and gradients back across one
stage boundary, directly on the vendor backend or through the host-staged gloo bridge.
"""

from heteroflow.backends.boundary import StageBoundary
from heteroflow.backends.groups import BoundaryLink, ProcessGroups, build_process_groups, init_world
from heteroflow.backends.rankmap import RankInfo, RankMap, StageInfo
from heteroflow.backends.transport import DirectTransport, HostBridge, TransportStats
from heteroflow.backends.vendor import BRIDGE, DIRECT, boundary_kind, collective_backend

__all__ = [
    "BRIDGE", "BoundaryLink", "DIRECT", "DirectTransport", "HostBridge", "ProcessGroups", "RankInfo", "RankMap",
    "StageBoundary", "StageInfo", "TransportStats", "boundary_kind", "build_process_groups", "collective_backend",
    "init_world",
]
