"""Calibration, leave-some-out on emulated runs (issue 12): calibrate from 2 measured plans, predict the others.

    python benchmarks/bench_calibration.py                    # profile, measure every plan, fit, report (~12 min)
    python benchmarks/bench_calibration.py --measurements benchmarks/results/bench_calibration.json  # refit only

In one run:
1. profile this machine with the code of `heteroflow profile` (as a job's `cluster.profile`);
2. train each of the plans below (tiny-llama variants on the emulated three-vendor cluster of the README
   demo: tp, dp, full recompute, GPipe and 1F1B, 1 to 8 ranks) with `train_job(..., emulate=True)` (what
   `heteroflow train --emulate` runs), in `--rounds` rounds, the plans interleaved (alternating order) so
   that the load other jobs put on this shared machine falls on every plan alike; a plan's measurement is
   the median of its warm step times (the first 2 steps of each launch dropped, as `calibrate` does) over
   the rounds. The raw step times are saved (`--save`), so that the fit can be redone without measuring;
3. calibrate (`calibrate.fit_calibration`, what `heteroflow calibrate` runs) from the two plans named by
   `--calibrate-from` (fixed before measuring: the smallest pipeline and the largest plan), then predict
   every other plan with the calibrated cost model (`evaluate_plan(..., emulate=True)`), and compare.

Goals (issue 12): every held-out prediction within 10% of its measurement, the median within 5%, and the
plans' measured order kept by the calibrated predictions. The uncalibrated model's figures, from the same
run, are the baseline. The report goes to benchmarks/results/bench_calibration.txt (`--output`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.calibrate.fit import fit_calibration  # noqa: E402
from heteroflow.calibrate.runs import Run, measured_parts, warm_step_times  # noqa: E402
from heteroflow.config import parse_job  # noqa: E402
from heteroflow.stagemap import evaluate_plan, load_profile, save_profile  # noqa: E402
from heteroflow.stagemap.estimate import UNCALIBRATED  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLUSTER = {"inter_node_gb_per_s": 10, "nodes": [
    {"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
    {"name": "npu-0", "device": "ascend-910b2", "count": 2},
    {"name": "dcu-0", "device": "hygon-bw1000", "count": 4}]}
TRAIN = {"global_batch_size": 16, "precision": "fp32", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2,
         "weight_decay": 0.01}

PLANS: dict[str, dict] = {  # name -> plan (every one: tiny-llama, 8 layers, global batch 16)
    "1rank": {"micro_batch_size": 4, "stages": [{"devices": ["gpu-0:0"], "layers": 8}]},
    "2stage-1f1b": {"micro_batch_size": 4, "stages": [{"devices": ["gpu-0:0"], "layers": 4},
                                                      {"devices": ["npu-0:0"], "layers": 4}]},
    "2stage-gpipe": {"schedule": "gpipe", "micro_batch_size": 4,
                     "stages": [{"devices": ["gpu-0:0"], "layers": 4}, {"devices": ["npu-0:0"], "layers": 4}]},
    "2stage-recompute": {"micro_batch_size": 4, "stages": [
        {"devices": ["gpu-0:0"], "layers": 4, "recompute": "full"},
        {"devices": ["npu-0:0"], "layers": 4, "recompute": "full"}]},
    "dp2": {"micro_batch_size": 8, "stages": [{"devices": ["gpu-0"], "layers": 8, "dp": 2}]},
    "tp2": {"micro_batch_size": 4, "stages": [{"devices": ["gpu-0"], "layers": 8, "tp": 2}]},
    "4stage-mbs2": {"micro_batch_size": 2, "stages": [{"devices": [f"dcu-0:{i}"], "layers": 2} for i in range(4)]},
    "5rank-tp2|dp2|tp1": {"micro_batch_size": 4, "stages": [
        {"devices": ["gpu-0"], "layers": 3, "tp": 2}, {"devices": ["npu-0"], "layers": 3, "dp": 2},
        {"devices": ["dcu-0:0"], "layers": 2}]},
    "demo-8rank": {"micro_batch_size": 4, "stages": [
        {"devices": ["gpu-0"], "layers": 3, "tp": 2}, {"devices": ["npu-0"], "layers": 2, "dp": 2},
        {"devices": ["dcu-0"], "layers": 3, "tp": 2, "dp": 2}]},
}
CALIBRATE_FROM = ("2stage-1f1b", "demo-8rank")
"""Chosen before measuring: the plain two-stage pipeline and the largest plan."""
WITHIN, MEDIAN_WITHIN = 0.10, 0.05


QUICK = ["--rounds", "1", "--steps", "3", "--plans", "1rank", "2stage-1f1b", "dp2", "--calibrate-from", "1rank",
         "2stage-1f1b", "--quick-profile",
         "--save", os.path.join(tempfile.gettempdir(), "bench_calibration_quick.json"), "--output", ""]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def make_job(name: str, profile_path: str | None, steps: int):
    """The job of one plan (the profile named as its `cluster.profile`)."""
    plan = PLANS[name]
    cluster = {**CLUSTER, **({"profile": profile_path} if profile_path else {})}
    return parse_job({"cluster": cluster, "model": {"preset": "tiny-llama"},
                      "train": {**TRAIN, "micro_batch_size": plan["micro_batch_size"], "steps": steps},
                      "plan": plan}, source=f"<{name}>")


def measure(names: list[str], *, rounds: int, steps: int, profile_path: str,
            work: Path) -> tuple[dict[str, list[list[float]]], dict[str, list[list]]]:
    """Every plan's step times per launch (all steps), the plans interleaved over `rounds` rounds; and per launch
    its stages' measured parts (`calibrate.runs.measured_parts` of the warm steps)."""
    from heteroflow.launcher.prepare import TrainOptions
    from heteroflow.launcher.train import train_job
    from heteroflow.runtime.metrics import read_step_records
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    parts: dict[str, list[list]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            metrics = work / f"{name}-{r}.jsonl"
            train_job(make_job(name, profile_path, steps),
                      TrainOptions(emulate=True, steps=steps, metrics_path=str(metrics), log_dir=str(work / "logs")))
            records = read_step_records(metrics)
            times[name].append([rec["step_time_s"] for rec in records])
            warm = records[len(records) - len(warm_step_times(times[name][-1])):]
            parts[name].append([list(p) for p in measured_parts(warm, len(PLANS[name]["stages"]))])
            print(f"round {r + 1} {name}: " + " ".join(f"{t:.3f}" for t in times[name][-1]), flush=True)
    return times, parts


def chosen_launch(launches: list[list[float]]) -> int:
    """The launch whose median warm step is the plan's measurement (`measured_step`)."""
    medians = [statistics.median(warm_step_times(launch)) for launch in launches]
    return medians.index(min(medians))


def measured_step(launches: list[list[float]]) -> float:
    """The least of the launches' median warm step times (other jobs on the machine only slow a launch down)."""
    return min(statistics.median(warm_step_times(launch)) for launch in launches)


def launch_spread(launches: list[list[float]]) -> float:
    """How far apart a plan's launches measured: the largest launch median over the least, less 1."""
    medians = [statistics.median(warm_step_times(launch)) for launch in launches]
    return max(medians) / min(medians) - 1


def report(data: dict, calibrate_from: tuple[str, ...], say, *, stage_parts: bool = False) -> bool:
    """Fit from `calibrate_from` (with `stage_parts`, also from their stages' measured parts, as `calibrate
    --stage-parts` does), predict the others; print the table; whether every goal is met."""
    profile_path = data["profile_path"]
    profile = load_profile(profile_path)
    names = list(data["times"])
    jobs = {name: make_job(name, profile_path, 10) for name in names}
    measured = {name: measured_step(data["times"][name]) for name in names}
    runs = [Run(source=name, job=jobs[name], plan=jobs[name].plan, emulate=True, measured_step_time_s=measured[name],
                measured_parts=tuple(tuple(p) for p in data.get("parts", {}).get(name, [[]] * 9)[
                    chosen_launch(data["times"][name])]))
            for name in calibrate_from]
    fit = fit_calibration(runs, stage_parts=stage_parts)
    cal = fit.calibration
    factors = next(iter(cal.factors.values()))
    say(f"calibrated from {', '.join(calibrate_from)}{' and their stage parts' if stage_parts else ''}: factors (every device type, emulated) "
        + ", ".join(f"{k} {v:.3f}" for k, v in factors.to_dict().items())
        + (f"; not pinned down: {', '.join(cal.not_pinned_down)}" if cal.not_pinned_down else ""))
    say()
    rows = []
    for name in names:
        job = jobs[name]
        before = evaluate_plan(job, job.plan, profile=profile, emulate=True, calibration=UNCALIBRATED).step_time_s
        after = evaluate_plan(job, job.plan, profile=profile, emulate=True, calibration=cal).step_time_s
        rows.append((name, job.plan.num_devices, measured[name], before, after, name in calibrate_from))
    say(f"{'plan':18s} {'ranks':>5s} {'measured s':>10s} {'uncal. s':>9s} {'uncal/meas':>10s} {'calibrated s':>12s} "
        f"{'cal/meas':>8s}  role")
    for name, ranks, m, b, a, used in rows:
        say(f"{name:18s} {ranks:5d} {m:10.4f} {b:9.4f} {b / m:10.3f} {a:12.4f} {a / m:8.3f}  "
            f"{'calibrated from' if used else 'held out: ' + ('ok' if abs(a / m - 1) <= WITHIN else 'OFF')}")
    held = [(name, m, b, a) for name, _, m, b, a, used in rows if not used]
    errors = [abs(a / m - 1) for _, m, _, a in held]
    errors_before = [abs(b / m - 1) for _, m, b, _ in held]
    by_measured = [name for name, *_ in sorted(rows, key=lambda r: r[2])]
    by_predicted = [name for name, *_ in sorted(rows, key=lambda r: r[4])]
    pairs = [(x, y) for i, x in enumerate(rows) for y in rows[i + 1:]]
    discordant = [(x[0], y[0]) for x, y in pairs if (x[2] - y[2]) * (x[4] - y[4]) < 0]
    say()
    say(f"held out: {len(held)} plans; |calibrated/measured - 1|: max {max(errors):.1%}, median "
        f"{statistics.median(errors):.1%} (uncalibrated: max {max(errors_before):.1%}, median "
        f"{statistics.median(errors_before):.1%}); within {WITHIN:.0%}: {sum(e <= WITHIN for e in errors)} of "
        f"{len(errors)}")
    say(f"measured order:   {' < '.join(by_measured)}")
    say(f"calibrated order: {' < '.join(by_predicted)}")
    say(f"pairs ordered differently: {len(discordant)} of {len(pairs)}"
        + (" (" + ", ".join(f"{a}/{b}" for a, b in discordant) + ")" if discordant else ""))
    spread = {name: launch_spread(data["times"][name]) for name in names}
    resolved = [(a, b) for a, b in discordant if abs(measured[a] / measured[b] - 1) > max(spread[a], spread[b])]
    say(f"  of them measured further apart than their launches spread (launch medians' max/min - 1: "
        f"{min(spread.values()):.1%} to {max(spread.values()):.1%}): {len(resolved)}"
        + (" (" + ", ".join(f"{a}/{b}" for a, b in resolved) + ")" if resolved else ""))
    met = max(errors) <= WITHIN and statistics.median(errors) <= MEDIAN_WITHIN and not discordant
    say(f"goals (every held-out plan within {WITHIN:.0%}, median within {MEDIAN_WITHIN:.0%}, measured order kept): "
        f"{'met' if met else 'NOT met'}")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="launches of every plan, interleaved")
    parser.add_argument("--steps", type=int, default=8, help="steps per launch (the first 2 are not measured)")
    parser.add_argument("--plans", nargs="*", default=list(PLANS), help="plan names to run")
    parser.add_argument("--calibrate-from", nargs=2, default=list(CALIBRATE_FROM), metavar="PLAN")
    parser.add_argument("--quick-profile", action="store_true",
                        help="profile with `heteroflow profile --quick` sizes (GEMMs up to 256: tiny-llama's range)")
    parser.add_argument("--measurements", metavar="FILE.json", help="refit from saved measurements, measure nothing")
    parser.add_argument("--save", default=str(REPO / "benchmarks" / "results" / "bench_calibration.json"),
                        help="where the measurements (and the profile) are saved")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "bench_calibration.txt"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args(argv)
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(argv if argv is not None else sys.argv[1:])])
    if set(args.plans) - set(PLANS) or not set(args.calibrate_from) <= set(args.plans):
        parser.error(f"plans are among {list(PLANS)}, and --calibrate-from among them")
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    start = time.time()
    say(f"$ python benchmarks/bench_calibration.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.measurements:
        data = json.loads(Path(args.measurements).read_text())
        profile_file = Path(args.measurements).with_suffix(".profile.yaml")
        data["profile_path"] = str(profile_file)
        say(f"# refit from {args.measurements} (measured {data['when']}, load average {data['load']})")
    else:
        from heteroflow.measure import measure_profile
        import torch
        work = Path(tempfile.mkdtemp(prefix="heteroflow-bench-cal-"))
        profile_file = Path(args.save).with_suffix(".profile.yaml")
        save_profile(measure_profile(disk_dir=str(work), quick=args.quick_profile), profile_file)
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        times, parts = measure(args.plans, rounds=args.rounds, steps=args.steps, profile_path=str(profile_file),
                               work=work)
        data = {"when": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(start)), "cores": os.cpu_count(),
                "torch": torch.__version__, "rounds": args.rounds, "steps": args.steps,
                "load": f"{load_before} -> {' '.join(f'{x:.2f}' for x in os.getloadavg())}", "times": times,
                "parts": parts}
        Path(args.save).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        data["profile_path"] = str(profile_file)
        say(f"# {data['when']}, {data['cores']} cores, torch {data['torch']}, load average {data['load']}; "
            "the machine is shared with other jobs")
        say(f"each plan: {args.rounds} launches of {args.steps} steps, interleaved; measured = the least over the "
            f"launches of their median warm step (first 2 of each launch dropped); raw step times in {args.save}")
    say()
    met = report(data, tuple(args.calibrate_from), say)
    if "parts" in data:  # the same runs, fitted also on their measured per-stage parts
        say()
        report(data, tuple(args.calibrate_from), say, stage_parts=True)
    say(f"whole run {time.time() - start:.0f} s")
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0 if met or args.quick else 1  # a quick run's few steps say nothing about the goals


if __name__ == "__main__":
    sys.exit(main())
