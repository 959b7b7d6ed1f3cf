"""The planner's inner search: for a fixed sequence of stage device groups, choose every stage's layer count
and layout to minimize the predicted step time, exactly (for 1F1B: its closed form, the makespan unless a
stage's backward is faster than its forward, see pipeline.py).

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


def _dominates_1f1b(a: tuple, b: tuple) -> bool:
    # DONE (index 7 of 9) and P (index 0) differ most often, so they are compared first.
    return (a[7] <= b[7] and a[0] <= b[0] and a[8] <= b[8] and a[3] <= b[3] and a[4] <= b[4]
            and a[5] <= b[5] and a[1] <= b[1] and a[2] <= b[2] and a[6] <= b[6])


def _dominates_gpipe(a: tuple, b: tuple) -> bool:
    return a[0] <= b[0] and a[3] <= b[3] and a[1] <= b[1] and a[2] <= b[2]


def _insert(front: list[_Entry], entry: _Entry) -> None:
    vec = entry.vec
    dominates = _dominates_1f1b if len(vec) == 9 else _dominates_gpipe
    for other in front:
        if dominates(other.vec, vec):
            return
    if any(dominates(vec, o.vec) for o in front):
        front[:] = [o for o in front if not dominates(vec, o.vec)]
    front.append(entry)


class DictTable:
    """A stage's options given as `{layers: [Option, ...]}` (tests, small callers)."""

    def __init__(self, table: dict[int, list[Option]], max_layers: int):
        self._table = table
        self.least = np.full(max_layers, np.inf)
        for layers, opts in table.items():
            if opts and layers <= max_layers:
                self.least[layers - 1] = min(o.forward_s + o.backward_s for o in opts)
        self.least_tail = min((o.tail_s for opts in table.values() for o in opts), default=np.inf)

    def options(self, layers: int) -> list[Option]:
        return self._table.get(layers, [])

    def fastest(self, layers: int) -> Option | None:
        opts = self._table.get(layers)
        return min(opts, key=lambda o: (o.forward_s + o.backward_s, o.tail_s)) if opts else None


