"""Time the planner on mixed clusters of 64, 256, 1,024 and 4,096 devices (3 device types, an 80-layer model).

Run: `python benchmarks/bench_planner.py [--sizes 64 256 1024 4096] [--exhaustive-limit 600] [--baseline REV]`

For each size it prints the search's wall and CPU time, the plan found, and its speed-up over the two
baselines. Exhaustive search finishes only on small instances: it is timed on a small mixed cluster (and
tried with a deadline on the sizes above), and its time over the planner's is printed where it finishes.

`--baseline REV` (default: the commit before the search was sped up) also runs the search of that git revision
of `heteroflow/` on each size, in a subprocess of the same run, and prints whether it found the same plan and the
ratio of its search time to this one's (`--baseline none`: skip it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("BENCH_PLANNER_ROOT") or str(REPO))  # a worker runs an older heteroflow

from heteroflow.config import parse_job  # noqa: E402
from heteroflow.layout import OffloadSpec  # noqa: E402
from heteroflow.stagemap import SearchOptions, search_plan  # noqa: E402
from heteroflow.stagemap.exhaustive import Timeout, exhaustive_search, space_size  # noqa: E402

TYPES = ("nvidia-a100-80g", "ascend-910b2", "hygon-bw1000")


BASELINE_REV = "2b60a2c"
"""The last commit before the search was sped up (issue 29): its search took 9-12 s at 1,024 devices."""

NODES_PER_TYPE = {64: (3, 3, 2), 256: (8, 16, 8), 1024: (40, 48, 40)}
"""Nodes of 8 devices per type; blocks sized so that a Megatron-style uniform plan exists."""


QUICK = ["--sizes", "64", "--exhaustive-limit", "10", "--baseline", "none"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def cluster_job(num_devices: int, *, model: object = "llama2-70b", global_batch_size: int = 1024,
                per_node: int = 8) -> dict:
    """A cluster of `num_devices` devices in nodes of `per_node`: a block of nodes per device type."""
    counts = NODES_PER_TYPE.get(num_devices) or (num_devices // per_node // 3,) * 3
    nodes = [(t, i) for t, n in zip(TYPES, counts) for i in range(n)]
    return {
        "cluster": {"inter_node_gb_per_s": 25,
                    "nodes": [{"name": f"{t.split('-')[1]}-{i}", "device": t, "count": per_node} for t, i in nodes]},
        "model": model,
        "train": {"global_batch_size": global_batch_size, "precision": "bf16"},
    }


def small_job() -> dict:
    """Small enough for exhaustive search: 4 devices of 3 types, Llama-2-70B's shape cut to 4 layers."""
    return {
        "cluster": {"inter_node_gb_per_s": 25, "nodes": [
            {"name": "a", "device": "nvidia-a100-40g", "count": 2},
            {"name": "b", "device": "ascend-910b2", "count": 1},
            {"name": "c", "device": "hygon-bw1000", "count": 1}]},
        "model": {"preset": "llama2-70b", "num_layers": 4, "seq_length": 2048},
        "train": {"global_batch_size": 4, "precision": "bf16"},
    }


SMALL_OPTIONS = SearchOptions(zero=(0, 1, 3), recompute=("none", "full"), sp=(False,),
                              offload=(OffloadSpec(), OffloadSpec(optimizer="cpu")))
"""The layout space on the small instance (the full one has 960 layouts per stage: too many to enumerate)."""


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def describe(report) -> str:
    e = report.estimate
    if e is None:
        return "no plan fits"
    kinds = {}
    for s in e.stages:
        kinds[s.device_type] = kinds.get(s.device_type, 0) + 1
    used = ", ".join(f"{n} x {t}" for t, n in kinds.items())
    gains = []
    for name, b in report.baselines.items():
        gains.append(f"{name} {e.tokens_per_s / b.estimate.tokens_per_s:.2f}x" if b.estimate else f"{name} none")
    return (f"{len(e.stages)} stages ({used}), {e.plan.num_devices} devices, mb {e.plan.micro_batch_size}, "
            f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}; vs {', '.join(gains)}")


