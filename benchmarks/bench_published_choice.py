"""Does the cost model choose what measured fastest? On each published table (one model measured in several
layouts on devices of one type), among the table's configurations:

    python benchmarks/bench_published_choice.py

- the configuration the model ranks first, and its measured rank (1: measured fastest; ties share a rank);
- the loss of choosing it: best measured step time / its measured step time (1.0: no loss);
- Kendall's tau-b between predicted and measured step times over the whole table;
each uncalibrated, then calibrated (`calibrate`'s fit) from the two configurations `heteroflow tune` would run
first: the two the uncalibrated model ranks first. The candidates are the table's configurations, not the
planner's whole space (only they were measured). The report goes to benchmarks/results/bench_published_choice.txt.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_calibration_published import TABLES, describe, load_table  # noqa: E402
from heteroflow.calibrate.fit import fit_calibration  # noqa: E402
from heteroflow.stagemap import evaluate_plan  # noqa: E402
from heteroflow.stagemap.estimate import UNCALIBRATED  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "bench_published_choice.txt"


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b of two rankings (ties in either count as neither concordant nor discordant)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif dx * dy > 0:
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else float("nan")


def choice(predicted: list[float], measured: list[float]) -> dict:
    """The model's first choice: its index, measured rank, loss, and the table's tau."""
    chosen = min(range(len(predicted)), key=lambda k: predicted[k])
    rank = 1 + sum(m < measured[chosen] for m in measured)
    return {"chosen": chosen, "rank": rank, "loss": min(measured) / measured[chosen],
            "tau": kendall_tau_b(predicted, measured)}


def table_lines(name: str) -> list[str]:
    """One table's report."""
    job, runs = load_table(name)
    label = (lambda r: describe(r, micro_batch=True)) if len({describe(r, micro_batch=True) for r in runs}) > len(
        {describe(r) for r in runs}) else describe
    measured = [r.measured_step_time_s for r in runs]
    uncal = [evaluate_plan(job, r.plan, calibration=UNCALIBRATED).step_time_s for r in runs]
    first_two = sorted(range(len(runs)), key=lambda k: uncal[k])[:2]
    fit = fit_calibration([runs[k] for k in first_two])
    cal = [evaluate_plan(job, r.plan, calibration=fit.calibration).step_time_s for r in runs]
    best = min(range(len(runs)), key=lambda k: measured[k])
    lines = [f"== {name}: {len(runs)} configurations on {runs[0].plan.num_devices} x "
             f"{runs[0].plan.stages[0].device_type}; measured fastest: {label(runs[best])} ({measured[best]:.4f} s)"]
    for title, predicted in (("uncalibrated", uncal),
                             (f"calibrated from {label(runs[first_two[0]])} + {label(runs[first_two[1]])}", cal)):
        got = choice(predicted, measured)
        k = got["chosen"]
        lines.append(f"{title}: first choice {label(runs[k])} (predicted {predicted[k]:.4f} s, measured "
                     f"{measured[k]:.4f} s): measured rank {got['rank']} of {len(runs)}, loss (best measured / "
                     f"chosen measured) {got['loss']:.3f}; Kendall tau-b {got['tau']:.3f}")
    return lines


def main() -> int:
    quick = "--quick" in sys.argv[1:]  # the first table only, no results file (tests/benchmarks/test_quick_modes.py)
    lines = ["$ python benchmarks/bench_published_choice.py"]
    for name in list(TABLES)[:1] if quick else TABLES:
        got = table_lines(name)
        print("\n".join(got), flush=True)
        lines += got + [""]
    if quick:
        return 0
    RESULT.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {RESULT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
