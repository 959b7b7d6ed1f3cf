"""What timing a step by part costs: a tp=2 stage's forward and backward, plain vs timed as the runtime times it.

    python benchmarks/bench_stage_timing.py                    # tiny-llama 4 layers, 4 micro-batches, 20 rounds

Two local processes over gloo hold one tp=2 stage (tiny-llama's first layers, embedding included, fp32). A
"step" is forward and backward of every micro-batch, then the ranks meet in a world all-reduce (the step's
norm all-reduce). Timed, as `runtime.worker` does it: a `PartTimer` part around every forward and backward,
the stage's tp collectives timed inside them (`tp_ops.timing_collectives`), `collect` after the step and
`gather_step_figures` (the per-step gather to rank 0, here with zero memory figures). Plain: none of it.
Rounds alternate which comes first, so both see the same machine load; the ratio is timed / plain of the median
step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from heteroflow.testing import run_ranks  # noqa: E402


QUICK = ["--rounds", "1", "--num-layers", "2", "--micro-batches", "2", "--micro-batch-size", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def _rank(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    from heteroflow.backends import RankMap
    from heteroflow.config import parse_job
    from heteroflow.devices.facade import Device
    from heteroflow.devices.timing import PartTimer
    from heteroflow.layout import ParallelLayout
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.models.parallelize import parallelize_stage
    from heteroflow.models.tp_ops import timing_collectives
    from heteroflow.runtime.memory import MEASURED_KEYS
    from heteroflow.runtime.stage_times import gather_step_figures, rank_figures

    job = parse_job({"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 2}]},
                     "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 2, "precision": "fp32"},
                     "plan": {"micro_batch_size": 2, "stages": [{"devices": ["a"], "layers": 8, "tp": 2}]}})
    rank_map = RankMap.from_plan(job.plan, job.cluster)
    model = build_stage_model(job.model, first_layer=0, last_layer=args.num_layers, is_first=True, is_last=False)
    init_weights(model, seed=1)
    group = dist.new_group([0, 1])
    parallelize_stage(model, layout=ParallelLayout(tp=2), tp_group=group)
    torch.manual_seed(0)
    batches = [torch.randint(0, job.model.vocab_size, (args.micro_batch_size, job.model.seq_length))
               for _ in range(args.micro_batches)]
    timer = PartTimer(Device.cpu().new_event)
    opened = [0]
    part_of = timer.part

    def counted(name: str):
        opened[0] += 1
        return part_of(name)

    timer.part = counted  # counts the parts a step opens, collectives included

    def step(timed: bool) -> float:
        started = time.perf_counter()
        part = timer.part if timed else None
        with timing_collectives(group if timed else None, timer):
            for tokens in batches:
                if timed:
                    with part("forward"):
                        out = model(tokens)
                    with part("backward"):
                        out.float().pow(2).mean().backward()
                else:
                    out = model(tokens)
                    out.float().pow(2).mean().backward()
        dist.all_reduce(torch.zeros(2))
        if timed:
            figures = rank_figures(timer.collect(), step_s=time.perf_counter() - started)
            gather_step_figures(figures, dict.fromkeys(MEASURED_KEYS, 0), rank_map=rank_map, group=dist.group.WORLD,
                                rank=rank)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    for _ in range(2):  # warm-up
        step(False), step(True)
    opened[0] = 0
    step(True)
    parts_per_step = opened[0]
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for timed in ((False, True) if r % 2 == 0 else (True, False)):
            dist.barrier()
            times[timed].append(step(timed))
    return {"plain": times[False], "timed": times[True], "parts_per_step": parts_per_step}


def part_cost_s(n: int = 20000) -> tuple[float, float]:
    """Seconds one timed part costs on the CPU (enter, exit, its share of `collect`), and an empty `with`."""
    import contextlib

    from heteroflow.devices.facade import Device
    from heteroflow.devices.timing import PartTimer

    timer = PartTimer(Device.cpu().new_event)
    started = time.perf_counter()
    for _ in range(n):
        with timer.part("forward"):
            pass
    timer.collect()
    timed = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        with contextlib.nullcontext():
            pass
    return timed, (time.perf_counter() - started) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    load = os.getloadavg()
    started = time.time()
    results = run_ranks(_rank, 2, args, timeout_s=900)
    plain, timed = results[0]["plain"], results[0]["timed"]
    per_part_s, empty_s = part_cost_s()
    print(f"$ python benchmarks/bench_stage_timing.py --rounds {args.rounds}")
    print(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} before the run; whole run {time.time() - started:.0f} s; torch {torch.__version__}")
    print(f"one tp=2 stage on 2 gloo ranks (1 thread each): tiny-llama embedding + {args.num_layers} layers, "
          f"{args.micro_batches} micro-batches x {args.micro_batch_size} samples, fp32; {args.rounds} rounds")
    for name, values in (("plain", plain), ("timed", timed)):
        print(f"{name:6} median {statistics.median(values) * 1e3:8.2f} ms  min {min(values) * 1e3:8.2f} ms")
    print(f"one timed part: {per_part_s * 1e6:.1f} us (an empty `with`: {empty_s * 1e6:.2f} us); "
          f"{results[0]['parts_per_step']} parts per step here: {results[0]['parts_per_step'] * per_part_s * 1e3:.2f} ms"
          f" = {results[0]['parts_per_step'] * per_part_s / statistics.median(plain):.2%} of the plain median step")
    ratios = [t / p for t, p in zip(timed, plain)]
    print(f"timed / plain: {statistics.median(timed) / statistics.median(plain):.3f}x median step time, "
          f"{min(timed) / min(plain):.3f}x min, median of per-round ratios {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