def fill_bound(least: list[np.ndarray], num_layers: int, m: int, own: list[np.ndarray] | None = None,
               tails: list[np.ndarray] | None = None, sums: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """G[k, r]: a lower bound on max_{k' >= k} (sum_{k <= l < k'} t_l + c_k') over plans whose stages k.. hold
    r layers, with t_l >= least[l][layers - 1] (the fastest layout that fits there). Each stage's c_k is
    at least
    - own[k][layers - 1] (m * least when not given), because step >= sum_{l<k} t_l + m t_k + tail_k: the
      first micro-batch reaches stage k, it runs all m, the last gradient leaves it, the tail waits for it;
    - with `tails` (1F1B, when stage k has steady-state pairs, m > p - k): (m - p + k + 1) t_k + tail_k +
      2 sum_{l>k} t_l, from the closed form's candidate k with the warm-up and drain of micro-batch 0 and
      m - 1 through the whole pipeline; the sum over later stages is bounded by its least value.
    So step >= G[0, L], and a partial plan with prefix sum P over its first k stages needs P + G[k, rest].
    Recursion: G[k, r] = min_l max(c_k(l, r - l), t_k(l) + G[k+1, r-l]).
    With `sums`, also returns S[k, r]: the least sum of t over stages k.. holding r layers (for `solve`)."""
    p, L = len(least), num_layers
    # Both tables carry L + 1 columns of inf before column 0, so that "r - l layers left" indexes them directly
    # (negative counts read inf).
    G = np.full((p + 1, 2 * L + 2), np.inf)
    G[p, L + 1] = -np.inf  # no stages after the last: only its own term counts
    rest_sum = np.full((p + 1, 2 * L + 2), np.inf)  # least sum of t over stages k.. holding r layers
    rest_sum[p, L + 1] = 0.0
    left = np.arange(L + 1)[None, :] - np.arange(1, L + 1)[:, None] + (L + 1)  # [l - 1, r]: column of r - l
    for k in range(p - 1, -1, -1):
        t = np.asarray(least[k][:L], dtype=float)
        if len(t) == 0:
            continue
        # Only r in [p - k, L - k] can occur: every stage holds at least one layer.
        cols = slice(p - k + L + 1, L - k + 1 + L + 1)
        gather = left[: len(t), p - k: L - k + 1]
        rest = G[k + 1][gather]
        own_k = np.asarray(own[k][: len(t)], dtype=float) if own is not None else m * t
        with np.errstate(invalid="ignore"):
            cand = np.maximum(own_k[:, None], t[:, None] + rest)
            if tails is not None or sums:
                later = rest_sum[k + 1][gather]
                if tails is not None and m > p - k:
                    warm = ((m - p + k + 1) * t + np.asarray(tails[k][: len(t)], dtype=float))[:, None] + 2 * later
                    np.maximum(cand, warm, out=cand)
                total = t[:, None] + later
        bad = ~np.isfinite(t) | ~np.isfinite(own_k)  # layer counts that fit nowhere
        cand[bad] = np.inf
        G[k, cols] = cand.min(axis=0)
        if tails is not None or sums:
            total[bad] = np.inf
            rest_sum[k, cols] = total.min(axis=0)
    return (G[:, L + 1:], rest_sum[:, L + 1:]) if sums else G[:, L + 1:]


def solve(tables: list, num_layers: int, m: int, schedule: str, incumbent: float = float("inf"),
          fill: np.ndarray | None = None, sums: np.ndarray | None = None) -> tuple[float, list[Option]] | None:
    """Best (step time, options per stage), or None if nothing beats `incumbent`.

    `tables[k]` gives stage k's options: `.options(layers)`, `.least` (least F + B by layer count, inf
    where nothing fits; non-decreasing where finite) and `.least_tail`; `fill` and `sums` are `fill_bound`'s
    G and S for these stages (optional, for pruning)."""
    p = len(tables)
    if p > num_layers:
        return None
    top = num_layers - p + 1
    hi, first_t, slope = [], [], []
    for table in tables:
        least = np.asarray(table.least[:top], dtype=float)
        # step >= m (F + B) + tail for every stage: layer counts whose best option reaches the incumbent are out.
        useful = np.flatnonzero(np.isfinite(least) & (m * least + table.least_tail < incumbent))
        if len(useful) == 0:
            return None
        hi.append(int(useful[-1]) + 1)
        head = least[: hi[-1]]
        first_t.append(float(np.min(head)))
        # With least non-decreasing (real tables), a stage's F + B grows by at least the smallest step per
        # extra layer; otherwise only its minimum is a safe bound.
        with np.errstate(invalid="ignore"):
            steps = np.diff(head)
        slope.append(float(steps.min()) if np.all(np.isfinite(head)) and len(steps) and steps.min() >= 0 else 0.0)
    suffix_cap = [0] * (p + 1)
    suffix_t = [0.0] * (p + 1)
    suffix_slope = [np.inf] * (p + 1)
    for k in range(p - 1, -1, -1):
        suffix_cap[k] = suffix_cap[k + 1] + hi[k]
        suffix_t[k] = suffix_t[k + 1] + first_t[k]
        suffix_slope[k] = min(suffix_slope[k + 1], slope[k])
    if suffix_cap[0] < num_layers:
        return None

    gpipe = schedule == "gpipe"
    start = (0.0, 0.0, 0.0, 0.0) if gpipe else (0.0, 0.0, 0.0, NEG, NEG, NEG, 0.0, 0.0, 0.0)
    fronts: dict[int, list[_Entry]] = {0: [_Entry(start, None, None)]}
    cache: dict[tuple[int, int], list[Option]] = {}
    columns: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}  # cache's (forward, backward, tail) as arrays
    for k in range(p):
        w = min(p - 1 - k, m)
        u = min(w, m - 1)
        n = m - w - 1
        nxt: dict[int, list[_Entry]] = {}
        arrays: dict[int, np.ndarray] = {}
        later = p - 1 - k
        for used, front in fronts.items():
            lo = max(1, num_layers - used - suffix_cap[k + 1])
            top_k = min(hi[k], num_layers - used - later)
            for layers in range(lo, top_k + 1):
                key = (k, layers)
                if key not in cache:
                    cache[key] = [o for o in tables[k].options(layers)
                                  if m * (o.forward_s + o.backward_s) + o.tail_s < incumbent]
                opts = cache[key]
                if not opts:
                    continue
                rest = num_layers - used - layers
                rem = suffix_t[k + 1] + (rest - later) * suffix_slope[k + 1] if later else 0.0
                if sums is not None and later:
                    rem = max(rem, float(sums[k + 1, rest]))
                ahead = fill[k + 1, rest] if fill is not None and later else -np.inf
                bucket = nxt.setdefault(used + layers, [])
                if not gpipe:
                    if used not in arrays:
                        arrays[used] = np.array([e.vec for e in front], dtype=float)
                    if key not in columns:
                        columns[key] = tuple(np.array([getattr(o, f) for o in opts])
                                             for f in ("forward_s", "backward_s", "tail_s"))
                    _extend_1f1b(bucket, front, arrays[used], opts, columns[key], u, n, m, ahead, rem, not later,
                                 incumbent)
                    continue
                for entry in front:
                    for o in opts:
                        vec = _step_gpipe(entry.vec, o)
                        if vec[0] + ahead >= incumbent:
                            continue
                        if _lower_bound(vec, rem, gpipe, m, last=not later) >= incumbent:
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
    """One stage appended to a 1F1B partial plan (the recurrence `_extend_1f1b` applies to many at once)."""
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


