"""Calibration from a published measurements table alone (issue 12): fit from two configurations, predict the rest.

    python benchmarks/bench_calibration_published.py

The tables (`benchmarks/data/*.measurements.yaml`, each with its job and the source cited in the job file) are
published measurements of one model in several tp / pp / dp layouts on devices of one type:
- NVIDIA Megatron-LM throughputs from OneFlow's DLPerf benchmark on NVIDIA V100-SXM2-16GB nodes (8 GPUs of one
  node; 32 GPUs of 4 nodes);
- the 16-device table: DeepSpeed + Megatron-LM iteration times of GPT-2 medium on 4 AWS g4dn.12xlarge nodes of
  4 NVIDIA T4 (16 GPUs), every real trial of the AMP paper's artifact that ran: 47 configurations of tp, dp,
  pp, micro-batch size and layer split.

For every table and every pair of its configurations (no pair is picked after the fact), `calibrate` (what
`heteroflow calibrate JOB TABLE` runs) fits the cost model to the pair alone; the calibrated model then
predicts every other configuration. Reported: each prediction / measurement, whether it is within 20%, and
whether the predictions order all the table's configurations as measured. The uncalibrated model, in the same
run, is the baseline; where the table's source quotes its own cost model's predictions (the AMP artifact does),
those are a second one. For the 47-configuration table each pair's line counts instead of listing, and a summary
says how each configuration fares held out over all pairs, what a fit to all 47 reaches, and the predicted
parts of the most under- and over-predicted configurations under that fit. The report goes to
benchmarks/results/bench_calibration_published.txt.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.calibrate.fit import fit_calibration  # noqa: E402
from heteroflow.calibrate.runs import Run, load_runs  # noqa: E402
from heteroflow.config import load_job  # noqa: E402
from heteroflow.stagemap import evaluate_plan  # noqa: E402
from heteroflow.stagemap.calibration import FACTORS  # noqa: E402
from heteroflow.stagemap.estimate import UNCALIBRATED  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data"
TABLES = ("dlperf-megatron-gpt-v100x8", "amp-deepspeed-gpt2-t4x16", "dlperf-megatron-gpt-v100x32")
WITHIN = 0.20
SPELLED_OUT = 3
"""A table with at most this many held-out configurations per pair lists each one's ratio."""
APART = 0.10
"""Out-of-order pairs are also counted among those measured further apart than this (the large table's
times are rounded to 0.01 s, and many of its configurations lie within a few percent of each other)."""


def load_table(name: str) -> tuple[object, list[Run]]:
    """The job and the measured runs of one published table."""
    job = load_job(DATA / f"{name}.yaml")
    runs, _ = load_runs(job, [str(DATA / f"{name}.measurements.yaml")])
    return job, runs


def describe(run: Run, *, micro_batch: bool = False) -> str:
    """tp/dp/pp of a run's plan, as the table names it (and the micro-batch per GPU where the table varies it)."""
    lay = run.plan.stages[0].layout
    name = f"tp{lay.tp} dp{lay.dp} pp{len(run.plan.stages)}"
    return f"{name} mb{run.plan.micro_batch_size // lay.dp}" if micro_batch else name


def leave_two_in(job, runs: list[Run], pair: tuple[int, ...]) -> dict:
    """Fit from `runs[pair]`, predict every run: ratios of the held-out ones, and the pairs of runs out of order."""
    fit = fit_calibration([runs[i] for i in pair])
    predicted = [evaluate_plan(job, r.plan, calibration=fit.calibration).step_time_s for r in runs]
    measured = [r.measured_step_time_s for r in runs]
    held = [k for k in range(len(runs)) if k not in pair]
    ratios = {k: predicted[k] / measured[k] for k in held}
    pairs = list(itertools.combinations(range(len(runs)), 2))
    discordant = [(a, b) for a, b in pairs if (measured[a] - measured[b]) * (predicted[a] - predicted[b]) < 0]
    return {"ratios": ratios, "discordant": discordant, "fit": fit, "measured": measured,
            "fitted": [predicted[i] / measured[i] for i in pair]}


