"""`train.compile: true` vs eager on the README's emulated demo: the same losses, and the speed ratio on the CPU.

    python benchmarks/bench_compile.py [--steps 8] [--rounds 1]
    python benchmarks/bench_compile.py --quick       # micro-llama on two emulated ranks, 3 steps (a test runs it)

Each run is `heteroflow train JOB --emulate` in a fresh process tree (8 ranks for the demo), once with the job as
written and once with `train.compile: true`, alternating which goes first round after round so a change in the
machine's load hits both. Step times are the median over the steps after the first `--skip` of every run (the
compiled run's first step compiles). Printed: both loss curves and their largest relative difference, the median
step times and the ratio eager / compiled (> 1: compiling is faster), and the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from heteroflow.runtime.metrics import read_step_records  # noqa: E402

DEMO = REPO / "configs" / "jobs" / "emulated-three-vendor.yaml"
QUICK_JOB = {"cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 2}]},
             "model": {"preset": "micro-llama"},
             "train": {"global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32", "steps": 3, "lr": 3e-3,
                       "min_lr": 3e-4, "warmup_steps": 1},
             "plan": {"schedule": "1f1b", "micro_batch_size": 2,
                      "stages": [{"devices": ["host:0-0"], "layers": 2}, {"devices": ["host:1-1"], "layers": 2}]}}
QUICK = ["--steps", "3", "--skip", "1", "--rounds", "1"]
"""The sizes `--quick` runs (with `QUICK_JOB` instead of the demo)."""


def job_file(base: dict, *, compiled: bool, work: Path, name: str) -> Path:
    """`base` with `train.compile` set, written where the run reads it (the cluster path made absolute)."""
    job = {**base, "train": {**base["train"], "compile": compiled}}
    if isinstance(job["cluster"], str):
        job["cluster"] = str((DEMO.parent / job["cluster"]).resolve())
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def train(job: Path, steps: int, work: Path, name: str) -> list[dict]:
    """One `heteroflow train --emulate` run; its step records."""
    metrics = work / f"{name}.jsonl"
    env = {**os.environ, "HETEROFLOW_CACHE": str(work / "cache")}
    result = subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate", "--steps", str(steps),
                             "--metrics", str(metrics), "--log-dir", str(work / f"{name}-logs")],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(result.stdout + result.stderr)[-6000:]}")
    return read_step_records(metrics)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps of every run not timed (compiling)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating which goes first")
    parser.add_argument("--quick", action="store_true", help="micro-llama on two ranks, 3 steps (the test suite's)")
    args = parser.parse_args(argv)
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *argv])
    base = QUICK_JOB if args.quick else yaml.safe_load(DEMO.read_text())
    load = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; {os.cpu_count()} cores, shared machine")
    print(f"job: {'quick (micro-llama, 2 ranks)' if args.quick else DEMO.relative_to(REPO)}; {args.steps} steps per "
          f"run, first {args.skip} not timed, {args.rounds} round(s)")
    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for compiled in ((False, True) if r % 2 == 0 else (True, False)):
                name = f"{'compiled' if compiled else 'eager'}-{r}"
                started = time.perf_counter()
                records = train(job_file(base, compiled=compiled, work=work, name=name), args.steps, work, name)
                step_times = [rec["step_time_s"] for rec in records]
                times[compiled] += step_times[args.skip:]
                losses.setdefault(compiled, [rec["loss"] for rec in records])
                print(f"round {r + 1} {name.split('-')[0]:8s} step s: {' '.join(f'{t:.3f}' for t in step_times)} "
                      f"(run {time.perf_counter() - started:.0f} s wall)", flush=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    print("losses eager:    " + " ".join(f"{x:.6f}" for x in losses[False]))
    print("losses compiled: " + " ".join(f"{x:.6f}" for x in losses[True]))
    print(f"largest relative loss difference: {worst:.2e}")
    eager, compiled = statistics.median(times[False]), statistics.median(times[True])
    print(f"median step time: eager {eager:.3f} s, compiled {compiled:.3f} s; ratio eager / compiled "
          f"{eager / compiled:.2f}x")
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
