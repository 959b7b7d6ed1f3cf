"""The planner's search space: device classes, the device groups a stage may use, templates of stages.

- A *device class* is the nodes of one device type with the same device count, computing in one precision
  (`stage_precisions`). A device type that cannot train in the job's precision has one class per
  precision it can train in, over the same nodes; a template uses at most one of them.
- A stage uses a *group*: an equal slice of one node (a divisor of its device count) or a run of whole
  nodes of one class. All stages of a class in a plan have the same size, and a used class is cut into as
  many such groups as it holds (devices left over by a size that does not divide the class stay idle, as
  do classes the plan does not use).
- A *template* is the ordered list of used classes with their group sizes: the stages of one class are
  contiguous in the pipeline, and the order of the classes is searched.
- Per stage: layers (any positive split summing to the model's layers) and layout (tp inside a node, cp
  with tp x cp inside a node, dp the rest; sp, ZeRO 0-3, recompute, offload of optimizer state, parameters and
  activations, ZeRO-3 with offload (ZeRO-Infinity) included; the class's precision; for a MoE model ep and etp,
  so stages may differ in ep); per plan: micro-batch size (dividing the global batch) and schedule. Every layout
  the planner prices is run by `heteroflow train`.

Precision (`stage_precisions`): `train.precision` is pinned on every device type that can train in it;
only a device type that cannot (Ascend 910A has no bf16) gets another precision, the fastest plan among
those it supports (bf16, fp16, fp32; fp16 for a 910A). A plan names a stage's precision only where it
differs from `train.precision`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from heteroflow.config.cluster import DeviceRef
from heteroflow.config.job import JobConfig
from heteroflow.layout import OffloadSpec
from heteroflow.stagemap.hardware import Hardware
from heteroflow.stagemap.layout import OFFLOAD_CHOICES, cp_choices, search_layouts, tp_choices


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    """Which parts of the space to search (tests and baselines narrow it)."""

    micro_batch_sizes: tuple[int, ...] | None = None
    """None: every divisor of the global batch up to `max_micro_batch_size`."""
    max_micro_batch_size: int = 64
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload: tuple[OffloadSpec, ...] = OFFLOAD_CHOICES
    offload_zero: tuple[int, ...] | None = None
    """ZeRO stages allowed for a layout whose optimizer state or parameters leave the device (None: any in `zero`)."""
    sp: tuple[bool, ...] = (False, True)
    cp: tuple[int, ...] | None = None
    """cp degrees searched (None: every one `layout.cp_choices` allows)."""
    device_types: tuple[str, ...] | None = None
    """Only these device types (None: all)."""
    expert_parallel: bool = True
    """Search a MoE model's expert layouts (ep > 1, etp other than tp); False: experts follow tp (ep 1)."""
    ep: tuple[int, ...] | None = None
    """Only these expert-parallel degrees for a MoE model's stages (None: every one `layout.expert_choices` allows)."""
    include_megatron: bool = True
    """Also consider the megatron_uniform plan (which may fall outside the template space)."""


RUNTIME_LAYOUTS = SearchOptions()
"""The layouts `heteroflow train` runs: the whole space the planner prices (ZeRO 0-3, cp, every offload tier,
ZeRO-3 with offload as ZeRO-Infinity, a MoE model's ep and etp per stage). `heteroflow plan`, `plan: auto` and
`tune` search it."""

@dataclass(frozen=True, slots=True)
class DeviceClass:
    """Nodes of one device type with `node_count` devices each, in cluster order, computing in `precision`."""

    device_type: str
    node_count: int
    nodes: tuple[str, ...]
    precision: str

    @property
    def num_devices(self) -> int:
        return self.node_count * len(self.nodes)


@dataclass(frozen=True, slots=True)
class Group:
    """The devices of one stage, spelled as a plan writes them."""

    devices: tuple[str, ...]
    refs: tuple[DeviceRef, ...] = field(compare=False)
    nodes: frozenset[str] = field(compare=False)


def stage_precisions(job: JobConfig, hardware: Hardware, device_type: str) -> tuple[str, ...]:
    """The precisions a searched stage on `device_type` may compute in: `train.precision` alone when the
    device type can train in it (pinned), else every precision it can (the search keeps the fastest plan)."""
    if hardware.device(device_type, job.train.precision) is not None:
        return (job.train.precision,)
    return hardware.precisions(device_type)


