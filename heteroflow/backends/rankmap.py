"""`RankMap`: where every global rank of a plan sits (stage, dp/cp/tp index, node, device) and back.

Rank order is fixed by the plan (config/plan.py): stages in pipeline order; inside a stage its
devices in list order, tp innermost, then cp, then dp. So inside stage k, with `first` its first
rank, `rank = first + (dp * cp_size + cp) * tp_size + tp`, and the rank runs on
`stage.device_refs[rank - first]`. Pure Python: the launcher and tests use it without processes.

The expert layout of a MoE stage folds the same ranks again, as Megatron-core's expert `RankGenerator`
does (order tp-ep-dp): etp innermost, then ep, then expert-dp, so
`rank = first + (expert_dp * ep_size + ep) * etp_size + etp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from heteroflow.backends.vendor import boundary_kind, collective_backend
from heteroflow.config.cluster import ClusterSpec
from heteroflow.config.plan import PlanSpec
from heteroflow.layout import ParallelLayout
from heteroflow.remap.layout import TensorLayout


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One global rank's place in the plan and on the cluster."""

    rank: int
    stage: int
    dp: int
    cp: int
    tp: int
    node: str
    local_device: int
    """Device index on `node` (what `torch.cuda.set_device` takes)."""
    device_type: str
    vendor: str
    ep: int = 0
    """Index in the stage's expert-parallel group (which share of the experts this rank holds)."""
    etp: int = 0
    """Index in the stage's expert tensor-parallel group (which slice of each of those experts)."""
    expert_dp: int = 0
    """Index among the stage's ranks holding the same expert slices (the expert-dp group)."""


def expert_coordinates(local: int, layout: ParallelLayout) -> tuple[int, int, int]:
    """`(expert_dp, ep, etp)` of the stage's `local`-th rank: etp innermost, then ep, then expert-dp."""
    rest, etp = divmod(local, layout.expert_tp)
    expert_dp, ep = divmod(rest, layout.ep)
    return expert_dp, ep, etp


