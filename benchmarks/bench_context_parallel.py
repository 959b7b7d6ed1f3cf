"""Context parallelism on a long sequence: cp 2 vs cp 1 (issue 15), measured beside the planner's predictions.

    python benchmarks/bench_context_parallel.py                 # 8192 tokens, ~3-5 min on 2 cores
    python benchmarks/bench_context_parallel.py --seq 4096 --steps 3

A tiny Llama (micro-llama's widths: hidden 64, 4 heads, 2 kv heads; `--layers` blocks) on one sequence of
`--seq` tokens per step, fp32, as one pipeline stage on 1 rank (cp 1) and on 2 ranks (cp 2), the machine's
cores split over the ranks as `heteroflow train --emulate` splits them (and as the planner prices them).
Per layout:

1. activation memory per rank: the bytes autograd saves for the backward during one forward of the stage
   (every saved tensor's storage counted once, through `saved_tensors_hooks`; embedding, blocks, head and
   loss), beside the planner's stored activations of the blocks (`memory_parts.stored`, per block, times
   the blocks), its whole-stage activations plus transient memory (`memory_gib`, which adds the logits,
   and for cp the re-gathered K/V of one block's backward), and that cp transient alone (`working`);
2. step time: `run_worker` trains `--steps` steps (the first dropped as warm-up; median of the rest) in
   `--rounds` launches per layout, alternating which layout goes first, beside the planner's
   `evaluate_plan(..., emulate=True)` step time.

Ratios are cp 2 / cp 1 from the same run. The machine is shared with other jobs: trust the ratios more than
the seconds. The report also goes to benchmarks/results/bench_context_parallel.txt (`--output`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.config import parse_job  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


QUICK = ["--seq", "256", "--layers", "1", "--steps", "2", "--rounds", "1", "--output", ""]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def make_job(cp: int, *, seq: int, layers: int, steps: int):
    model = {"preset": "micro-llama", "num_layers": layers, "seq_length": seq}
    return parse_job({
        "cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 2}]},
        "model": model,
        "train": {"global_batch_size": 1, "micro_batch_size": 1, "precision": "fp32", "steps": steps, "lr": 1e-3,
                  "min_lr": 1e-4, "warmup_steps": 1},
        "plan": {"micro_batch_size": 1, "stages": [{"devices": ["host:0-0" if cp == 1 else "host:0-1"],
                                                    "layers": layers, "cp": cp}]},
    })


def saved_activation_bytes(rank: int, world_size: int, job) -> int:
    """Bytes autograd keeps for the backward over one forward of this rank's stage (storages counted once)."""
    import torch
    import torch.distributed as dist

    from heteroflow.models import build_stage_model, init_weights, materialize, parallelize_stage
    from heteroflow.models.context_parallel import split_sequence

    spec, layout = job.model, job.plan.stages[0].layout
    with torch.device("meta"):
        model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    parallelize_stage(model, layout=layout, cp_group=dist.group.WORLD if layout.cp > 1 else None)
    materialize(model, "cpu")
    init_weights(model, seed=1)
    tokens = torch.randint(0, spec.vocab_size, (1, spec.seq_length + 1), generator=torch.Generator().manual_seed(0))
    x, labels = (split_sequence(t, cp=layout.cp, cp_rank=rank) for t in (tokens[:, :-1], tokens[:, 1:]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # weights are not activations
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, labels)
    loss.backward()
    return sum(seen.values())


def train_rank(rank: int, world_size: int, args):
    from heteroflow.runtime.worker import run_worker
    return run_worker(args)


def measure(cp: int, *, seq: int, layers: int, steps: int, work_dir: Path, threads: int | None) -> dict:
    from heteroflow.runtime.metrics import read_step_records
    from heteroflow.runtime.worker import WorkerArgs
    from heteroflow.stagemap import evaluate_plan
    from heteroflow.stagemap.costs import stage_costs
    from heteroflow.stagemap.estimate import job_hardware, stage_hardware
    from heteroflow.stagemap.hardware import threads_per_process
    from heteroflow.testing import run_ranks

    job = make_job(cp, seq=seq, layers=layers, steps=steps)
    estimate = evaluate_plan(job, job.plan, emulate=True)
    hardware = job_hardware(job, None, emulate=True, num_ranks=cp)
    hw, _ = stage_hardware(job, hardware, job.plan.stages[0])
    parts = stage_costs(job.model, hw, job.plan.stages[0].layout, 1, hardware).memory_parts
    if threads is None:
        threads = threads_per_process(os.cpu_count() or 1, cp)  # what `train --emulate` gives each rank
    saved = run_ranks(saved_activation_bytes, cp, job, timeout_s=600, threads_per_rank=threads)
    metrics = work_dir / f"cp{cp}.jsonl"
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=str(work_dir / "data"),
                      metrics_path=str(metrics), predicted_step_time_s=estimate.step_time_s, show_progress=False,
                      timeout_s=600)
    run_ranks(train_rank, cp, args, timeout_s=900, threads_per_rank=threads)
    times = [r["step_time_s"] for r in read_step_records(metrics)][1:]
    stage = estimate.stages[0].memory_gib
    return {"threads": threads, "saved_bytes": max(saved), "pred_stored_bytes": parts.stored["none"] * layers,
            "pred_stage_bytes": (stage["activations"] + stage["transient"]) * (1 << 30),
            "pred_working_bytes": parts.working["none"], "step_s": statistics.median(times),
            "pred_step_s": estimate.step_time_s, "losses": [r["loss"] for r in read_step_records(metrics)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches per layout, in alternating order (cp 1 first, then cp 2 first, ...)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: the cores split over the ranks, as `train --emulate` "
                             "and the planner do; 1 isolates the work per rank from intra-op threading)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "bench_context_parallel.txt"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    opts = parser.parse_args()
    if opts.quick:  # later arguments still override the quick sizes
        opts = parser.parse_args([*QUICK, *(sys.argv[1:])])
    rounds: list[dict[int, dict]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        for r in range(opts.rounds):  # the machine is shared: alternate the order so load drifts hit both
            order = (1, 2) if r % 2 == 0 else (2, 1)
            rounds.append({cp: measure(cp, seq=opts.seq, layers=opts.layers, steps=opts.steps,
                                       work_dir=Path(tmp, f"round{r}"), threads=opts.threads) for cp in order})
    results = {cp: {**rounds[0][cp], "step_s": statistics.median(x[cp]["step_s"] for x in rounds)} for cp in (1, 2)}
    mib = 1 << 20
    lines = [f"context parallelism: micro-llama widths, {opts.layers} layers, one sequence of {opts.seq} tokens per "
             f"step, fp32, {opts.steps} steps (first dropped); threads per rank: cp 1 {results[1]['threads']}, "
             f"cp 2 {results[2]['threads']}",
             f"{'':<34}{'cp 1':>12}{'cp 2':>12}{'cp2 / cp1':>12}"]

    def row(label: str, key: str, scale: float, unit: str) -> None:
        a, b = results[1][key] / scale, results[2][key] / scale
        lines.append(f"{label + ' (' + unit + ')':<34}{a:>12.2f}{b:>12.2f}{b / a:>12.2f}")

    row("activations saved, measured", "saved_bytes", mib, "MiB/rank")
    row("blocks' activations, planner", "pred_stored_bytes", mib, "MiB/rank")
    row("activations+transient, planner", "pred_stage_bytes", mib, "MiB/rank")
    lines.append(f"{'transient per block, planner (MiB)':<34}{results[1]['pred_working_bytes'] / mib:>12.2f}"
                 f"{results[2]['pred_working_bytes'] / mib:>12.2f}")
    row("step time, measured (median)", "step_s", 1.0, "s")
    for r, x in enumerate(rounds):
        lines.append(f"{f'  round {r} ' + ('cp 1 first' if r % 2 == 0 else 'cp 2 first') + ' (s)':<34}"
                     f"{x[1]['step_s']:>12.2f}{x[2]['step_s']:>12.2f}{x[2]['step_s'] / x[1]['step_s']:>12.2f}")
    row("step time, planner", "pred_step_s", 1.0, "s")
    lines.append(f"load average after the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (2 cores here)")
    lines.append(f"measured / predicted step time: cp 1 {results[1]['step_s'] / results[1]['pred_step_s']:.2f}, "
                 f"cp 2 {results[2]['step_s'] / results[2]['pred_step_s']:.2f}")
    lines.append("losses cp 1: " + ", ".join(f"{x:.6f}" for x in results[1]["losses"]))
    lines.append("losses cp 2: " + ", ".join(f"{x:.6f}" for x in results[2]["losses"]))
    report = "\n".join(lines)
    print(report)
    if opts.output:
        Path(opts.output).write_text(report + "\n")


if __name__ == "__main__":
    main()
