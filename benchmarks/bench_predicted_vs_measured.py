"""Predicted vs measured step time of emulated training plans (issue 5, benchmark 2).

    python benchmarks/bench_predicted_vs_measured.py          # profile, then every plan (~4-8 min on 2 cores)
    python benchmarks/bench_predicted_vs_measured.py --steps 12 --plans 2stage-1f1b demo-3stage-8ranks

In one run:
1. profile this machine with the code `heteroflow profile` runs (`measure_profile`), written to a temporary
   file and read back with `load_profile`, as a job's `cluster.profile` would be;
2. for each plan (tiny-llama variants, fp32, on the emulated three-vendor cluster of the README demo):
   predict the step time with `evaluate_plan(job, plan, profile=..., emulate=True)`, then train it for real
   with `train_job(..., emulate=True)` (what `heteroflow train --emulate` runs: one local CPU process per
   device over gloo, the launcher's default threads per process), drop the warm-up steps and take the
   median of rank 0's `step_time_s`;
3. print one line per plan: predicted, measured, measured / predicted, whether it is within 15%, and the
   same for the round in which other processes kept the fewest cores busy; with the load averages. The
   machine is shared: other jobs' load slows the measured steps, never the prediction (which prices an
   otherwise idle machine). So every plan runs in `--rounds` fresh launches, in alternating order, each
   after a short wait (`--quiet-wait`) for the other jobs to leave the cores idle, and the benchmark counts
   the CPU time the other processes took during each launch (/proc/stat less its own and its children's).
The report also goes to benchmarks/results/bench_predicted_vs_measured.txt (`--output`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.config import parse_job  # noqa: E402
from heteroflow.stagemap.hardware import threads_per_process  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLUSTER = {"inter_node_gb_per_s": 10, "nodes": [
    {"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
    {"name": "npu-0", "device": "ascend-910b2", "count": 2},
    {"name": "dcu-0", "device": "hygon-bw1000", "count": 4}]}
TOLERANCE = 0.15


@dataclass(frozen=True)
class BenchPlan:
    """One emulated plan: stages as in a job's `plan:` section, and the batch it trains."""

    name: str
    stages: tuple[dict, ...]
    schedule: str = "1f1b"
    micro_batch_size: int = 4
    global_batch_size: int = 16
    num_layers: int = 8
    hidden_size: int = 128


PLANS = (
    BenchPlan("2stage-1f1b", ({"devices": ["gpu-0:0"], "layers": 4}, {"devices": ["npu-0:0"], "layers": 4})),
    BenchPlan("2stage-gpipe", ({"devices": ["gpu-0:0"], "layers": 4}, {"devices": ["npu-0:0"], "layers": 4}),
              schedule="gpipe"),
    BenchPlan("2stage-recompute", ({"devices": ["gpu-0:0"], "layers": 4, "recompute": "full"},
                                   {"devices": ["npu-0:0"], "layers": 4, "recompute": "full"})),
    BenchPlan("2stage-h256-mbs2", ({"devices": ["gpu-0:0"], "layers": 2}, {"devices": ["npu-0:0"], "layers": 2}),
              micro_batch_size=2, num_layers=4, hidden_size=256),
    BenchPlan("3stage-tp2|dp2|tp1", ({"devices": ["gpu-0"], "layers": 3, "tp": 2},
                                     {"devices": ["npu-0"], "layers": 3, "dp": 2},
                                     {"devices": ["dcu-0:0"], "layers": 2})),
    BenchPlan("demo-3stage-8ranks", ({"devices": ["gpu-0"], "layers": 3, "tp": 2},
                                     {"devices": ["npu-0"], "layers": 2, "dp": 2},
                                     {"devices": ["dcu-0"], "layers": 3, "tp": 2, "dp": 2})),
)


