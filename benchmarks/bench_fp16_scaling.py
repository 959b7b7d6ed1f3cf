"""Step time of fp16 with dynamic loss scaling vs bf16 on the same emulated plan (the scaler's overhead).

    python benchmarks/bench_fp16_scaling.py                 # 6 rounds, 6 steps per run
    python benchmarks/bench_fp16_scaling.py --rounds 10 --steps 8

The plan: tiny-llama over two pipeline stages (one emulated CPU rank each, 1F1B, 8 micro-batches of 2
samples x 128 tokens a step), trained by the real worker (`run_worker`) in three settings:
- `bf16`: no loss scaling (what a bf16 job runs);
- `bf16+scaler`: bf16 with `loss_scale: dynamic`: the same kernels plus everything the scaler adds (the loss
  multiplied, 1/scale folded into the clip coefficient, the scaler update): the overhead alone;
- `fp16+scaler`: fp16 with dynamic scaling, what an fp16 stage runs. On the CPU this also changes the matmul
  kernels (fp16 and bf16 GEMMs run at different speeds), so it measures more than the scaler.
The initial scale is 2**16, so no step overflows and every step does the same work (a skipped step has no
optimizer step and would look cheaper). Each round runs the settings in a shuffled order, so all see
the same machine load. Two figures per run: the median wall-clock step time after the first (warm-up)
step, from the metrics; and the CPU time per step, summed over both ranks' processes over the whole
training loop (what the cores did, much less disturbed by other jobs on a shared machine than wall time,
though a step's waits for the other stage are not in it). Ratios: the median of the per-round ratios, and
the ratio of the overall medians.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from heteroflow.config import parse_job  # noqa: E402
from heteroflow.runtime.metrics import read_step_records  # noqa: E402
from heteroflow.runtime.worker import WorkerArgs, run_worker  # noqa: E402
from heteroflow.testing import run_ranks  # noqa: E402

CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 1},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 1}]}
PLAN = {"schedule": "1f1b", "micro_batch_size": 2, "stages": [
    {"devices": ["gpu-0"], "layers": 4}, {"devices": ["npu-0"], "layers": 4}]}
SETTINGS = {"bf16": {"precision": "bf16"},
            "bf16+scaler": {"precision": "bf16", "loss_scale": "dynamic", "initial_loss_scale": 2.0**16},
            "fp16+scaler": {"precision": "fp16", "initial_loss_scale": 2.0**16}}


QUICK = ["--rounds", "1", "--steps", "2"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def _rank(rank: int, world_size: int, args: WorkerArgs) -> float:
    """Train; this rank's process CPU time in the training loop (model building and joining excluded)."""
    import heteroflow.runtime.worker as worker

    loop, spent = worker._train_steps, []

    def timed(*a, **k):
        started = time.process_time()
        try:
            return loop(*a, **k)
        finally:
            spent.append(time.process_time() - started)

    worker._train_steps = timed  # this rank's process only: a benchmark's probe, not a hook of the runtime
    run_worker(args)
    return spent[0]


def run(setting: str, *, steps: int, data_dir: str, work: Path) -> tuple[list[float], float, list[dict]]:
    """Train `steps` steps in `setting`; the wall step times after the first, the CPU seconds per step (both
    ranks), and every metrics record."""
    train = {"global_batch_size": 16, "micro_batch_size": 2, "steps": steps, "lr": 3e-3, "min_lr": 3e-4,
             "warmup_steps": 2, **SETTINGS[setting]}
    job = parse_job({"cluster": CLUSTER, "model": {"preset": "tiny-llama"}, "train": train, "plan": PLAN})
    metrics = work / f"{setting}-{time.monotonic_ns()}.jsonl"
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir, show_progress=False,
                      timeout_s=300, metrics_path=str(metrics))
    cpu_s = sum(run_ranks(_rank, 2, args, timeout_s=600)) / steps
    records = read_step_records(metrics)
    return [r["step_time_s"] for r in records[1:]], cpu_s, records