def layout_precision(job: JobConfig, precision: str) -> str | None:
    """`ParallelLayout.precision` for a stage computing in `precision`: None when it is `train.precision`."""
    return None if precision == job.train.precision else precision


def device_classes(job: JobConfig, hardware: Hardware, only: tuple[str, ...] | None = None) -> list[DeviceClass]:
    """The cluster's device classes (types in `only`, when given), one per precision of `stage_precisions`;
    device types that can train in no precision are left out (`api.search_plan` says so)."""
    found: dict[tuple[str, int, str], list[str]] = {}
    for node in job.cluster.nodes:
        if only is None or node.device in only:
            for precision in stage_precisions(job, hardware, node.device):
                found.setdefault((node.device, node.count, precision), []).append(node.name)
    return [DeviceClass(t, c, tuple(names), p) for (t, c, p), names in found.items()]


def group_sizes(cls: DeviceClass) -> list[int]:
    """Stage sizes for a class: slices of a node, then runs of 1, 2, ... whole nodes."""
    slices = [n for n in range(1, cls.node_count) if cls.node_count % n == 0]
    return slices + [g * cls.node_count for g in range(1, len(cls.nodes) + 1)]


def groups(cls: DeviceClass, size: int) -> list[Group]:
    """The groups of `size` devices a class is cut into, in node order."""
    out = []
    if size < cls.node_count:
        for node in cls.nodes:
            for first in range(0, cls.node_count, size):
                spell = f"{node}:{first}" if size == 1 else f"{node}:{first}-{first + size - 1}"
                out.append(Group((spell,), tuple(DeviceRef(node=node, index=i) for i in range(first, first + size)),
                                 frozenset((node,))))
        return out
    g = size // cls.node_count
    for start in range(0, len(cls.nodes) - g + 1, g):
        names = cls.nodes[start:start + g]
        out.append(Group(tuple(names), tuple(DeviceRef(node=n, index=i) for n in names for i in range(cls.node_count)),
                         frozenset(names)))
    return out


def size_fits_batch(job: JobConfig, cls: DeviceClass, size: int, micro_batch_size: int) -> bool:
    """Some tp and cp degrees leave a dp that divides the micro-batch."""
    return any(micro_batch_size % (size // (tp * c)) == 0 for tp in tp_choices(job.model, size, cls.node_count)
               for c in cp_choices(size, cls.node_count, tp))


def micro_batch_sizes(job: JobConfig, options: SearchOptions) -> list[int]:
    """Micro-batch sizes to search."""
    gbs = job.train.global_batch_size
    if options.micro_batch_sizes is not None:
        return [b for b in options.micro_batch_sizes if gbs % b == 0]
    return [b for b in range(1, min(gbs, options.max_micro_batch_size) + 1) if gbs % b == 0]


def templates(job: JobConfig, classes: list[DeviceClass], micro_batch_size: int) -> list[tuple[tuple[int, int], ...]]:
    """Every template for one micro-batch size: ordered (class index, group size) pairs."""
    num_layers = job.model.num_layers
    sizes = []
    for cls in classes:
        ok = [s for s in group_sizes(cls) if size_fits_batch(job, cls, s, micro_batch_size)
              and len(groups(cls, s)) <= num_layers]
        sizes.append(ok)
    out = []
    for r in range(1, len(classes) + 1):
        for subset in itertools.combinations(range(len(classes)), r):
            if len({classes[c].nodes for c in subset}) < r:
                continue  # two precisions of the same nodes
            for combo in itertools.product(*(sizes[c] for c in subset)):
                stages = sum(_count(classes[c], s) for c, s in zip(subset, combo))
                if stages > num_layers:
                    continue
                for order in itertools.permutations(zip(subset, combo)):
                    out.append(tuple(order))
    return out


def _count(cls: DeviceClass, size: int) -> int:
    return cls.num_devices // size if size < cls.node_count else len(cls.nodes) // (size // cls.node_count)


def layouts_for(job: JobConfig, cls: DeviceClass, size: int, micro_batch_size: int, options: SearchOptions):
    """The layouts searched for a stage of `size` devices of `cls`."""
    return search_layouts(job.model, num_devices=size, node_count=cls.node_count, micro_batch_size=micro_batch_size,
                          zero=options.zero, recompute=options.recompute, offload=options.offload, sp=options.sp,
                          offload_zero=options.offload_zero, precision=layout_precision(job, cls.precision),
                          cp=options.cp, ep=options.ep, expert_parallel=options.expert_parallel)