def pair_line(runs: list[Run], pair: tuple[int, int], got: dict, *, name) -> str:
    """One calibration pair's result: every held-out ratio (small tables) or how many are within 20% (large)."""
    ratios, discordant = got["ratios"], got["discordant"]
    fitted = " ".join(f"{v:.3f}" for v in got["fitted"])
    head = f"from {name(runs[pair[0]])} + {name(runs[pair[1]])} (fitted {fitted}): "
    if len(ratios) <= SPELLED_OUT:
        within = all(abs(v - 1) <= WITHIN for v in ratios.values())
        held = ", ".join(f"{name(runs[k])} {v:.3f}" for k, v in ratios.items())
        order = "order kept" if not discordant else "order NOT kept (" + ", ".join(
            f"{name(runs[a])} / {name(runs[b])}" for a, b in discordant) + ")"
        return (head + f"predicted/measured {held}; {'all within 20%' if within else 'NOT all within 20%'}; {order}")
    inside = sum(abs(v - 1) <= WITHIN for v in ratios.values())
    worst = max(ratios, key=lambda k: abs(math.log(ratios[k])))
    measured = got["measured"]
    apart = sum(abs(math.log(measured[a] / measured[b])) > APART for a, b in discordant)
    total = len(runs) * (len(runs) - 1) // 2
    return (head + f"held-out within 20%: {inside} of {len(ratios)} (worst {name(runs[worst])} "
            f"{ratios[worst]:.3f}); out of order: {len(discordant)} of {total} pairs "
            f"({apart} of them measured over {APART:.0%} apart)")


def source_model_baseline(name: str, runs: list[Run], say) -> None:
    """How the table's own source predicted it, where its measurements file quotes those predictions (the AMP
    artifact's cost model, from per-layer profiles of the same machines: "AMP's prediction X s" in each
    configuration's comment): scaled by their median ratio to the measurements (AMP uses its model to rank,
    not to time), the share within 20% and the pairs they order differently from the measurements."""
    text = (DATA / f"{name}.measurements.yaml").read_text(encoding="utf-8")
    quoted = [float(x) for x in re.findall(r"AMP's prediction ([0-9.]+) s", text)]
    if len(quoted) != len(runs):
        return
    measured = [r.measured_step_time_s for r in runs]
    scale = statistics.median(q / m for q, m in zip(quoted, measured))
    within = sum(abs(q / scale / m - 1) <= WITHIN for q, m in zip(quoted, measured))
    discordant = [(a, b) for a, b in itertools.combinations(range(len(runs)), 2)
                  if (measured[a] - measured[b]) * (quoted[a] - quoted[b]) < 0]
    apart = sum(abs(math.log(measured[a] / measured[b])) > APART for a, b in discordant)
    say(f"baseline, the source's own cost model (AMP's predictions, profiled on these machines), scaled by its "
        f"median ratio {scale:.3f}: within {WITHIN:.0%}: {within} of {len(runs)}; out of order: {len(discordant)} of "
        f"{len(runs) * (len(runs) - 1) // 2} pairs ({apart} of them measured over {APART:.0%} apart)")


