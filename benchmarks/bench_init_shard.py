"""Drawing one rank's share of a large weight vs the whole tensor (`heteroflow.models.init`).

    python benchmarks/bench_init_shard.py [--shape 8192,28672] [--tp 8] [--threads 1]

In one run, on one thread (torch's copy kernels contend badly with other jobs on a shared machine):
- `whole, one generator`: `torch.randn` of the full tensor from one generator, what every rank did before
  (then kept its slice);
- `whole, tiles`: `draw_normal` of the full tensor (a one-device model's init);
- `tp share, tiles`: `draw_normal` of one tp rank's rows, what a rank of a tp stage draws now.
Each figure is the best of `--repeats`; ratios against the first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from heteroflow.models.init import draw_normal, param_seed  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)

QUICK = ["--shape", "1024,2048", "--repeats", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8192,28672", help="a Llama-3 70B MLP matrix by default")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    rows = shape[0] // args.tp
    full_box = tuple((0, size) for size in shape)
    share_box = ((0, rows), *full_box[1:])
    cases = [
        ("whole, one generator", lambda: torch.randn(shape, generator=torch.Generator().manual_seed(
            param_seed(0, "w")))),
        ("whole, tiles", lambda: draw_normal("w", shape, full_box, seed=0)),
        (f"tp share 1/{args.tp}, tiles", lambda: draw_normal("w", shape, share_box, seed=0)),
    ]
    drawn = {"whole, tiles": draw_normal("w", shape, full_box, seed=0)[1],
             f"tp share 1/{args.tp}, tiles": draw_normal("w", shape, share_box, seed=0)[1]}
    print(f"shape {shape}, {args.threads} thread(s), best of {args.repeats}")
    base = None
    for name, fn in cases:
        seconds = best(fn, args.repeats)
        base = base or seconds
        count = drawn.get(name, torch.Size(shape).numel())
        print(f"{name:<26} {seconds:8.3f} s  x{seconds / base:6.3f}  elements drawn {count:>12,}")


if __name__ == "__main__":
    main()