def scaler_bookkeeping_s(repeats: int = 20000) -> float:
    """Seconds per step of what the scaler adds outside the kernels: the loss multiplied by the scale (an fp32
    scalar tensor op per micro-batch, 8 here), the norm and clip arithmetic, the update."""
    from heteroflow.optim.loss_scale import LossScaler

    scaler = LossScaler(scale=2.0**16)
    loss = torch.tensor(5.0, requires_grad=True)
    started = time.process_time()
    for i in range(repeats):
        for _ in range(8):
            _ = loss.float() * scaler.scale / 4096
        norm = 1.5e5 / scaler.scale
        _ = min(1.0, 1.0 / (norm + 1e-6)) / scaler.scale
        scaler.update(i % 1000 == 999)
    return (time.process_time() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is a warm-up)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    options = parser.parse_args()
    if options.quick:  # later arguments still override the quick sizes
        options = parser.parse_args([*QUICK, *(sys.argv[1:])])
    started = time.perf_counter()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rng = random.Random(0)
    per_round: list[dict[str, float]] = []
    cpu_rounds: list[dict[str, float]] = []
    all_times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    losses: dict[str, list[float]] = {}
    skipped = {s: 0 for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench-fp16-") as tmp:
        work = Path(tmp)
        data_dir = str(work / "data")
        for _ in range(options.rounds):
            order = list(SETTINGS)
            rng.shuffle(order)
            medians, cpu = {}, {}
            for setting in order:
                times, cpu[setting], records = run(setting, steps=options.steps, data_dir=data_dir, work=work)
                medians[setting] = statistics.median(times)
                all_times[setting] += times
                losses[setting] = [r["loss"] for r in records]
                skipped[setting] += sum(bool(r.get("skipped")) for r in records)
            per_round.append(medians)
            cpu_rounds.append(cpu)
    print(f"$ python benchmarks/bench_fp16_scaling.py --rounds {options.rounds} --steps {options.steps}")
    print(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, {os.cpu_count()}-core machine shared with other "
          f"jobs, load average {load} before the run; whole run {time.perf_counter() - started:.0f} s; "
          f"torch {torch.__version__}")
    print("plan: tiny-llama (8 layers, hidden 128) over 2 pipeline stages, one emulated CPU rank each, 1F1B, "
          "8 micro-batches x 2 samples x 128 tokens per step; initial loss scale 2**16")
    print(f"{options.rounds} rounds, settings in a shuffled order per round; {options.steps} steps per run, "
          "the first a warm-up")
    print(f"skipped steps: {skipped}")
    bookkeeping = scaler_bookkeeping_s()
    bf16_cpu = statistics.median(r["bf16"] for r in cpu_rounds)
    print(f"scaler bookkeeping outside the kernels: {bookkeeping * 1e6:.1f} us of CPU per step, "
          f"{100 * bookkeeping / bf16_cpu:.3f}% of bf16's CPU time per step")
    print("losses of the last run's steps:")
    for setting, values in losses.items():
        print(f"  {setting:12s} " + "  ".join(f"{v:.4f}" for v in values))
    print(f"{'setting':12s} {'wall s':>7s} {'p10 s':>7s} {'cpu s':>7s}   per-round wall medians s | cpu s per step")
    for setting, times in all_times.items():
        p10 = sorted(times)[len(times) // 10]
        rounds = " ".join(f"{r[setting]:.3f}" for r in per_round)
        cpu = " ".join(f"{r[setting]:.3f}" for r in cpu_rounds)
        median_cpu = statistics.median(r[setting] for r in cpu_rounds)
        print(f"{setting:12s} {statistics.median(times):7.3f} {p10:7.3f} {median_cpu:7.3f}   {rounds} | {cpu}")
    for setting in ("bf16+scaler", "fp16+scaler"):
        for what, rounds in (("wall", per_round), ("cpu", cpu_rounds)):
            ratios = [r[setting] / r["bf16"] for r in rounds]
            overall = statistics.median(r[setting] for r in rounds) / statistics.median(r["bf16"] for r in rounds)
            print(f"{setting} / bf16 {what:4s} time per step: {statistics.median(ratios):.3f}x (median of per-round "
                  f"ratios; {overall:.3f}x from the medians; per round " + " ".join(f"{x:.2f}" for x in ratios) + ")")


if __name__ == "__main__":
    main()
