"""The planner's gain from choosing ep per stage for MoE models on mixed clusters (predicted step times).

Run: `python benchmarks/bench_moe_ep_plan.py [--models mixtral-8x7b qwen3-30b-a3b] [--out FILE]`

For each model, cluster (A100-80G + Ascend 910B + Hygon BW1000 nodes of 8) and layout space (what `heteroflow
plan` searches, `RUNTIME_LAYOUTS` with expert parallelism; and the same without ZeRO-3, where ep is the lever on expert memory) it
searches:
- the best plan, ep free per stage (etp in {1, tp});
- the best plan with one ep on every stage, for each ep the model allows (`SearchOptions.ep`), keeping the best;
- the `megatron_uniform` baseline (equal stages, one tp / dp / ep everywhere).
Ratios are predicted step times over the per-stage plan's, all from the same cost model in the same run (>1: the
per-stage plan is faster). Pure planner: no training runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heteroflow.config import PRESETS, parse_job  # noqa: E402
from dataclasses import replace  # noqa: E402

from heteroflow.stagemap import RUNTIME_LAYOUTS, search_plan  # noqa: E402

TYPES = ("nvidia-a100-80g", "ascend-910b", "hygon-bw1000")
CLUSTERS = {"24 (1+1+1 nodes)": (1, 1, 1), "32 (1+1+2 nodes)": (1, 1, 2), "64 (2+3+3 nodes)": (2, 3, 3)}
"""Nodes of 8 devices per device type (sizes where a uniform split into whole nodes exists for 32 or 48 layers,
except Mixtral on 24)."""
MAX_EP = 16
PLAN_SPACE = replace(RUNTIME_LAYOUTS, expert_parallel=True)
"""What `heteroflow plan` searches once the runtime runs expert parallelism."""
SPACES = {"ZeRO 0-3": PLAN_SPACE, "ZeRO 0-2": replace(PLAN_SPACE, zero=(0, 1, 2))}


QUICK = ["--models", "mixtral-8x7b"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def job(model: str, nodes: tuple[int, int, int], global_batch_size: int):
    """A job of `model` (4096-token sequences) on a cluster with `nodes[i]` nodes of 8 `TYPES[i]` devices."""
    names = [(t, i) for t, n in zip(TYPES, nodes) for i in range(n)]
    return parse_job({
        "cluster": {"inter_node_gb_per_s": 25,
                    "nodes": [{"name": f"{t.split('-')[1]}-{i}", "device": t, "count": 8} for t, i in names]},
        "model": {"preset": model, "seq_length": 4096},
        "train": {"global_batch_size": global_batch_size, "precision": "bf16"}})


def describe(estimate) -> str:
    """`device type: layers layout` per stage."""
    return "; ".join(f"{s.device_type.split('-')[1]} {s.layers[1] - s.layers[0]}L {s.layout.describe()}"
                     for s in estimate.stages)


def run(model: str, cluster: str, nodes: tuple[int, int, int], global_batch_size: int, space: str,
        summary: list[str]) -> list[str]:
    """The lines of one (model, cluster, layout space) row; its ratios are appended to `summary`."""
    the_job = job(model, nodes, global_batch_size)
    options = SPACES[space]
    start = time.perf_counter()
    free = search_plan(the_job, options=options)
    free_s = time.perf_counter() - start
    lines = [f"{model} on {cluster}, {space}, global batch {global_batch_size} (search {free_s:.1f} s)"]
    if free.estimate is None:
        return lines + ["  no plan fits"]
    best = free.estimate.step_time_s
    lines.append(f"  per-stage ep: step {best:.3f} s  [{describe(free.estimate)}]")
    experts = PRESETS[model].moe.num_experts
    pinned: dict[int, object] = {}
    one_ratio = uniform_ratio = "-"
    for ep in (e for e in range(1, MAX_EP + 1) if experts % e == 0):
        one = search_plan(the_job, options=replace(options, ep=(ep,), include_megatron=False))
        if one.estimate is not None:
            pinned[ep] = one.estimate
    if pinned:
        ep, one = min(pinned.items(), key=lambda kv: kv[1].step_time_s)
        lines.append("  one ep everywhere: " + ", ".join(f"ep{e} {est.step_time_s:.3f} s"
                                                          for e, est in pinned.items()))
        lines.append(f"  best one-ep plan (ep{ep}): step {one.step_time_s:.3f} s  [{describe(one)}]")
        one_ratio = f"{one.step_time_s / best:.3f}x (ep{ep})"
        lines.append(f"  ratio one-ep / per-stage: {one_ratio}")
    uniform = free.baselines["megatron_uniform"].estimate
    if uniform is not None:
        lines.append(f"  megatron_uniform: step {uniform.step_time_s:.3f} s  [{describe(uniform)}]")
        uniform_ratio = f"{uniform.step_time_s / best:.3f}x"
        lines.append(f"  ratio megatron_uniform / per-stage: {uniform_ratio}")
    else:
        lines.append(f"  megatron_uniform: none ({free.baselines['megatron_uniform'].reason})")
    eps = "/".join(str(s.layout.ep) for s in free.estimate.stages)
    summary.append(f"| {model} | {cluster} | {space} | {eps} | {one_ratio} | {uniform_ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b"])
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--out", type=Path, help="also write the output to this file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    out = [f"bench_moe_ep_plan: predicted step times (cost model, no training); load average at start "
           f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"]
    print(out[0], flush=True)
    summary = ["", "| model | devices | space | ep per stage | best one-ep / per-stage | megatron_uniform / per-stage |",
               "|---|---|---|---|---|---|"]
    clusters, spaces = (list(CLUSTERS)[:1], list(SPACES)[:1]) if args.quick else (list(CLUSTERS), list(SPACES))
    for model in args.models:
        for cluster in clusters:
            nodes = CLUSTERS[cluster]
            for space in spaces:
                lines = run(model, cluster, nodes, args.global_batch_size, space, summary)
                print("\n".join(lines), flush=True)
                out += lines
    print("\n".join(summary))
    out += summary
    out.append(f"load average at end {os.getloadavg()[0]:.1f}")
    print(out[-1])
    if args.out:
        args.out.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