def _extend_1f1b(bucket: list[_Entry], front: list[_Entry], vecs: np.ndarray, opts: list[Option],
                 columns: tuple[np.ndarray, ...], u: int, n: int, m: int, ahead: float, rem: float, last: bool,
                 incumbent: float) -> None:
    """`_step_1f1b` of every (entry, option) pair at once (the same operations in the same order, so the same
    floats), keeping those whose bounds stay below `incumbent`, inserted in (entry, option) order. `vecs`: the
    entries' vectors; `columns`: the options' forward, backward and tail times."""
    F, B, TL = columns
    P, MF, MB, Gt, GA, GD, H, DONE, TAIL = (vecs[:, i:i + 1] for i in range(9))
    t = F + B
    P2 = P + t
    ok = P2 + ahead < incumbent
    if not ok.any():
        return
    MF2, MB2 = np.maximum(MF, F), np.maximum(MB, B)
    a = P2 + u * MF2
    d = P2 + u * MB2
    if n >= 1:
        Gt2 = np.maximum(Gt + t, n * t)
        DONE2 = np.maximum(np.maximum(np.maximum(DONE, GA + d), np.maximum(GD + a, Gt2 - P2 + a + d)), H + a)
        GA2, GD2, H2 = np.maximum(GA, Gt2 + u * MF2), np.maximum(GD, Gt2 + u * MB2), H
    else:
        H2 = np.maximum(H, (m - 1) * MB2)
        DONE2 = np.maximum(DONE, H2 + a)
        Gt2, GA2, GD2 = Gt, GA, GD
    TAIL2 = np.maximum(TAIL, TL)
    if last:
        low = DONE2 + TAIL2
    else:
        finish = P2 + rem
        low = np.maximum(np.maximum(np.maximum(DONE2, GA2 + finish), np.maximum(GD2 + finish, Gt2 - P2 + 2 * finish)),
                         H2 + finish) + TAIL2
    ok &= low < incumbent
    rows, cols = np.nonzero(ok)
    if not len(rows):
        return
    # Columns are (entries, 1), (1, options) or (entries, options): index each by its own shape.
    zero = np.zeros_like(rows)
    stacked = np.stack([x[rows if x.shape[0] > 1 else zero, cols if x.shape[1] > 1 else zero]
                        for x in (P2, MF2, MB2, Gt2, GA2, GD2, H2, DONE2, TAIL2)], axis=1)
    for i, j, vec in zip(rows.tolist(), cols.tolist(), stacked.tolist()):
        _insert(bucket, _Entry(tuple(vec), front[i], opts[j]))


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


def greedy(tables: list, num_layers: int, m: int, schedule: str) -> tuple[float, list[Option]] | None:
    """A quick good plan to start branch and bound from: the smallest bottleneck F + B that lets the stages
    hold every layer, each stage on its fastest option, then layers taken off the slowest stages."""
    from heteroflow.stagemap.pipeline import pipeline_time
    p = len(tables)
    if p > num_layers:
        return None
    top = num_layers - p + 1
    least = [np.asarray(t.least[:top], dtype=float) for t in tables]
    if any(not np.isfinite(x[0]) for x in least):
        return None

    def most_layers(tau: float) -> list[int]:
        # least is non-decreasing where finite, inf beyond what fits
        return [int(np.searchsorted(np.where(np.isfinite(x), x, np.inf), tau, side="right")) for x in least]

    pool = np.unique(np.concatenate([x[np.isfinite(x)] for x in least]))
    lo, hi = 0, len(pool) - 1
    if sum(most_layers(pool[hi])) < num_layers:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        got = most_layers(pool[mid])
        if min(got) >= 1 and sum(got) >= num_layers:
            hi = mid
        else:
            lo = mid + 1
    layers = most_layers(pool[lo])
    while sum(layers) > num_layers:
        k = max((k for k in range(p) if layers[k] > 1), key=lambda k: least[k][layers[k] - 1])
        layers[k] -= 1
    chosen = [tables[k].fastest(layers[k]) for k in range(p)]
    if any(o is None for o in chosen):
        return None
    value = pipeline_time([o.forward_s for o in chosen], [o.backward_s for o in chosen], m, schedule)
    return value + max(o.tail_s for o in chosen), chosen
