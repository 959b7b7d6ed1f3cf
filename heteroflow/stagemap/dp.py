"""The planner's inner search: for a fixed sequence of stage device groups, choose every stage's layer count
and layout to minimize the predicted step time, exactly.

Dynamic programming over stages in pipeline order, indexed by (stages placed, layers placed). A partial
plan is summarized by a vector from which the closed form of pipeline.py can be finished stage by stage
(for 1F1B, writing a_k = P_k + u_k max_{l<=k} F_l, d_k = P_k + u_k max_{l<=k} B_l, g_j = n_j t_j - P_j with
P the running sum of t = F + B, the makespan is max_{j<=k, j<=k'} g_j + a_k + d_k' plus GPipe-like
prefix terms). Every component enters the final value monotonically, so a partial plan whose vector is
componentwise no better than another's with the same (stages, layers) can be dropped: the DP keeps
Pareto fronts and is exact. Options per stage are (layers, layout) pairs reduced to those not dominated in
(forward, backward, tail) among the layouts that fit in memory. Branch and bound: an option or a partial
plan whose lower bound reaches the incumbent step time is pruned (bounds: step >= m * (F_k + B_k) +
tail_k for every stage; the partial vector's completions with the least remaining work).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEG = -1e300


@dataclass(frozen=True, slots=True)
class Option:
    """One way to run a stage: its layer count, layout and resulting times (boundary transfers included)."""

    layers: int
    forward_s: float
    backward_s: float
    tail_s: float
    layout: object


@dataclass(slots=True)
class _Entry:
    vec: tuple
    parent: "_Entry | None"
    option: Option | None


def _dominates(a: tuple, b: tuple) -> bool:
    # DONE (index 7 of 9) and P (index 0) differ most often, so they are compared first.
    if len(a) == 9:
        return (a[7] <= b[7] and a[0] <= b[0] and a[8] <= b[8] and a[3] <= b[3] and a[4] <= b[4]
                and a[5] <= b[5] and a[1] <= b[1] and a[2] <= b[2] and a[6] <= b[6])
    return a[0] <= b[0] and a[3] <= b[3] and a[1] <= b[1] and a[2] <= b[2]


def _insert(front: list[_Entry], entry: _Entry) -> None:
    vec = entry.vec
    for other in front:
        if _dominates(other.vec, vec):
            return
    front[:] = [o for o in front if not _dominates(vec, o.vec)]
    front.append(entry)


def shifted(options: list[dict[int, list[Option]]], shift_f: list[float], shift_b: list[float]) -> list[dict[int, list[Option]]]:
    """Options with boundary transfers added (the same to every option of a stage, so dominance holds)."""
    return [{layers: [Option(o.layers, o.forward_s + sf, o.backward_s + sb, o.tail_s, o.layout) for o in opts]
             for layers, opts in table.items()} for table, sf, sb in zip(options, shift_f, shift_b)]


def fill_bound(least: list[np.ndarray], num_layers: int, m: int) -> np.ndarray:
    """G[k, r]: the least possible max_{k' >= k} (sum_{k <= l < k'} t_l + m t_k') when stages k.. hold r layers,
    with t_l >= least[l][layers - 1] (the fastest layout that fits). Every stage k of a plan satisfies
    step >= sum_{l<k} t_l + m t_k (the first micro-batch reaches it, it then runs all m, the last gradient
    leaves it), so step >= G[0, L], and a partial plan with prefix sum P of t over its k stages needs at
    least P + G[k, remaining layers]. Exact recursion: G[k, r] = min_l max(m t_k(l), t_k(l) + G[k+1, r-l])."""
    p = len(least)
    G = np.full((p + 1, num_layers + 1), np.inf)
    G[p, 0] = 0.0  # max over no stages; the max with m t_k below keeps the last stage's own term
    r = np.arange(num_layers + 1)
    for k in range(p - 1, -1, -1):
        t = np.asarray(least[k][:num_layers], dtype=float)
        layers = np.arange(1, len(t) + 1)
        idx = r[None, :] - layers[:, None]  # [layers - 1, r]: layers left for the stages after k
        rest = np.where(idx >= 0, G[k + 1][np.clip(idx, 0, None)], np.inf)
        cand = np.maximum(m * t[:, None], t[:, None] + rest)
        G[k] = cand.min(axis=0) if len(t) else np.inf
    return G


def solve(options: list[dict[int, list[Option]]], num_layers: int, m: int, schedule: str,
          incumbent: float = float("inf"), fill: np.ndarray | None = None) -> tuple[float, list[Option]] | None:
    """Best (step time, options per stage) for stages with the given option tables, or None if nothing
    beats `incumbent`. `options[k][layers]` lists stage k's options with that many layers; `fill` is
    `fill_bound` for these stages (optional, for pruning)."""
    p = len(options)
    if p > num_layers:
        return None
    # Prune options that alone reach the incumbent, and find the layer range each stage can still take.
    tables: list[dict[int, list[Option]]] = []
    for table in options:
        kept = {}
        for layers, opts in table.items():
            good = [o for o in opts if m * (o.forward_s + o.backward_s) + o.tail_s < incumbent]
            if good:
                kept[layers] = good
        if not kept:
            return None
        tables.append(kept)
    max_layers = [max(t) for t in tables]
    min_t1 = [min(o.forward_s + o.backward_s for o in t[min(t)]) for t in tables]
    min_layers = [min(t) for t in tables]
    slope = [min((o.forward_s + o.backward_s) / o.layers for opts in t.values() for o in opts) for t in tables]
    suffix_cap = [0] * (p + 1)
    suffix_min_layers = [0] * (p + 1)
    suffix_t = [0.0] * (p + 1)
    suffix_slope = [float("inf")] * (p + 1)
    for k in range(p - 1, -1, -1):
        suffix_cap[k] = suffix_cap[k + 1] + max_layers[k]
        suffix_min_layers[k] = suffix_min_layers[k + 1] + min_layers[k]
        suffix_t[k] = suffix_t[k + 1] + min_t1[k]
        suffix_slope[k] = min(suffix_slope[k + 1], slope[k])
    if suffix_cap[0] < num_layers or suffix_min_layers[0] > num_layers:
        return None

    gpipe = schedule == "gpipe"
    start = (0.0, 0.0, 0.0, 0.0) if gpipe else (0.0, 0.0, 0.0, NEG, NEG, NEG, 0.0, 0.0, 0.0)
    fronts: dict[int, list[_Entry]] = {0: [_Entry(start, None, None)]}
    for k in range(p):
        w = min(p - 1 - k, m)
        u = min(w, m - 1)
        n = m - w - 1
        nxt: dict[int, list[_Entry]] = {}
        for used, front in fronts.items():
            lo = max(min_layers[k], num_layers - used - suffix_cap[k + 1])
            hi = min(max_layers[k], num_layers - used - suffix_min_layers[k + 1])
            for layers in range(lo, hi + 1):
                opts = tables[k].get(layers)
                if not opts:
                    continue
                rest = num_layers - used - layers
                rem = suffix_t[k + 1] + max(0, rest - suffix_min_layers[k + 1]) * suffix_slope[k + 1] if k + 1 < p else 0.0
                ahead = fill[k + 1, rest] if fill is not None and k + 1 < p else 0.0
                bucket = nxt.setdefault(used + layers, [])
                for entry in front:
                    for o in opts:
                        vec = _step_gpipe(entry.vec, o) if gpipe else _step_1f1b(entry.vec, o, u, n, m)
                        if vec[0] + ahead + vec[-1] >= incumbent:
                            continue
                        if _lower_bound(vec, rem, gpipe, m, last=k + 1 == p) >= incumbent:
                            continue
                        _insert(bucket, _Entry(vec, entry, o))
        fronts = {used: f for used, f in nxt.items() if f}
        if not fronts:
            return None
    final = fronts.get(num_layers)
    if not final:
        return None
    value = min(_value(e.vec, gpipe, m) for e in final)
    # Among plans of equal value prefer less total work, then simpler layouts (fewer knobs turned).
    ties = [e for e in final if _value(e.vec, gpipe, m) <= value * (1 + 1e-12)]
    best = min(ties, key=lambda e: (e.vec[0], _complexity(e)))
    if value >= incumbent:
        return None
    chosen = []
    entry: _Entry | None = best
    while entry is not None and entry.option is not None:
        chosen.append(entry.option)
        entry = entry.parent
    return value, chosen[::-1]


def _complexity(entry: _Entry) -> int:
    total = 0
    while entry is not None and entry.option is not None:
        lay = entry.option.layout
        if lay is not None:
            total += (lay.zero + {"none": 0, "selective": 1, "full": 2}[lay.recompute]
                      + 2 * len(lay.offload.to_dict()) + lay.sp)
        entry = entry.parent
    return total


def _step_gpipe(vec: tuple, o: Option) -> tuple:
    P, MF, MB, TAIL = vec
    return (P + o.forward_s + o.backward_s, max(MF, o.forward_s), max(MB, o.backward_s), max(TAIL, o.tail_s))


def _step_1f1b(vec: tuple, o: Option, u: int, n: int, m: int) -> tuple:
    P, MF, MB, Gt, GA, GD, H, DONE, TAIL = vec
    t = o.forward_s + o.backward_s
    P2, MF2, MB2 = P + t, max(MF, o.forward_s), max(MB, o.backward_s)
    a = P2 + u * MF2
    d = P2 + u * MB2
    if n >= 1:
        Gt2 = max(Gt + t, n * t)
        DONE2 = max(DONE, GA + d, GD + a, Gt2 - P2 + a + d, H + a)
        return (P2, MF2, MB2, Gt2, max(GA, Gt2 + u * MF2), max(GD, Gt2 + u * MB2), H, DONE2, max(TAIL, o.tail_s))
    H2 = max(H, (m - 1) * MB2)
    return (P2, MF2, MB2, Gt, GA, GD, H2, max(DONE, H2 + a), max(TAIL, o.tail_s))


def _value(vec: tuple, gpipe: bool, m: int) -> float:
    if gpipe:
        P, MF, MB, TAIL = vec
        return P + (m - 1) * (MF + MB) + TAIL
    return vec[7] + vec[8]


def _lower_bound(vec: tuple, rem: float, gpipe: bool, m: int, last: bool) -> float:
    """A value no completion of this partial plan can beat (`rem`: least remaining sum of F + B)."""
    if gpipe:
        P, MF, MB, TAIL = vec
        return P + rem + (m - 1) * (MF + MB) + TAIL
    P, MF, MB, Gt, GA, GD, H, DONE, TAIL = vec
    if last:
        return DONE + TAIL
    finish = P + rem
    return max(DONE, GA + finish, GD + finish, Gt - P + 2 * finish, H + finish) + TAIL


def greedy(options: list[dict[int, list[Option]]], num_layers: int, m: int, schedule: str) -> tuple[float, list[Option]] | None:
    """A quick good plan to start branch and bound from: balance F + B under the smallest bottleneck that
    can hold every layer, each stage on its fastest option."""
    import bisect
    from heteroflow.stagemap.pipeline import pipeline_time
    p = len(options)
    if p > num_layers or any(not t for t in options):
        return None
    fastest, counts, times = [], [], []
    for t in options:
        best = {layers: min(opts, key=lambda o: (o.forward_s + o.backward_s, o.tail_s)) for layers, opts in t.items()}
        ks = sorted(best)
        fastest.append(best)
        counts.append(ks)
        times.append([best[x].forward_s + best[x].backward_s for x in ks])  # non-decreasing in layers

    def most_layers(k: int, tau: float) -> int:
        i = bisect.bisect_right(times[k], tau)
        return counts[k][i - 1] if i else 0

    taus = sorted({x for t in times for x in t})
    lo, hi = 0, len(taus) - 1

    def enough(tau: float) -> bool:
        got = [most_layers(k, tau) for k in range(p)]
        return all(got) and sum(got) >= num_layers

    if not enough(taus[hi]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if enough(taus[mid]):
            hi = mid
        else:
            lo = mid + 1
    layers = [most_layers(k, taus[lo]) for k in range(p)]
    while sum(layers) > num_layers:
        order = sorted(range(p), key=lambda k: -(fastest[k][layers[k]].forward_s + fastest[k][layers[k]].backward_s))
        for k in order:
            i = counts[k].index(layers[k])
            if i > 0:
                layers[k] = counts[k][i - 1]
                break
        else:
            return None
    chosen = [fastest[k][layers[k]] for k in range(p)]
    value = pipeline_time([o.forward_s for o in chosen], [o.backward_s for o in chosen], m, schedule)
    return value + max(o.tail_s for o in chosen), chosen