def table_report(name: str, say) -> dict:
    """Report one table: its configurations, every calibration pair's predictions, and (a large table) a summary."""
    job, runs = load_table(name)
    say(f"== {name}: {len(runs)} configurations of one model on {runs[0].plan.num_devices} x "
        f"{runs[0].plan.stages[0].device_type} (source: benchmarks/data/{name}.yaml)")
    varies_micro_batch = len({describe(r, micro_batch=True) for r in runs}) > len({describe(r) for r in runs})
    label = functools.partial(describe, micro_batch=varies_micro_batch)
    uncal = [evaluate_plan(job, r.plan, calibration=UNCALIBRATED).step_time_s for r in runs]
    say(f"{'configuration':18s} {'measured tok/s':>14s} {'measured s':>10s} {'uncal. s':>9s} {'uncal/meas':>10s}")
    tokens = job.train.global_batch_size * job.model.seq_length
    for r, u in zip(runs, uncal):
        say(f"{label(r):18s} {tokens / r.measured_step_time_s:14.0f} {r.measured_step_time_s:10.4f} {u:9.4f} "
            f"{u / r.measured_step_time_s:10.3f}")
    source_model_baseline(name, runs, say)
    table = {"pairs": 0, "within": 0, "ordered": 0, "ordered_apart": 0}
    shares, out_of_order = [], []
    held_out = {k: [] for k in range(len(runs))}
    for pair in itertools.combinations(range(len(runs)), 2):
        got = leave_two_in(job, runs, pair)
        ratios = got["ratios"].values()
        for k, v in got["ratios"].items():
            held_out[k].append(v)
        table["pairs"] += 1
        table["within"] += all(abs(v - 1) <= WITHIN for v in ratios)
        table["ordered"] += not got["discordant"]
        measured = got["measured"]
        table["ordered_apart"] += all(abs(v - 1) <= WITHIN for v in ratios) and not any(
            abs(math.log(measured[a] / measured[b])) > APART for a, b in got["discordant"])
        shares.append(sum(abs(v - 1) <= WITHIN for v in ratios) / len(ratios))
        out_of_order.append(len(got["discordant"]))
        say(pair_line(runs, pair, got, name=label))
    if len(runs) - 2 > SPELLED_OUT:
        say(f"{name}: {table['pairs']} pairs; every held-out configuration within {WITHIN:.0%}: {table['within']}; "
            f"measured order kept: {table['ordered']}; per pair, median share within {WITHIN:.0%}: "
            f"{statistics.median(shares):.0%}, median pairs out of order: {statistics.median(out_of_order):.0f} of "
            f"{len(runs) * (len(runs) - 1) // 2}; every held-out configuration within {WITHIN:.0%} and every two "
            f"measured over {APART:.0%} apart in order: {table['ordered_apart']}")
        diagnose(job, runs, held_out, label, say)
    say()
    return table


def diagnose(job, runs: list[Run], held_out: dict[int, list[float]], label, say) -> None:
    """Where a large table's predictions miss: each configuration held out over all pairs, what a fit to every
    configuration reaches, and the predicted parts of the most under- and over-predicted configurations."""
    say("each configuration held out, over the pairs: median predicted/measured (share outside 20%), "
        "most under-predicted first:")
    order = sorted(held_out, key=lambda k: statistics.median(held_out[k]))
    for k in order:
        outside = sum(abs(v - 1) > WITHIN for v in held_out[k]) / len(held_out[k])
        say(f"  {label(runs[k]):18s} {statistics.median(held_out[k]):.3f} ({outside:.0%})")
    every = leave_two_in(job, runs, tuple(range(len(runs))))
    factors = every["fit"].calibration.factors[runs[0].plan.stages[0].device_type]
    measured = every["measured"]
    apart = sum(abs(math.log(measured[a] / measured[b])) > APART for a, b in every["discordant"])
    say(f"all {len(runs)} fitted together (what the cost model's factors can reach): predicted/measured "
        f"{min(every['fitted']):.3f} to {max(every['fitted']):.3f}, {len(every['discordant'])} of "
        f"{len(runs) * (len(runs) - 1) // 2} pairs out of order ({apart} of them measured over {APART:.0%} apart); "
        f"factors " + ", ".join(f"{k} {getattr(factors, k):.3g}" for k in FACTORS))
    for k in (order[0], order[-1]):
        estimate = evaluate_plan(job, runs[k].plan, calibration=every["fit"].calibration)
        parts = " + ".join(f"{part[:-2]} {v:.3f}" for part, v in estimate.stages[0].times.to_dict().items() if v > 5e-4)
        say(f"  {label(runs[k])}, first stage's parts so fitted (s): measured {runs[k].measured_step_time_s:.2f}, "
            f"predicted {estimate.step_time_s:.3f} = {parts}")


def main(argv: list[str]) -> int:
    quick = "--quick" in argv  # the first table only, and no report file (what the test suite runs)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say("$ python benchmarks/bench_calibration_published.py")
    totals = {"pairs": 0, "within": 0, "ordered": 0, "ordered_apart": 0}
    for name in list(TABLES)[:1] if quick else TABLES:
        table = table_report(name, say)
        for key in totals:
            totals[key] += table[key]
    say(f"pairs: {totals['pairs']}; every held-out configuration within {WITHIN:.0%}: {totals['within']}; "
        f"measured order kept: {totals['ordered']}; both, counting only the pairs measured over {APART:.0%} apart: "
        f"{totals['ordered_apart']}")
    if not quick:
        (REPO / "benchmarks" / "results" / "bench_calibration_published.txt").write_text("\n".join(lines) + "\n",
                                                                                          encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
