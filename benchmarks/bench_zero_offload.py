"""ZeRO-Offload vs the offloaded optimizer without ZeRO on the same emulated stage: per-rank state bytes in the
offload tier and step time.

    python benchmarks/bench_zero_offload.py                  # 3 rounds, 5 steps per run
    python benchmarks/bench_zero_offload.py --rounds 5 --steps 6

The plan: one stage of dp 2 (two emulated CPU ranks) training tiny-llama (128 tokens, micro-batches of 2), the
optimizer state on the CPU, run by the real worker (`run_worker`, torch's AdamW kernel) in three settings:
- `zero0-cpu`: every dp rank keeps all of the fp32 master weights and moments on the host (the baseline);
- `zero1-cpu`: ZeRO-Offload: each keeps 1/dp of them; host gradients reduce-scattered, weights all-gathered;
- `zero1-device`: the same ZeRO-1 with the state on the device (`DataParallelAdamW`), for reference.
Per run: the median step time after the first (warm-up) step from the metrics, and each rank's optimizer bytes
in its tier (from the offload report). Each round runs the settings in a shuffled order; ratios are against
`zero0-cpu` of the same round, then the median over rounds. On two emulated ranks sharing a CPU the host Adam is
a small part of a step; the state bytes are the figure that matters.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.config import parse_job  # noqa: E402
from heteroflow.offload.optimizer import ADAM_ENV  # noqa: E402
from heteroflow.runtime.metrics import read_step_records  # noqa: E402
from heteroflow.runtime.worker import WorkerArgs  # noqa: E402
from heteroflow.testing.training import run_training  # noqa: E402

SETTINGS = {"zero0-cpu": (0, {"optimizer": "cpu"}), "zero1-cpu": (1, {"optimizer": "cpu"}), "zero1-device": (1, {})}


QUICK = ["--rounds", "1", "--steps", "2"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def run(setting: str, *, steps: int, tmp: Path) -> tuple[float, list[int]]:
    """Median step time after the first step, and each rank's optimizer bytes in its tier."""
    zero, offload = SETTINGS[setting]
    stage = {"devices": ["a:0-1"], "layers": 4, "dp": 2, "zero": zero, **({"offload": offload} if offload else {})}
    job = parse_job({"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 2}]},
                     "model": {"preset": "tiny-llama", "num_layers": 4, "seq_length": 128},
                     "train": {"global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32", "steps": steps,
                               "offload_dir": str(tmp)},
                     "plan": {"micro_batch_size": 2, "stages": [stage]}})
    metrics = tmp / f"{setting}.jsonl"
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=str(tmp / "data"),
                      show_progress=False, timeout_s=600, metrics_path=str(metrics))
    results = run_training(args, timeout_s=900, env={ADAM_ENV: "torch"})
    times = [r["step_time_s"] for r in read_step_records(metrics)][1:]
    held = [r.offload["optimizer_tier_bytes"] if r.offload else 0 for r in results]
    return statistics.median(times), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    opts = parser.parse_args()
    if opts.quick:  # later arguments still override the quick sizes
        opts = parser.parse_args([*QUICK, *(sys.argv[1:])])
    ratios: dict[str, list[float]] = {s: [] for s in SETTINGS}
    held: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(opts.rounds):
            order = list(SETTINGS)
            random.Random(k).shuffle(order)
            times = {}
            for setting in order:
                times[setting], held[setting] = run(setting, steps=opts.steps, tmp=Path(tmp))
            for setting in SETTINGS:
                ratios[setting].append(times[setting] / times["zero0-cpu"])
            print(f"round {k}: " + ", ".join(f"{s} {times[s] * 1e3:.1f} ms" for s in SETTINGS), flush=True)
    base = held["zero0-cpu"]
    for setting in SETTINGS:
        tier = held[setting]
        share = f"{tier[0] / base[0]:.3f}x" if tier[0] else "none (on the device)"
        print(f"{setting:13s} step time {statistics.median(ratios[setting]):.2f}x of zero0-cpu; optimizer bytes in "
              f"the tier per rank {tier} = {share} of zero0-cpu's {base[0]}")


if __name__ == "__main__":
    main()
