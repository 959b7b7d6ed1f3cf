"""Calibration from a published measurements table alone (issue 12): fit from two configurations, predict the rest.

    python benchmarks/bench_calibration_published.py

The tables (`benchmarks/data/*.measurements.yaml`, each with its job and the source cited in the job file) are
NVIDIA Megatron-LM throughputs published by OneFlow's DLPerf benchmark on NVIDIA V100-SXM2-16GB nodes: one
model in several tp / pp / dp layouts on the same devices (8 GPUs of one node; 32 GPUs of 4 nodes). No
published table of one model in several layouts on 16 devices of one type was found; these are the closest.

For every table and every pair of its configurations (no pair is picked after the fact), `calibrate` (what
`heteroflow calibrate JOB TABLE` runs) fits the cost model to the pair alone; the calibrated model then
predicts every other configuration. Reported: each prediction / measurement, whether it is within 20%, and
whether the predictions order all the table's configurations as measured. The uncalibrated model, in the same
run, is the baseline. The report goes to benchmarks/results/bench_calibration_published.txt.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.calibrate.fit import fit_calibration  # noqa: E402
from heteroflow.calibrate.runs import Run, load_runs  # noqa: E402
from heteroflow.config import load_job  # noqa: E402
from heteroflow.stagemap import evaluate_plan  # noqa: E402
from heteroflow.stagemap.estimate import UNCALIBRATED  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data"
TABLES = ("dlperf-megatron-gpt-v100x8", "dlperf-megatron-gpt-v100x32")
WITHIN = 0.20


def load_table(name: str) -> tuple[object, list[Run]]:
    """The job and the measured runs of one published table."""
    job = load_job(DATA / f"{name}.yaml")
    runs, _ = load_runs(job, [str(DATA / f"{name}.measurements.yaml")])
    return job, runs


def describe(run: Run) -> str:
    """tp/dp/pp of a run's plan, as the table names it."""
    lay = run.plan.stages[0].layout
    return f"tp{lay.tp} dp{lay.dp} pp{len(run.plan.stages)}"


def leave_two_in(job, runs: list[Run], pair: tuple[int, int]) -> dict:
    """Fit from `runs[pair]`, predict every run: ratios of the held-out ones, and whether the order is kept."""
    fit = fit_calibration([runs[i] for i in pair])
    predicted = [evaluate_plan(job, r.plan, calibration=fit.calibration).step_time_s for r in runs]
    measured = [r.measured_step_time_s for r in runs]
    held = [k for k in range(len(runs)) if k not in pair]
    ratios = {k: predicted[k] / measured[k] for k in held}
    pairs = list(itertools.combinations(range(len(runs)), 2))
    discordant = [(a, b) for a, b in pairs if (measured[a] - measured[b]) * (predicted[a] - predicted[b]) < 0]
    return {"ratios": ratios, "discordant": discordant, "fit": fit, "fitted": [predicted[i] / measured[i] for i in pair]}


def main() -> int:
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say("$ python benchmarks/bench_calibration_published.py")
    totals = {"pairs": 0, "within": 0, "ordered": 0}
    for name in TABLES:
        job, runs = load_table(name)
        devices = runs[0].plan.num_devices
        say(f"== {name}: {len(runs)} configurations of one model on {devices} x "
            f"{runs[0].plan.stages[0].device_type} (source: benchmarks/data/{name}.yaml)")
        uncal = [evaluate_plan(job, r.plan, calibration=UNCALIBRATED).step_time_s for r in runs]
        say(f"{'configuration':18s} {'measured tok/s':>14s} {'measured s':>10s} {'uncal. s':>9s} {'uncal/meas':>10s}")
        tokens = job.train.global_batch_size * job.model.seq_length
        for r, u in zip(runs, uncal):
            say(f"{describe(r):18s} {tokens / r.measured_step_time_s:14.0f} {r.measured_step_time_s:10.4f} {u:9.4f} "
                f"{u / r.measured_step_time_s:10.3f}")
        for pair in itertools.combinations(range(len(runs)), 2):
            got = leave_two_in(job, runs, pair)
            within = all(abs(v - 1) <= WITHIN for v in got["ratios"].values())
            totals["pairs"] += 1
            totals["within"] += within
            totals["ordered"] += not got["discordant"]
            held = ", ".join(f"{describe(runs[k])} {v:.3f}" for k, v in got["ratios"].items())
            order = "order kept" if not got["discordant"] else "order NOT kept (" + ", ".join(
                f"{describe(runs[a])} / {describe(runs[b])}" for a, b in got["discordant"]) + ")"
            say(f"from {describe(runs[pair[0]])} + {describe(runs[pair[1]])} (fitted "
                + " ".join(f"{v:.3f}" for v in got["fitted"]) + f"): predicted/measured {held}; "
                f"{'all within 20%' if within else 'NOT all within 20%'}; {order}")
        say()
    say(f"pairs: {totals['pairs']}; every held-out configuration within {WITHIN:.0%}: {totals['within']}; "
        f"measured order kept: {totals['ordered']}")
    (REPO / "benchmarks" / "results" / "bench_calibration_published.txt").write_text("\n".join(lines) + "\n",
                                                                                      encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
