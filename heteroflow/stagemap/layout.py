"""The layouts the planner searches for a stage (`layout.ParallelLayout` values)."""

from __future__ import annotations

import itertools
from functools import lru_cache

from heteroflow.config.model import ModelSpec
from heteroflow.layout import OffloadSpec, ParallelLayout, tp_valid

OFFLOAD_CHOICES = (
    OffloadSpec(),
    OffloadSpec(optimizer="cpu"),
    OffloadSpec(optimizer="ssd"),
    OffloadSpec(optimizer="cpu", params="cpu"),
    OffloadSpec(optimizer="ssd", params="ssd"),
    OffloadSpec(activations="cpu"),
    OffloadSpec(optimizer="cpu", activations="cpu"),
    OffloadSpec(optimizer="ssd", activations="cpu"),
    OffloadSpec(optimizer="cpu", params="cpu", activations="cpu"),
    OffloadSpec(optimizer="ssd", params="ssd", activations="cpu"),
)
"""Offload combinations searched: parameters leave the device only together with the optimizer state, and
(with dp > 1) only under ZeRO-3, as in ZeRO-Infinity (`searched`)."""


def tp_choices(model: ModelSpec, num_devices: int, node_count: int) -> list[int]:
    """tp degrees for a stage of `num_devices` devices whose tp groups must stay inside nodes of `node_count`."""
    return [t for t in range(1, min(num_devices, node_count) + 1)
            if num_devices % t == 0 and (num_devices <= node_count or node_count % t == 0) and tp_valid(model, t)]


def expert_choices(model: ModelSpec, *, tp: int, num_devices: int, ep: tuple[int, ...] | None = None,
                   expert_parallel: bool = True) -> list[tuple[int, int | None]]:
    """The expert layouts `(ep, etp)` searched for a stage of `num_devices` devices at `tp`: none but (1, None) for
    a dense model or without `expert_parallel`; for a MoE model every ep that divides the experts (and is in `ep`,
    when given), with etp = tp (None) or, when tp > 1, etp = 1 (experts whole, more ranks in the ep group), where
    etp * ep divides the stage's devices."""
    if model.moe is None or not expert_parallel:
        return [(1, None)]
    out: list[tuple[int, int | None]] = []
    for etp in ((None, 1) if tp > 1 else (None,)):
        ways = tp if etp is None else etp
        out += [(degree, etp) for degree in range(1, num_devices // ways + 1)
                if model.moe.num_experts % degree == 0 and num_devices % (ways * degree) == 0
                and (ep is None or degree in ep)]
    return out


def cp_choices(num_devices: int, node_count: int, tp: int) -> list[int]:
    """cp degrees for a stage of `num_devices` devices at tp `tp`: tp * cp divides the stage and its groups stay
    inside nodes of `node_count` (the cp K/V all-gathers are priced on the node's link, as tp's collectives).
    What the model allows (the sequence in 2 * cp chunks, dense layers) `ParallelLayout.validate` checks."""
    rest = num_devices // tp
    inside = node_count if num_devices > node_count else num_devices
    return [c for c in range(1, rest + 1) if rest % c == 0 and inside % (tp * c) == 0]


def offload_allowed(lay: ParallelLayout, *, offload_zero: tuple[int, ...] | None = None) -> bool:
    """Whether `lay` keeps to `offload_zero`, the ZeRO stages allowed when optimizer state or parameters leave
    the device (None: any; tests and baselines narrow it)."""
    return not (lay.offload.moves_state and offload_zero is not None and lay.zero not in offload_zero)


def search_layouts(model: ModelSpec, *, num_devices: int, node_count: int, micro_batch_size: int,
                   zero: tuple[int, ...] = (0, 1, 2, 3), recompute: tuple[str, ...] = ("none", "selective", "full"),
                   offload: tuple[OffloadSpec, ...] = OFFLOAD_CHOICES, sp: tuple[bool, ...] = (False, True),
                   offload_zero: tuple[int, ...] | None = None, precision: str | None = None,
                   cp: tuple[int, ...] | None = None, ep: tuple[int, ...] | None = None,
                   expert_parallel: bool = True) -> list[ParallelLayout]:
    """Every layout the planner considers for a stage of `num_devices` devices, each with `precision`: tp inside
    a node, cp over the rest as `cp_choices` allows (only the degrees in `cp`, when given), dp the rest;
    `offload_zero` as in `offload_allowed`; a MoE model's with each of its `expert_choices` (ep in `ep`, when
    given; none but ep 1 without `expert_parallel`)."""
    def frozen(choices):
        return None if choices is None else tuple(choices)

    return list(_search_layouts(model, num_devices, node_count, micro_batch_size, tuple(zero), tuple(recompute),
                                tuple(offload), tuple(sp), frozen(offload_zero), precision, frozen(cp), frozen(ep),
                                expert_parallel))


@lru_cache(maxsize=256)
def _search_layouts(model: ModelSpec, num_devices: int, node_count: int, micro_batch_size: int, zero: tuple[int, ...],
                    recompute: tuple[str, ...], offload: tuple[OffloadSpec, ...], sp: tuple[bool, ...],
                    offload_zero: tuple[int, ...] | None, precision: str | None, cp: tuple[int, ...] | None,
                    ep: tuple[int, ...] | None, expert_parallel: bool) -> tuple[ParallelLayout, ...]:
    """`search_layouts`, cached: the planner asks again for every class of the same device type and node size,
    and for the baselines."""
    out = []
    for tp in tp_choices(model, num_devices, node_count):
        for c in cp_choices(num_devices, node_count, tp):
            dp = num_devices // (tp * c)
            if (cp is not None and c not in cp) or micro_batch_size % dp:
                continue
            experts = expert_choices(model, tp=tp, num_devices=num_devices, ep=ep, expert_parallel=expert_parallel)
            for (expert_ep, etp), use_sp, z, rc, off in itertools.product(experts, sp, zero, recompute, offload):
                lay = ParallelLayout(tp=tp, cp=c, dp=dp, sp=use_sp, zero=z, recompute=rc, offload=off,
                                     precision=precision, ep=expert_ep, etp=etp)
                if searched(lay, model, micro_batch_size=micro_batch_size) and offload_allowed(
                        lay, offload_zero=offload_zero):
                    out.append(lay)
    return tuple(out)


def searched(lay: ParallelLayout, model: ModelSpec, *, micro_batch_size: int) -> bool:
    """Whether the planner considers `lay`: a valid layout (`ParallelLayout.validate`) that is not a no-op
    variant of another (sp needs tp > 1; ZeRO 1/2 need dp > 1, ZeRO-3 cp x dp > 1) and offloads parameters with
    dp > 1 only under ZeRO-3, as in ZeRO-Infinity (ZeRO 0 would keep the whole stage's state in every dp rank's
    tier)."""
    if (lay.sp and lay.tp == 1) or (lay.zero and (lay.replicas if lay.zero >= 3 else lay.dp) == 1):
        return False
    if lay.offload.params != "device" and lay.dp > 1 and lay.zero != 3:
        return False
    return not lay.validate(model, micro_batch_size=micro_batch_size)