QUICK = ["--steps", "2", "--warmup", "1", "--plans", "2stage-1f1b", "--rounds", "1", "--quiet-wait", "0",
         "--output", ""]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def make_job(plan: BenchPlan, profile_path: str, steps: int):
    """The job of one plan, naming the measured profile (so the runtime's own prediction uses it too)."""
    model = {"preset": "tiny-llama", "num_layers": plan.num_layers}
    if plan.hidden_size != 128:
        model.update(hidden_size=plan.hidden_size, ffn_hidden_size=plan.hidden_size * 344 // 128)
    return parse_job({
        "cluster": {**CLUSTER, "profile": profile_path},
        "model": model,
        "train": {"global_batch_size": plan.global_batch_size, "micro_batch_size": plan.micro_batch_size,
                  "precision": "fp32", "steps": steps, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2,
                  "weight_decay": 0.01},
        "plan": {"schedule": plan.schedule, "micro_batch_size": plan.micro_batch_size,
                 "stages": [dict(s) for s in plan.stages]},
    }, source=f"<{plan.name}>")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` shows them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class OtherJobs:
    """CPU that other processes used: all busy CPU time (/proc/stat) less this process's and its children's
    (the launched ranks), in cores busy on average since `start()`."""

    def start(self) -> None:
        self.busy, self.ours, self.wall = self._busy_s(), self._ours_s(), time.monotonic()

    def cores(self) -> float:
        wall = time.monotonic() - self.wall
        return max(0.0, (self._busy_s() - self.busy) - (self._ours_s() - self.ours)) / max(wall, 1e-9)

    @staticmethod
    def _busy_s() -> float:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal, no guest (counted in user)

    @staticmethod
    def _ours_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def wait_for_quiet(max_wait_s: float, threshold_cores: float) -> tuple[float, float]:
    """Wait (up to `max_wait_s`) until other jobs use less than `threshold_cores` over 3 s; returns (seconds
    waited, their cores in the last window)."""
    start, others = time.monotonic(), OtherJobs()
    while True:
        others.start()
        time.sleep(3.0)
        used = others.cores()
        if used < threshold_cores or time.monotonic() - start >= max_wait_s:
            return time.monotonic() - start, used


def measure_plan(job, steps: int, warmup: int, work_dir: Path, name: str) -> list[float]:
    """Train `job` emulated for `steps` steps; rank 0's step times after `warmup` steps."""
    from heteroflow.launcher.prepare import TrainOptions
    from heteroflow.launcher.train import train_job
    from heteroflow.runtime.metrics import read_step_records
    metrics = work_dir / f"{name}.jsonl"
    train_job(job, TrainOptions(emulate=True, steps=steps, metrics_path=str(metrics),
                                log_dir=str(work_dir / f"logs-{name}")))
    records = read_step_records(metrics)
    return [r["step_time_s"] for r in records if r["step"] >= warmup]


def reference_slowdown(profile) -> float:
    """How much slower the profiled real block ran than the one-thread curves predict (see `in_block_slowdown`)."""
    from dataclasses import replace
    from heteroflow.stagemap.emulation import emulated_device, in_block_slowdown
    one = emulated_device("fp32", profile=replace(profile, cpu_thread=replace(profile.cpu_thread, reference_block_s={})),
                          num_ranks=profile.host.cpu_cores, cores=profile.host.cpu_cores)
    return in_block_slowdown(one, profile.cpu_thread, "fp32")


def describe(plan: BenchPlan, job) -> str:
    """Stages as tp/dp and layers, schedule, recompute, batch."""
    stages = " | ".join(f"tp{s.layout.tp} dp{s.layout.dp} x{s.layers}" + (f" rc-{s.layout.recompute}" if s.layout.recompute != "none" else "")
                        for s in job.plan.stages)
    return (f"{stages}; {plan.schedule}, {job.plan.num_micro_batches(job.train)} x {plan.micro_batch_size} samples"
            f", hidden {job.model.hidden_size}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per plan, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps not counted")
    parser.add_argument("--plans", nargs="*", default=[p.name for p in PLANS], help="plan names to run")
    parser.add_argument("--rounds", type=int, default=2, help="fresh launches of every plan")
    parser.add_argument("--quiet-wait", type=float, default=20.0,
                        help="seconds to wait at most, before each plan, for other jobs to leave the cores idle")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "bench_predicted_vs_measured.txt"),
                        help="also write the report here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args(argv)
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(argv if argv is not None else sys.argv[1:])])
    unknown = sorted(set(args.plans) - {p.name for p in PLANS})
    if unknown:
        parser.error(f"unknown plans {unknown}; known: {[p.name for p in PLANS]}")
    if args.steps <= args.warmup or args.rounds < 1:
        parser.error("--steps must exceed --warmup, and --rounds be at least 1")

    from heteroflow.stagemap import evaluate_plan, load_profile, save_profile
    from heteroflow.measure import measure_profile

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    start = time.time()
    load_before = load_average()
    waited, others_before = wait_for_quiet(args.quiet_wait, 0.2)
    work_dir = Path(tempfile.mkdtemp(prefix="heteroflow-bench-pred-"))
    profile_path = str(work_dir / "profile.yaml")
    save_profile(measure_profile(disk_dir=str(work_dir), quick=args.quick), profile_path)  # quick: profile's --quick
    profile = load_profile(profile_path)
    load_after_profile = load_average()
    import torch
    say(f"$ python benchmarks/bench_predicted_vs_measured.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    say(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime(start))}, {os.cpu_count()} cores, torch {torch.__version__}"
        f"; the machine is shared with other jobs: their load slows measured steps, never the prediction")
    if os.environ.get("OMP_NUM_THREADS"):
        say(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set: the ranks use it, the prediction assumes "
            "the launcher's default split of the cores")
    thread, link = profile.cpu_thread, profile.link
    say("profile (measured now by the code of `heteroflow profile`), one CPU thread: fp32 GEMM "
        + ", ".join(f"n={n} {r * 1e3:.3g}" for n, r in thread.gemm_tflops["fp32"] if n in (32, 128, 1024))
        + f" GFLOP/s; elementwise {thread.elementwise_gb_per_s:.3g} GB/s; block overhead "
        f"{thread.block_forward_overhead_s * 1e3:.2f} / {thread.block_backward_overhead_s * 1e3:.2f} ms; reference "
        f"block {' / '.join(f'{t * 1e3:.2f}' for t in thread.reference_block_s['fp32'])} ms, "
        f"{reference_slowdown(profile):.2f}x the curves' prediction; gloo point to point {link.gb_per_s:.3g} GB/s "
        f"+ {link.latency_s * 1e6:.0f} us, all-reduce {link.allreduce_gb_per_s:.3g} GB/s + "
        f"{link.allreduce_latency_s * 1e6:.0f} us per step")
    say(f"load average before: {load_before} (after profiling: {load_after_profile}; waited {waited:.0f} s for other "
        f"jobs to use {others_before:.2f} cores before profiling)")
    say(f"each plan: {args.rounds} rounds (a fresh launch each, plans in alternating order) of {args.steps} steps, "
        f"the first {args.warmup} dropped; measured = median of rank 0's step_time_s over the rounds")
    say()
    chosen = [plan for plan in PLANS if plan.name in args.plans]
    jobs = {plan.name: make_job(plan, profile_path, args.steps) for plan in chosen}
    estimates = {name: evaluate_plan(job, job.plan, profile=profile, emulate=True) for name, job in jobs.items()}
    runs: dict[str, list[tuple[list[float], float]]] = {plan.name: [] for plan in chosen}
    for round_ in range(args.rounds):
        for plan in chosen if round_ % 2 == 0 else chosen[::-1]:  # no plan always meets the same load
            waited, idle_before = wait_for_quiet(args.quiet_wait, 0.2)
            before, others = load_average(), OtherJobs()
            others.start()
            times = measure_plan(jobs[plan.name], args.steps, args.warmup, work_dir, f"{plan.name}-{round_}")
            other_cores = others.cores()
            runs[plan.name].append((times, other_cores))
            say(f"round {round_ + 1} {plan.name}: predicted {estimates[plan.name].step_time_s:.3f} s, measured "
                f"{statistics.median(times):.3f} s (steps {' '.join(f'{t:.3f}' for t in times)}); load {before} -> "
                f"{load_average()}; other jobs used {other_cores:.2f} of {os.cpu_count()} cores meanwhile "
                f"(waited {waited:.0f} s, for {idle_before:.2f})")
    say()
    say(f"{'plan':20s} {'ranks':>5s} {'predicted s':>11s} {'measured s':>10s} {'meas/pred':>9s}  {'within 15%':10s}"
        f"| quietest round: {'measured s':>10s} {'meas/pred':>9s} {'other jobs (cores)':>18s}")
    rows = []
    for plan in chosen:
        job, estimate = jobs[plan.name], estimates[plan.name]
        measured = statistics.median([t for times, _ in runs[plan.name] for t in times])
        quiet_times, quiet_cores = min(runs[plan.name], key=lambda run: run[1])
        quiet = statistics.median(quiet_times)
        ratio = measured / estimate.step_time_s
        rows.append((plan, job, estimate, ratio))
        say(f"{plan.name:20s} {job.plan.num_devices:5d} {estimate.step_time_s:11.3f} {measured:10.3f} {ratio:9.2f}  "
            f"{'yes' if abs(ratio - 1.0) <= TOLERANCE else 'no':10s}| {'':16s}{quiet:10.3f} "
            f"{quiet / estimate.step_time_s:9.2f} {quiet_cores:18.2f}")
    say("(threads per rank: the cores split between the ranks, at least one: "
        + ", ".join(sorted({f"{threads_per_process(os.cpu_count() or 1, j.plan.num_devices)} with {j.plan.num_devices} ranks"
                            for _, j, *_ in rows})) + ")")
    say()
    for plan, job, estimate, *_ in rows:
        parts = "; ".join(f"s{s.index} F {s.forward_s * 1e3:.1f} B {s.backward_s * 1e3:.1f} tail {s.tail_s * 1e3:.1f} ms"
                          for s in estimate.stages)
        say(f"{plan.name}: {describe(plan, job)}; predicted per micro-batch: {parts}")
    say()
    say("quietest round: the round in which the machine's other processes kept the fewest cores busy on average "
        "(the prediction prices an otherwise idle machine)")
    within = sum(abs(ratio - 1.0) <= TOLERANCE for *_, ratio in rows)
    say(f"{within} of {len(rows)} plans within 15%; load average after: {load_average()}; "
        f"whole run {time.time() - start:.0f} s")
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
