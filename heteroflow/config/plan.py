"""`PlanSpec` and `StageSpec`: an explicit training plan, as written by the planner or by hand.

A stage holds a `layout.ParallelLayout`, whose rules (`ParallelLayout.validate`) are checked here against the
stage's devices and the model. Rank order inside a stage follows its `devices` list; tp is the innermost axis,
then cp, then dp, so the devices of one tp group are consecutive (and must share a node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from heteroflow.config import limits
from heteroflow.config.cluster import ClusterSpec, DeviceRef
from heteroflow.config.model import ModelSpec
from heteroflow.config.reader import Problems, Section
from heteroflow.config.train import TrainSpec
from heteroflow.errors import did_you_mean
from heteroflow.layout import (ACTIVATION_TIERS, PRECISIONS, RECOMPUTE, SCHEDULES, STATE_TIERS, ZERO_STAGES,
                               OffloadSpec,
                               ParallelLayout)

PLAN_VERSION = 1
_DEVICE_RANGE = re.compile(r"^(?P<node>[^:]+?)(?::(?P<first>\d+)(?:-(?P<last>\d+))?)?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """One pipeline stage: its devices (all of one type), its layers and its own layout."""

    devices: tuple[str, ...]
    """As written: node names or `NODE:i-j` ranges."""
    device_refs: tuple[DeviceRef, ...]
    """Resolved devices in rank order."""
    device_type: str
    """The one device type of these devices."""
    layers: int
    """Transformer blocks in this stage."""
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    """The stage's intra-operator layout (tp x cp x dp = its devices)."""

    @property
    def num_devices(self) -> int:
        """Devices (ranks) in the stage."""
        return len(self.device_refs)

    def to_dict(self) -> dict:
        """Plain data in the plan YAML schema (defaults left out)."""
        return {"devices": list(self.devices), "device_type": self.device_type, "layers": self.layers,
                **self.layout.to_dict()}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSpec:
    """An explicit plan: stages in pipeline order, the schedule and the micro-batch size."""

    stages: tuple[StageSpec, ...]
    schedule: str = "1f1b"
    """1f1b or gpipe."""
    micro_batch_size: int = 1
    """Samples per pipeline micro-batch; each stage splits it over its dp ranks."""
    version: int = PLAN_VERSION

    def layer_ranges(self) -> list[tuple[int, int]]:
        """`[first, last_exclusive)` of each stage."""
        ranges, first = [], 0
        for stage in self.stages:
            ranges.append((first, first + stage.layers))
            first += stage.layers
        return ranges

    def num_micro_batches(self, train: TrainSpec) -> int:
        """Micro-batches per optimizer step."""
        return train.global_batch_size // self.micro_batch_size

    @property
    def num_devices(self) -> int:
        """Devices used by the plan."""
        return sum(s.num_devices for s in self.stages)

    def to_dict(self) -> dict:
        """Plain data in the plan YAML schema (the `plan:` mapping)."""
        return {"version": self.version, "schedule": self.schedule, "micro_batch_size": self.micro_batch_size,
                "stages": [s.to_dict() for s in self.stages]}


def _resolve_devices(raw: object, path: str, cluster: ClusterSpec, problems: Problems) -> list[DeviceRef] | None:
    """`[gpu-0, "npu-0:0-3"]` -> device refs, each problem reported at `path[i]`."""
    if not isinstance(raw, list) or not raw:
        problems.add(path, "expected a non-empty list of node names or NODE:i-j ranges")
        return None
    refs: list[DeviceRef] = []
    ok = True
    names = [n.name for n in cluster.nodes]
    for j, item in enumerate(raw):
        where = f"{path}[{j}]"
        match = _DEVICE_RANGE.match(item) if isinstance(item, str) else None
        if match is None:
            problems.add(where, f"expected NODE or NODE:i-j, got {item!r}")
            ok = False
            continue
        node_name = match["node"]
        if node_name not in names:
            problems.add(where, f"unknown node {node_name!r}" + did_you_mean(node_name, names))
            ok = False
            continue
        count = cluster.node(node_name).count
        first = int(match["first"]) if match["first"] is not None else 0
        last = int(match["last"]) if match["last"] is not None else (first if match["first"] is not None else count - 1)
        if first > last or last >= count:
            problems.add(where, f"devices {first}-{last} do not exist: node {node_name!r} has devices 0-{count - 1}")
            ok = False
            continue
        refs += [DeviceRef(node=node_name, index=i) for i in range(first, last + 1)]
    return refs if ok else None


