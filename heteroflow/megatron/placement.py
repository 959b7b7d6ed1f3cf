"""Put a Megatron layout on a cluster: which devices each pipeline stage gets, in heteroflow's rank order.

Megatron numbers global ranks node by node (torchrun's node rank times processes per node, plus the
local rank) and lays the parallel axes over them tp fastest, then cp, dp, pp (`tp-cp-ep-dp-pp`), so
by default a pipeline stage is a contiguous block of tp*cp*dp ranks; `--use-tp-pp-dp-mapping` puts pp
inside dp and each stage's ranks then interleave. Inside a stage heteroflow's rank order is also tp,
then cp, then dp, so listing a stage's ranks in that order gives the same tp groups as Megatron.
"""

from __future__ import annotations

from heteroflow.config import ClusterSpec, DeviceRef
from heteroflow.errors import UserError
from heteroflow.megatron.layout import MegatronLayout

PLACEHOLDER_DEVICE = "<set-me>"
"""Device type written when neither --cluster nor --device-type says what the nodes hold."""


def generated_cluster(nnodes: int, nproc_per_node: int, device_type: str | None) -> dict:
    """A `cluster:` section of `nnodes` nodes named node-0.. with `nproc_per_node` devices each."""
    device = device_type or PLACEHOLDER_DEVICE
    return {"inter_node_gb_per_s": 25.0,
            "nodes": [{"name": f"node-{i}", "device": device, "count": nproc_per_node} for i in range(nnodes)]}


def stage_ranks(layout: MegatronLayout) -> list[list[int]]:
    """Global ranks of each pipeline stage, listed tp fastest, then cp, then dp."""
    par = layout.parallel
    sizes = {"tp": par.tp, "cp": par.cp, "dp": par.dp, "pp": layout.pp}

    def rank(coords: dict[str, int]) -> int:
        value, stride = 0, 1
        for axis in layout.rank_order:
            value += coords[axis] * stride
            stride *= sizes[axis]
        return value

    return [[rank({"tp": t, "cp": c, "dp": d, "pp": k}) for d in range(par.dp) for c in range(par.cp)
             for t in range(par.tp)] for k in range(layout.pp)]


def _compress(refs: list[DeviceRef], cluster: ClusterSpec) -> list[str]:
    """`[a:0, a:1, ..., b:0]` -> `["a", "b:0-3"]`: runs of consecutive devices of one node."""
    out: list[str] = []
    k = 0
    while k < len(refs):
        j = k
        while j + 1 < len(refs) and refs[j + 1].node == refs[k].node and refs[j + 1].index == refs[j].index + 1:
            j += 1
        first, last = refs[k].index, refs[j].index
        if first == 0 and last == cluster.node(refs[k].node).count - 1:
            out.append(refs[k].node)
        else:
            out.append(f"{refs[k].node}:{first}-{last}" if last > first else f"{refs[k].node}:{first}")
        k = j + 1
    return out


def place(layout: MegatronLayout, cluster: ClusterSpec) -> list[dict]:
    """The plan's stages (dicts in the plan YAML schema) for `layout` on the first ranks of `cluster`."""
    devices, par = cluster.devices(), layout.parallel
    if len(devices) < layout.world_size:
        raise UserError(f"the Megatron layout needs {layout.world_size} devices (tp {par.tp} x pp {layout.pp} x "
                        f"cp {par.cp} x dp {par.dp}); the cluster has {len(devices)}")
    stages = []
    for k, ranks in enumerate(stage_ranks(layout)):
        refs = [devices[r] for r in ranks]
        types = sorted({cluster.node(r.node).device for r in refs})
        if len(types) > 1:
            raise UserError(f"pipeline stage {k} (global ranks {min(ranks)}-{max(ranks)}) would span device types "
                            f"{', '.join(types)}; a heteroflow stage runs on one device type. Reorder the cluster's "
                            "nodes so that each group of "
                            f"{par.num_devices} consecutive devices shares a type, or plan it with "
                            "`heteroflow plan` instead")
        stages.append({"devices": _compress(refs, cluster), "layers": layout.stage_layers[k], **par.to_dict()})
    return stages


def plan_section(layout: MegatronLayout, cluster: ClusterSpec) -> dict:
    """The job's `plan:` section for the Megatron layout."""
    return {"schedule": "1f1b", "micro_batch_size": layout.plan_micro_batch_size, "stages": place(layout, cluster)}