def record(report, wall: float, cpu: float) -> dict:
    """A search's times, step time, plan and best single-type step time, as the baseline comparison reads them."""
    single = report.baselines["best_single_type"].estimate
    return {"wall_s": wall, "cpu_s": cpu, "step_time_s": report.estimate.step_time_s,
            "plan": report.estimate.plan.to_dict(), "single_step_time_s": single.step_time_s if single else None}


def search_record(n: int) -> dict:
    """`record` of the search on the `n`-device cluster."""
    job = parse_job(cluster_job(n))
    return record(*timed(lambda: search_plan(job)))


def baseline_record(tree: Path, n: int) -> dict:
    """`search_record` run by the heteroflow under `tree` (an older revision), in a subprocess."""
    env = {**os.environ, "BENCH_PLANNER_ROOT": str(tree), "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--worker", str(n)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def export_tree(rev: str, into: str) -> Path:
    """The `heteroflow/` package of git revision `rev`, written under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "heteroflow"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return Path(into)


def compare(n: int, new: dict, rev: str, tree: Path | None) -> None:
    """Print the baseline revision's search on the same cluster: same plan? time ratio."""
    if tree is None:
        return
    old = baseline_record(tree, n)
    same = old["plan"] == new["plan"] and old["step_time_s"] == new["step_time_s"]
    same_single = old["single_step_time_s"] == new["single_step_time_s"]
    print(f"  baseline search ({rev}): {old['wall_s']:.2f} s wall, {old['cpu_s']:.2f} s CPU; "
          f"same plan and step time: {same}, same best single-type step time: {same_single}; "
          f"old / new: {old['wall_s'] / new['wall_s']:.1f}x wall, {old['cpu_s'] / new['cpu_s']:.1f}x CPU", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 1024, 4096])
    parser.add_argument("--exhaustive-limit", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--baseline", default=BASELINE_REV, help="git revision to compare with ('none': skip)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    if args.worker:
        print(json.dumps(search_record(args.worker)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = export_tree(args.baseline, tmp) if args.baseline != "none" else None
        return run(args, tree)


def run(args, tree: Path | None) -> int:
    """The benchmark proper (`tree`: the baseline revision's package, or None)."""

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other jobs share this machine: "
          "CPU seconds are the planner's own work, wall seconds include waiting for the cores)")
    job = parse_job(small_job())
    report, wall, cpu = timed(lambda: search_plan(job, options=SMALL_OPTIONS))
    print(f"small (4 devices, 3 types, 4 layers): planner {wall:.3f} s wall, {cpu:.3f} s CPU; {describe(report)}")
    try:
        (best, _, priced), ewall, ecpu = timed(lambda: exhaustive_search(job, options=SMALL_OPTIONS,
                                                                          deadline_s=args.exhaustive_limit))
        same = abs(best - report.estimate.step_time_s) <= 1e-9 * best
        print(f"  exhaustive: {priced} plans in {ewall:.2f} s wall, {ecpu:.2f} s CPU; same optimum: {same}; "
              f"exhaustive / planner time: {ecpu / cpu:.0f}x (CPU)")
    except Timeout as exc:
        print(f"  exhaustive: did not finish ({exc})")

    for n in args.sizes:
        job = parse_job(cluster_job(n))
        report, wall, cpu = timed(lambda: search_plan(job))
        stats = report.stats
        print(f"{n} devices (3 types, 80 layers, global batch 1024): planner {wall:.2f} s wall, {cpu:.2f} s CPU "
              f"({stats['templates']} templates, {stats['templates_solved']} solved); {describe(report)}", flush=True)
        compare(n, record(report, wall, cpu), args.baseline, tree)
        size = space_size(job)
        if n <= 64:
            try:
                (_, _, priced), ewall, _ = timed(lambda: exhaustive_search(job, deadline_s=min(args.exhaustive_limit, 60)))
                print(f"  exhaustive: {priced} plans in {ewall:.1f} s")
            except Timeout as exc:
                print(f"  exhaustive: did not finish ({exc}); the space holds {size:.2e} plans")
        else:
            print(f"  exhaustive: not attempted; the space holds {size:.2e} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
