"""`draw_gantt`: the simulated schedule of a plan as a picture (matplotlib, Agg backend, imported lazily).

One row per stage; forward, backward, receiving from a neighbour (communication) and the step's tail
(gradient reduction and optimizer) in colours; white is idle.
"""

from __future__ import annotations

import os

from heteroflow.stagemap.estimate import PlanEstimate
from heteroflow.stagemap.pipeline import simulate

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "recv_fwd": "#8C8C8C", "recv_bwd": "#8C8C8C",
           "tail": "#55A868"}


def draw_gantt(estimate: PlanEstimate, path: str | os.PathLike, *, max_micro_batches: int = 64) -> None:
    """Draw the schedule of `estimate` (the first `max_micro_batches` micro-batches if there are more)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = estimate.stages
    m = min(estimate.num_micro_batches, max_micro_batches)
    compute_f = [s.forward_s - s.recv_forward_s for s in stages]
    compute_b = [s.backward_s - s.recv_backward_s for s in stages]
    recv = [s.recv_backward_s for s in stages[:-1]]
    makespan, events = simulate(compute_f, compute_b, recv, m, estimate.plan.schedule)
    p = len(stages)
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.8))
    for kind in ("forward", "backward", "recv_fwd", "recv_bwd"):
        for k in range(p):
            bars = [(e.start_s, e.end_s - e.start_s) for e in events if e.stage == k and e.kind == kind]
            if bars:
                ax.broken_barh(bars, (p - 1 - k + 0.1, 0.8), facecolors=COLOURS[kind], edgecolor="none")
    for k, s in enumerate(stages):
        if s.tail_s > 0:
            ax.broken_barh([(makespan, s.tail_s)], (p - 1 - k + 0.1, 0.8), facecolors=COLOURS["tail"])
    ax.set_yticks([p - 1 - k + 0.5 for k in range(p)])
    ax.set_yticklabels([f"{k}: {s.num_devices} x {s.device_type}" for k, s in enumerate(stages)], fontsize=8)
    ax.set_xlabel("seconds")
    shown = "" if m == estimate.num_micro_batches else f" (first {m} of {estimate.num_micro_batches} micro-batches)"
    ax.set_title(f"{estimate.plan.schedule}: step {estimate.step_time_s:.3f} s, bubble "
                 f"{estimate.bubble_fraction:.1%}{shown}", fontsize=10)
    ax.legend(handles=[Patch(color=COLOURS["forward"], label="forward"), Patch(color=COLOURS["backward"], label="backward"),
                       Patch(color=COLOURS["recv_fwd"], label="communication"),
                       Patch(color=COLOURS["tail"], label="grad sync + optimizer"),
                       Patch(facecolor="white", edgecolor="black", label="idle")],
              loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=5, fontsize=8)
    ax.set_xlim(0, makespan + max(s.tail_s for s in stages) * 1.05 + 1e-12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