@dataclass(frozen=True, slots=True)
class StageInfo:
    """One stage's layout, vendor and ranks."""

    index: int
    ranks: tuple[int, ...]
    layout: ParallelLayout
    device_type: str
    vendor: str

    @property
    def backend(self) -> str:
        """Collective backend of this stage's devices (what its groups use outside emulation)."""
        return collective_backend(self.vendor)

    def rank(self, *, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank at these indices."""
        lay = self.layout
        for name, value, size in (("dp", dp, lay.dp), ("cp", cp, lay.cp), ("tp", tp, lay.tp)):
            if not 0 <= value < size:
                raise IndexError(f"stage {self.index}: {name} index {value} out of range 0..{size - 1}")
        return self.ranks[(dp * lay.cp + cp) * lay.tp + tp]

    def expert_rank(self, *, expert_dp: int = 0, ep: int = 0, etp: int = 0) -> int:
        """Global rank at these expert-layout indices."""
        lay = self.layout
        for name, value, size in (("expert_dp", expert_dp, lay.expert_dp), ("ep", ep, lay.ep),
                                  ("etp", etp, lay.expert_tp)):
            if not 0 <= value < size:
                raise IndexError(f"stage {self.index}: {name} index {value} out of range 0..{size - 1}")
        return self.ranks[(expert_dp * lay.ep + ep) * lay.expert_tp + etp]


class RankMap:
    """Every rank of a plan: `info(rank)` answers where it is, `rank_of(...)`/`rank_at(...)` go back."""

    def __init__(self, stages: Sequence[StageInfo], infos: Sequence[RankInfo]):
        self.stages = tuple(stages)
        self._infos = tuple(infos)
        self._by_device = {(i.node, i.local_device): i.rank for i in infos}
        assert [i.rank for i in infos] == list(range(len(infos))), "ranks are numbered 0..world-1 in order"

    @classmethod
    def from_plan(cls, plan: PlanSpec, cluster: ClusterSpec) -> "RankMap":
        """Place every rank of `plan` on `cluster` (both already validated by config/)."""
        stages, infos, first = [], [], 0
        for k, stage in enumerate(plan.stages):
            vendor = cluster.device_types[stage.device_type].vendor
            n = stage.num_devices
            assert n == stage.layout.num_devices, "config/ checks tp * cp * dp == devices"
            stages.append(StageInfo(index=k, ranks=tuple(range(first, first + n)), layout=stage.layout,
                                    device_type=stage.device_type, vendor=vendor))
            for local, ref in enumerate(stage.device_refs):
                dp, rest = divmod(local, stage.layout.cp * stage.layout.tp)
                cp, tp = divmod(rest, stage.layout.tp)
                expert_dp, ep, etp = expert_coordinates(local, stage.layout)
                infos.append(RankInfo(rank=first + local, stage=k, dp=dp, cp=cp, tp=tp, node=ref.node,
                                      local_device=ref.index, device_type=stage.device_type, vendor=vendor,
                                      ep=ep, etp=etp, expert_dp=expert_dp))
            first += n
        return cls(stages, infos)

    @property
    def world_size(self) -> int:
        """Ranks in the plan."""
        return len(self._infos)

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return len(self.stages)

    def info(self, rank: int) -> RankInfo:
        """Where `rank` sits."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range 0..{self.world_size - 1}")
        return self._infos[rank]

    def stage_of(self, rank: int) -> StageInfo:
        """The stage `rank` belongs to."""
        return self.stages[self.info(rank).stage]

    def rank_of(self, stage: int, *, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at (stage, dp, cp, tp)."""
        return self.stages[stage].rank(dp=dp, cp=cp, tp=tp)

    def rank_at(self, node: str, local_device: int) -> int:
        """The global rank that runs on device `local_device` of `node`."""
        try:
            return self._by_device[node, local_device]
        except KeyError:
            raise KeyError(f"no rank of this plan runs on {node}:{local_device}") from None

    def tp_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each tp group of `stage` (fixed dp, cp), in dp-then-cp order."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(s.rank(dp=d, cp=c, tp=t) for t in range(lay.tp)) for d in range(lay.dp) for c in range(lay.cp)]

    def cp_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each cp group of `stage` (fixed dp, tp)."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(s.rank(dp=d, cp=c, tp=t) for c in range(lay.cp)) for d in range(lay.dp) for t in range(lay.tp)]

    def dp_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each dp group of `stage` (fixed cp, tp): the ranks that hold the same weights."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(s.rank(dp=d, cp=c, tp=t) for d in range(lay.dp)) for c in range(lay.cp) for t in range(lay.tp)]

    def replica_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each cp x dp group of `stage` (fixed tp), ascending: every rank that holds a replica of the
        same weights (cp splits only the sequence). ZeRO-3 shards over it (`models.zero3`)."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(sorted(s.rank(dp=d, cp=c, tp=t) for d in range(lay.dp) for c in range(lay.cp)))
                for t in range(lay.tp)]

    def ep_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each expert-parallel group of `stage` (fixed expert-dp, etp): tokens travel between them."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(s.expert_rank(expert_dp=d, ep=e, etp=t) for e in range(lay.ep))
                for d in range(lay.expert_dp) for t in range(lay.expert_tp)]

    def etp_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each expert tensor-parallel group of `stage` (fixed expert-dp, ep): one expert's slices."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(s.expert_rank(expert_dp=d, ep=e, etp=t) for t in range(lay.expert_tp))
                for d in range(lay.expert_dp) for e in range(lay.ep)]

    def expert_dp_groups(self, stage: int) -> list[tuple[int, ...]]:
        """Ranks of each expert-dp group of `stage` (fixed ep, etp): the ranks holding the same expert slices,
        whose expert gradients are summed (and ZeRO-sharded) over it."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return [tuple(s.expert_rank(expert_dp=d, ep=e, etp=t) for d in range(lay.expert_dp))
                for e in range(lay.ep) for t in range(lay.expert_tp)]

    def activation_layout(self, stage: int, shape: Sequence[int]) -> TensorLayout:
        """How `stage` holds a `[batch, seq, hidden]` activation of one micro-batch."""
        s, lay = self.stages[stage], self.stages[stage].layout
        return TensorLayout.activation(shape, ranks=s.ranks, dp=lay.dp, tp=lay.tp, cp=lay.cp, sp=lay.sp)

    def fanout_groups(self, stage: int) -> list[tuple[int, ...]]:
        """The replica sets of `stage`'s activations with more than one rank: each receives a piece once
        at a boundary and copies it to the others (its tp group, unless sequence parallel)."""
        lay = self.stages[stage].layout
        probe = self.activation_layout(stage, (lay.dp, 2 * lay.cp * lay.tp, 1))  # any shape the splits divide
        return [ranks for _, ranks in probe.shares() if len(ranks) > 1]

    def boundary_kind(self, stage: int) -> str:
        """`direct` or `bridge` for the boundary between `stage` and `stage + 1`."""
        return boundary_kind(self.stages[stage].vendor, self.stages[stage + 1].vendor)

    def describe(self) -> str:
        """One line per stage: ranks, layout, vendor, backend; one per boundary: its transport."""
        lines = []
        for s in self.stages:
            lines.append(f"stage {s.index}: ranks {s.ranks[0]}-{s.ranks[-1]} {s.device_type} ({s.vendor}, "
                         f"{s.backend}) tp={s.layout.tp} cp={s.layout.cp} dp={s.layout.dp}"
                         f"{' sp' if s.layout.sp else ''}"
                         f"{f' ep={s.layout.ep} etp={s.layout.expert_tp}' if s.layout.ep > 1 or s.layout.etp else ''}")
            if s.index + 1 < len(self.stages):
                lines.append(f"  boundary {s.index}->{s.index + 1}: {self.boundary_kind(s.index)}")
        return "\n".join(lines)
