"""Time the planner on mixed clusters of 64, 256 and 1,024 devices (3 device types, an 80-layer model).

Run: `python benchmarks/bench_planner.py [--sizes 64 256 1024] [--exhaustive-limit 600]`

For each size it prints the search's wall and CPU time, the plan found, and its speed-up over the two
baselines. Exhaustive search finishes only on small instances: it is timed on a small mixed cluster (and
tried with a deadline on the sizes above), and its time over the planner's is printed where it finishes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heteroflow.config import parse_job  # noqa: E402
from heteroflow.layout import OffloadSpec  # noqa: E402
from heteroflow.stagemap import SearchOptions, search_plan  # noqa: E402
from heteroflow.stagemap.exhaustive import Timeout, exhaustive_search, space_size  # noqa: E402

TYPES = ("nvidia-a100-80g", "ascend-910b2", "hygon-bw1000")


NODES_PER_TYPE = {64: (3, 3, 2), 256: (8, 16, 8), 1024: (40, 48, 40)}
"""Nodes of 8 devices per type; blocks sized so that a Megatron-style uniform plan exists."""


QUICK = ["--sizes", "64", "--exhaustive-limit", "10"]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--exhaustive-limit", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])

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
              f"({stats['templates']} templates, {stats['templates_solved']} solved); {describe(report)}")
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