def _parse_layers(raw: object, path: str, first: int, problems: Problems) -> int | None:
    """A layer count, or a `[first, last_exclusive]` pair that must start where the last stage ended."""
    if isinstance(raw, list) and len(raw) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
        if raw[0] != first or raw[1] <= raw[0]:
            problems.add(path, f"range {raw} must start at layer {first} (where the previous stage ends) "
                         "and be non-empty")
            return None
        return raw[1] - raw[0]
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        problems.add(path, f"expected a positive layer count or [first, last_exclusive], got {raw!r}")
        return None
    return raw


def parse_plan(data: object, problems: Problems, *, cluster: ClusterSpec, model: ModelSpec, train: TrainSpec,
               path: str = "plan") -> PlanSpec | None:
    """Build and check an explicit plan against the cluster, model and train settings."""
    sec = Section(data, path, problems, allow_extra=("predicted", "baselines", "measured"))  # measured: `tune`
    version = sec.integer("version", PLAN_VERSION, limit=limits.FILE_VERSION)
    if version is not None and version > PLAN_VERSION:
        problems.add(sec.at("version"), f"plan version {version} is newer than this heteroflow "
                     f"understands ({PLAN_VERSION}); upgrade heteroflow")
    schedule = sec.string("schedule", "1f1b", choices=SCHEDULES)
    mbs = sec.integer("micro_batch_size", train.micro_batch_size, limit=limits.MICRO_BATCH_SIZE)
    if mbs is not None and train.global_batch_size % mbs:
        problems.add(sec.at("micro_batch_size"), f"{mbs} does not divide train.global_batch_size "
                     f"{train.global_batch_size}")
    raw_stages = sec.sequence("stages")
    if raw_stages is not None and not raw_stages:
        problems.add(sec.at("stages"), "a plan needs at least one stage")
    stages: list[StageSpec] = []
    used: dict[DeviceRef, int] = {}
    next_layer = 0
    for k, raw in enumerate(raw_stages or []):
        stage = _parse_stage(raw, f"{sec.at('stages')}[{k}]", k, problems, cluster=cluster, model=model,
                             train=train, micro_batch_size=mbs, first_layer=next_layer, used=used)
        if stage is not None:
            stages.append(stage)
            next_layer += stage.layers
    sec.finish()
    if raw_stages and len(stages) == len(raw_stages) and next_layer != model.num_layers:
        problems.add(sec.at("stages"), f"stage layers add up to {next_layer}, but model.num_layers is "
                     f"{model.num_layers}; make the stages' layers sum to {model.num_layers}")
        return None
    if not sec.valid or None in (schedule, mbs, version) or not raw_stages or len(stages) != len(raw_stages):
        return None
    return PlanSpec(stages=tuple(stages), schedule=schedule, micro_batch_size=mbs, version=version)


def _parse_stage(raw: object, path: str, k: int, problems: Problems, *, cluster: ClusterSpec, model: ModelSpec,
                 train: TrainSpec, micro_batch_size: int | None, first_layer: int,
                 used: dict[DeviceRef, int]) -> StageSpec | None:
    """One stage, with its layout checked against its devices and the model."""
    sec = Section(raw, path, problems, allow_extra=("predicted",))
    before = len(problems.items)
    raw_devices = sec.raw("devices")
    if isinstance(raw_devices, str):
        raw_devices = [raw_devices]
    refs = None if raw_devices is None else _resolve_devices(raw_devices, sec.at("devices"), cluster, problems)
    raw_layers = sec.raw("layers")
    layers = None if raw_layers is None else _parse_layers(raw_layers, sec.at("layers"), first_layer, problems)
    tp, dp, cp = (sec.integer(key, 1, limit=limits.PARALLEL_DEGREE) for key in ("tp", "dp", "cp"))
    sp = sec.boolean("sp", False)
    zero = sec.integer("zero", 0, limit=limits.integers(min(ZERO_STAGES), max(ZERO_STAGES)))
    recompute = sec.string("recompute", "none", choices=RECOMPUTE)
    offload = OffloadSpec()
    off_sec = sec.mapping("offload", None)
    if off_sec is not None:
        offload = OffloadSpec(optimizer=off_sec.string("optimizer", "device", choices=STATE_TIERS) or "device",
                              params=off_sec.string("params", "device", choices=STATE_TIERS) or "device",
                              activations=off_sec.string("activations", "device", choices=ACTIVATION_TIERS) or "device")
        off_sec.finish()
    precision = sec.string("precision", None, choices=PRECISIONS)
    ep = sec.integer("ep", 1, limit=limits.PARALLEL_DEGREE)
    etp = sec.integer("etp", None, limit=limits.PARALLEL_DEGREE)
    written_type = sec.string("device_type", None)
    sec.finish()

    device_type = None
    if refs is not None:
        for ref in refs:
            if ref in used:
                problems.add(sec.at("devices"), f"device {ref} is used twice (also by plan.stages[{used[ref]}]"
                             f"{'' if used[ref] != k else ' itself'}); each device belongs to one stage")
            used[ref] = k
        types = sorted({cluster.node(r.node).device for r in refs})
        if len(types) > 1:
            problems.add(sec.at("devices"), f"mixes device types {', '.join(types)}; a stage runs on one device "
                         "type: split it into one stage per type")
        else:
            device_type = types[0]
            if written_type is not None and written_type != device_type:
                problems.add(sec.at("device_type"), f"says {written_type!r} but its devices are {device_type!r}")
            _check_precision(cluster, device_type, precision, train, sec, problems)
    layout = None
    if None not in (tp, dp, cp, sp, zero, recompute, ep):
        layout = ParallelLayout(tp=tp, dp=dp, cp=cp, sp=sp, zero=zero, recompute=recompute, offload=offload,
                                precision=precision, ep=ep, etp=etp)
        for problem in layout.validate(model, num_devices=None if refs is None else len(refs),
                                       micro_batch_size=micro_batch_size):
            problems.add(sec.at(problem.key), problem.message)
    if tp is not None and refs is not None and len(refs) % tp == 0:
        for g in range(0, len(refs), tp):
            nodes = sorted({r.node for r in refs[g:g + tp]})
            if len(nodes) > 1:
                problems.add(sec.at("tp"), f"tp group {[str(r) for r in refs[g:g + tp]]} spans nodes "
                             f"{', '.join(nodes)}; tensor parallelism must stay inside one node")
                break
    if len(problems.items) != before or not sec.valid or None in (device_type, layers, layout):
        return None
    return StageSpec(devices=tuple(raw_devices), device_refs=tuple(refs), device_type=device_type, layers=layers,
                     layout=layout)


def _check_precision(cluster: ClusterSpec, device_type: str, precision: str | None, train: TrainSpec, sec: Section,
                     problems: Problems) -> None:
    """A stage cannot train in a precision its devices lack (Ascend 910A has no bf16): its own `precision`, or
    the job's `train.precision` when it sets none."""
    spec = cluster.device_types[device_type]
    wanted = precision or train.precision
    if spec.supports(wanted):
        return
    supported = " or ".join(p for p in PRECISIONS if spec.supports(p))
    if precision is not None:
        problems.add(sec.at("precision"), f"{device_type} does not support {wanted}; set this stage's precision to "
                     f"{supported}, or move the stage to other devices")
    else:
        problems.add(sec.at("devices"), f"{device_type} does not support {wanted} (train.precision); set this "
                     f"stage's precision (or train.precision) to {supported}, or move this stage to other devices")
